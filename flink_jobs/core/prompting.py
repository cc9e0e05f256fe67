"""Rendering a shopper's session into chat messages from a Jinja template.

Templates live in ``prompts/``; each defines two macros, ``system()`` and ``user()``. The
renderer, not the template, owns the safety rules: ``StrictUndefined`` so a typo in a
template fails loudly, the ``untrusted`` filter for any text a shopper or seller typed,
and a token budget (``prompt.max_prompt_tokens``) kept by dropping the oldest events first:
as few as make the prompt fit, never the newest event (the one that fired the prompt), and
never the session's facts, which the template renders whole.

With template arms (``prompt.arms``, ``core/arms.py``), :class:`ArmRenderer` renders each
shopper with its arm's template and names the arm's model on the prompt.

Tokens are counted by ``core/token_budget.py``: exactly, with the model's tokenizer and chat
template when ``prompt.tokenizer_path`` names them, else by a bound that cannot undercount
(UTF-8 bytes plus the template's overhead), so a prompt within the budget always fits the
model's context (``AppConfig.validate`` checks that the budget and ``llm.max_tokens`` fit in
``llm.max_model_len``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import orjson

from flink_jobs.config import PromptConfig
from flink_jobs.core.arms import Arm, assign_arm, parse_arms
from flink_jobs.core.events import ShopperEvent, load_schema, pickled_by_fields
from flink_jobs.core.grounding import GroundedFacts, grounded_facts, leaf_category, rules_intent
from flink_jobs.core.session import SessionState
from flink_jobs.core.token_budget import TokenCounter, token_counter
from flink_jobs.paths import resource_dir

PROMPTS_DIR = resource_dir("prompts")
#: Quoted texts remembered by ``untrusted`` (each at most ``prompt.max_text_chars``).
UNTRUSTED_CACHE_SIZE = 8192
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
#: Format characters (Unicode category Cf, as of Unicode 15): the soft hyphen, Arabic and
#: Syriac number marks, ALM, Mongolian vowel separator, zero-width characters, LRM/RLM,
#: bidi embeddings and isolates, word joiner and invisible operators, BOM, interlinear
#: annotations, Kaithi, Egyptian, shorthand and musical format controls, and the tag
#: characters. tests/unit/test_quoted_text_hides_no_characters.py checks it against the
#: running Python's Unicode database.
_FORMAT = re.compile(
    "[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    "\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    "\U000e0020-\U000e007f]"
)
#: Brackets that read as ``<`` or ``>`` and that NFKC leaves as they are, made plain (a
#: ``str.translate`` table).
ANGLE_LOOKALIKES = str.maketrans(
    dict.fromkeys("\u2039\u3008\u27e8\u02c2\u2329\u29fc\u1438", "<")
    | dict.fromkeys("\u203a\u3009\u27e9\u02c3\u232a\u29fd\u1433", ">")
)


class PromptError(ValueError):
    """The template is missing or broken, or the session can't fit the token budget."""


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    messages: tuple[dict[str, str], ...]
    template: str
    template_hash: str
    #: The prompt's tokens as the budget counted them (token_budget.py): exact with the
    #: model's tokenizer, an upper bound without it.
    estimated_tokens: int
    events_included: int
    events_dropped: int
    #: The model this prompt is for: its A/B arm's (prompt.arms); empty: llm.model.
    model: str = ""

    @property
    def arm(self) -> str:
        """The A/B arm's name (``arms.Arm.name``): the template, and its model if named."""
        return Arm(self.template, 0, self.model).name


def untrusted(value: Any, max_chars: int) -> str:
    """Quote text from outside so that what the model reads is what a person would see,
    and nothing in it can open or close a delimiter block: control and line-breaking
    characters made spaces; format characters dropped (category Cf: tag characters,
    zero-width characters, direction marks: invisible, they can hide an instruction or
    split a word a filter looks for); NFKC-normalised (full-width and small-form lookalikes
    become plain characters); other brackets that read as ``<`` or ``>`` made plain
    (``ANGLE_LOOKALIKES``); cut to length; JSON-escaped; and no raw ``<`` (``>`` alone
    can't close a block).

    Remembered for the most recent texts: a shopper's successive prompts repeat the same
    titles, categories and brands, and so does a catalogue across shoppers."""
    return _quoted(value if type(value) is str else str(value), max_chars)


@functools.lru_cache(maxsize=UNTRUSTED_CACHE_SIZE)
def _quoted(value: str, max_chars: int) -> str:
    text = _FORMAT.sub("", _CONTROL.sub(" ", value))
    text = unicodedata.normalize("NFKC", text).translate(ANGLE_LOOKALIKES)[:max_chars]
    quoted = orjson.dumps(text).decode("utf-8")
    return quoted.replace("<", "\\u003c")


def intent_labels() -> tuple[str, ...]:
    schema = load_schema("shopper_intent.schema.json")
    return tuple(schema["properties"]["intents"]["items"]["properties"]["label"]["enum"])


class PromptRenderer:
    """Renders one template. ``counter`` counts the prompt's tokens for the budget (by
    default the one ``prompt.tokenizer_path`` names: ``token_budget.token_counter``)."""

    def __init__(self, config: PromptConfig, counter: TokenCounter | None = None) -> None:
        directory = Path(config.templates_dir) if config.templates_dir else PROMPTS_DIR
        self._config = config
        self._env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(directory),
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=False,
        )
        self._env.filters["untrusted"] = lambda v: untrusted(v, config.max_text_chars)
        # A catalogue path's last level, sanitised (grounding.leaf_category): compact
        # templates name a category by its leaf only.
        self._env.filters["leaf"] = leaf_category
        try:
            self._template = self._env.get_template(config.template)
        except jinja2.TemplateNotFound as exc:
            raise PromptError(
                f"prompt template {config.template!r} not found in {directory}"
            ) from exc
        except jinja2.TemplateSyntaxError as exc:
            raise PromptError(
                f"prompt template {config.template!r} line {exc.lineno}: {exc.message}"
            ) from exc
        source = (directory / config.template).read_bytes()
        self.template_name = config.template
        self.template_hash = hashlib.sha256(source).hexdigest()[:12]
        self._labels = intent_labels()
        self._counter = counter if counter is not None else token_counter(config.tokenizer_path)
        self._check_fixed_text_fits()

    def render(self, state: SessionState, facts: GroundedFacts | None = None) -> RenderedPrompt:
        """``facts``: the session's ``grounded_facts``, when the caller has them already."""
        facts = facts if facts is not None else grounded_facts(state)
        rules = rules_intent(facts, state).body["intents"][0]
        events = list(state.events)
        budget = self._config.max_prompt_tokens

        def attempt(dropped: int) -> tuple[tuple[dict[str, str], ...], int]:
            system, user = self._render_parts(state, events[dropped:], facts, rules)
            messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
            return messages, self._counter.count(messages)

        dropped = 0
        messages, tokens = attempt(0)
        if tokens > budget:
            fits = _fewest_to_drop(attempt, len(events), tokens, budget, self._fixed_tokens)
            if fits is None:
                alone = attempt(max(len(events) - 1, 0))[1]
                raise PromptError(
                    f"prompt for shopper {state.shopper_id} needs {alone} tokens "
                    f"({self._counter.method}) even with only its newest event; raise "
                    f"prompt.max_prompt_tokens ({budget}) or lower prompt.max_text_chars"
                )
            dropped, messages, tokens = fits
        return RenderedPrompt(
            messages=messages,
            template=self.template_name,
            template_hash=self.template_hash,
            estimated_tokens=tokens,
            events_included=len(events) - dropped,
            events_dropped=dropped,
        )

    def _check_fixed_text_fits(self) -> None:
        """Refuse at start a template whose text around the events cannot fit the budget:
        every prompt of it would be refused one by one."""
        event = ShopperEvent("e", "s", "search", 0, query="q")
        state = SessionState("s", events=(event,), session_started_ms=0, newest_event_ms=0)
        facts = grounded_facts(state)
        rules = rules_intent(facts, state).body["intents"][0]
        system, user = self._render_parts(state, [event], facts, rules)
        messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
        tokens = self._fixed_tokens = self._counter.count(messages)
        if tokens > self._config.max_prompt_tokens:
            raise PromptError(
                f"prompt template {self.template_name!r} needs {tokens} tokens "
                f"({self._counter.method}) for its fixed text and a one-event session, over "
                f"prompt.max_prompt_tokens ({self._config.max_prompt_tokens}): set "
                "prompt.tokenizer_path to the model's folder to count exactly, or a larger "
                "budget if llm.max_model_len allows it"
            )

    def _render_parts(
        self,
        state: SessionState,
        events: list[ShopperEvent],
        facts: GroundedFacts,
        rules: dict[str, Any],
    ) -> tuple[str, str]:
        start = state.session_started_ms or (events[0].event_time_ms if events else 0)
        context = {
            "labels": self._labels,
            "history": state.history,
            "events": [_event_view(e, start) for e in events],
            # The whole session's exact facts (grounding.py), even when the budget cut events.
            "facts": facts,
            # What the documented rules read from them (the rules-only record's top intent).
            "rules": {"label": rules["label"], "category": rules.get("category")},
        }
        try:
            module = self._template.make_module(context)
            # The template's macros are its module's attributes, which jinja's types cannot name.
            system = module.system()  # type: ignore[attr-defined]
            user = module.user()  # type: ignore[attr-defined]
            return str(system).strip(), str(user).strip()
        except jinja2.UndefinedError as exc:
            raise PromptError(f"prompt template {self.template_name!r}: {exc.message}") from exc


Attempt = Callable[[int], tuple[tuple[dict[str, str], ...], int]]


def _fewest_to_drop(
    attempt: Attempt, events: int, full_tokens: int, budget: int, base_tokens: int
) -> tuple[int, tuple[dict[str, str], ...], int] | None:
    """The fewest oldest events to drop (never the newest) for the prompt to fit ``budget``,
    with the prompt and its count; None when even the newest alone does not fit.

    ``attempt(dropped)`` renders and counts. A search over the number dropped (fewer events,
    fewer tokens), each guess interpolated from the counts seen so far (``base_tokens``: a
    prompt of about one event), so a prompt takes two or three renders, not one per event."""
    low, high = 1, events - 1  # the answer, if any, is within [low, high]
    known = [(0, full_tokens), (events - 1, base_tokens)]  # (dropped, tokens), near the bracket
    best = None
    while low <= high:
        (cut_a, tokens_a), (cut_b, tokens_b) = known
        per_event = (tokens_a - tokens_b) / (cut_b - cut_a) if cut_b > cut_a else 0
        guess = cut_a + math.ceil((tokens_a - budget) / per_event) if per_event > 0 else low
        guess = min(max(guess, low), high)
        messages, tokens = attempt(guess)
        if tokens <= budget:
            best, high = (guess, messages, tokens), guess - 1
            known[1] = (guess, tokens)
        else:
            low = guess + 1
            known[0] = (guess, tokens)
    return best


class EventView(NamedTuple):
    """An event as a template sees it. Attributes, not a dict: Jinja reads ``e.title`` with
    ``getattr`` first, and on a dict that fails and raises before the item is read."""

    minute: str
    event_type: str
    query: str | None
    title: str | None
    category: str | None
    brand: str | None
    price: float | None
    quantity: int


def _event_view(e: ShopperEvent, session_start_ms: int) -> EventView:
    offset_s = max(0, (e.event_time_ms - session_start_ms) // 1000)
    return EventView(
        f"+{offset_s // 60:02d}:{offset_s % 60:02d}",
        e.event_type,
        e.query,
        e.title,
        e.category,
        e.brand,
        e.price,
        e.quantity,
    )


class ArmRenderer:
    """Renders each shopper with its A/B arm's template (``prompt.arms``; one arm,
    ``prompt.template``, when unset) and names the arm's model on the prompt. Every arm's
    template is loaded at start, so a missing or broken one fails the job at once."""

    def __init__(self, config: PromptConfig, counter: TokenCounter | None = None) -> None:
        self.arms = parse_arms(config.arms, config.template)
        counter = counter if counter is not None else token_counter(config.tokenizer_path)
        self._renderers: dict[str, PromptRenderer] = {}
        for arm in self.arms:
            if arm.template not in self._renderers:
                try:
                    self._renderers[arm.template] = PromptRenderer(
                        dataclasses.replace(config, template=arm.template), counter
                    )
                except PromptError as exc:
                    raise PromptError(f"prompt.arms: {exc}") from exc
        self._single = self.arms[0] if len(self.arms) == 1 else None

    @property
    def arm_names(self) -> tuple[str, ...]:
        return tuple(arm.name for arm in self.arms)

    def arm_of(self, shopper_id: str) -> Arm:
        return self._single or assign_arm(shopper_id, self.arms)

    def render(self, state: SessionState, facts: GroundedFacts | None = None) -> RenderedPrompt:
        arm = self.arm_of(state.shopper_id)
        prompt = self._renderers[arm.template].render(state, facts)
        return dataclasses.replace(prompt, model=arm.model) if arm.model else prompt
