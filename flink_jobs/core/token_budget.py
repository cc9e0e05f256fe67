"""How many tokens a rendered prompt takes in the model's context, for the prompt budget.

The server counts the chat template rendered around the messages, tokenized with the
model's tokenizer; a prompt whose tokens plus ``llm.max_tokens`` exceed the model's context
is refused (a 400), and every prompt of that shopper would be refused the same way. So the
budget (``prompt.max_prompt_tokens``) is kept with a count that never undercounts:

- :class:`ChatTemplateTokens`, exact: the model folder's ``tokenizer.json`` (the
  ``tokenizers`` library) and its chat template, rendered and tokenized as vLLM's chat
  endpoint does (``add_generation_prompt`` on, no special tokens added by the tokenizer).
  Used when ``prompt.tokenizer_path`` names the model folder (or a ``tokenizer.json``
  alone: then the template's own tokens are bounded by :data:`CHAT_OVERHEAD_TOKENS`), and
  by default (``auto``) with the bundled model's tokenizer, shipped with the templates;
- :class:`Utf8Bound`, a bound that holds without the model's files (Managed Flink ships no
  model folder): in a byte-level BPE vocabulary (Llama 3, Qwen, SmolLM2, GPT-2 and their
  kin) every token covers at least one UTF-8 byte, so a text's byte count bounds its token
  count, whatever its script; the chat template's role markers and separators add at most
  :data:`CHAT_OVERHEAD_TOKENS`. It counts English about four times over, so a job that has
  the tokenizer should use it: a template whose fixed text alone is over the budget by this
  count (v2 and v3, about 5 KB of instructions, against 3,500) refuses to start without it.

An estimate of bytes / 3 undercounted Japanese, Chinese, emoji and digit-heavy titles by up
to half (``docs/faults.md#prompt-context``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

from flink_jobs.config import AUTO_TOKENIZER, BUNDLED_MODEL
from flink_jobs.paths import resource_dir

log = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, str]]

#: A bound on the tokens a chat template adds around a system and a user message and for
#: the assistant's turn: ChatML templates (SmolLM2, Qwen) add 11, Llama 3's about 30 with
#: its date header (tests/unit/test_token_budget.py measures the bundled model's).
CHAT_OVERHEAD_TOKENS = 64

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """The configured tokenizer cannot be loaded or cannot render the chat template."""


class TokenCounter(Protocol):
    """Counts the tokens a prompt's messages take in the model's context."""

    #: How it counts, for logs and measurements: ``tokenizer`` or ``utf8_bound``.
    method: str

    def count(self, messages: Messages) -> int: ...


class Utf8Bound:
    """An upper bound on the tokens of ``messages`` for any byte-level BPE model: their
    UTF-8 bytes plus the chat template's overhead (module docstring)."""

    method = "utf8_bound"

    def __init__(self, overhead_tokens: int = CHAT_OVERHEAD_TOKENS) -> None:
        self.overhead_tokens = overhead_tokens

    def count(self, messages: Messages) -> int:
        return self.overhead_tokens + sum(len(m["content"].encode("utf-8")) for m in messages)


class ChatTemplateTokens:
    """The exact token count of ``messages`` as the model's server computes it: the chat
    template rendered (``add_generation_prompt`` on), then tokenized without added special
    tokens. Without a template, the messages' tokens plus :data:`CHAT_OVERHEAD_TOKENS`.

    ``encode`` (text to token count) and the template are injectable; :meth:`from_path`
    loads the real ones."""

    method = "tokenizer"

    def __init__(
        self,
        encode: Callable[[str], int],
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self._encode = encode
        self._render: Callable[[Messages], str] | None = None
        if chat_template is not None:
            self._render = _template_renderer(chat_template, special_tokens or {})

    @classmethod
    def from_path(cls, path: str | Path) -> ChatTemplateTokens:
        """A model folder (``tokenizer.json``, and ``chat_template.jinja`` or
        ``tokenizer_config.json``'s ``chat_template``), or a ``tokenizer.json`` alone."""
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerError(
                "prompt.tokenizer_path needs the tokenizers library: pip install tokenizers"
            ) from exc
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from exc
        template, specials = _chat_template(folder) if path.is_dir() else (None, {})

        def whole(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)

        encode = _by_segments(tokenizer, whole) or whole
        counter = cls(encode, template, specials)
        try:  # a template that cannot render fails the job at start, not at its first prompt
            counter.count([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except Exception as exc:
            raise TokenizerError(f"the chat template of {folder} does not render: {exc}") from exc
        return counter

    def count(self, messages: Messages) -> int:
        if self._render is None:
            return CHAT_OVERHEAD_TOKENS + sum(self._encode(m["content"]) for m in messages)
        return self._encode(self._render(messages))


#: Text between special tokens whose counts are remembered: the template's fixed
#: instructions, the same in every prompt, are tokenized once.
SEGMENT_CACHE_SIZE = 256
_PROBE = "Intent: <|x|> 买 ヘッドホン, Наушники 🎧 123456 7890 \n\n  end."


def _by_segments(tokenizer: Any, whole: Callable[[str], int]) -> Callable[[str], int] | None:
    """A count that tokenizes the text between the tokenizer's special tokens separately and
    remembers each piece's count, as exact as ``whole``: the tokenizer cuts its added tokens
    out before anything else, so the pieces never merge. None when an added token strips
    the spaces beside it or matches whole words only (a cut there would not be the
    tokenizer's), or when a probe does not count the same both ways."""
    added = list(tokenizer.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    specials = re.compile("|".join(re.escape(c) for c in contents))
    piece = functools.lru_cache(maxsize=SEGMENT_CACHE_SIZE)(whole)

    def count(text: str) -> int:
        total, start = 0, 0
        for match in specials.finditer(text):
            if match.start() > start:
                total += piece(text[start : match.start()])
            total += 1
            start = match.end()
        return total + (piece(text[start:]) if start < len(text) else 0)

    probe = f"{contents[0]}system\n{_PROBE}{contents[-1]}\n{contents[0]}user\n{_PROBE}"
    return count if count(probe) == whole(probe) else None


def bundled_tokenizer_dir() -> Path:
    """The bundled model's tokenizer, shipped as package data beside the templates
    (``prompts/tokenizer/<model>/``: ``tokenizer.json``, its chat template and special
    tokens), so the job counts exactly wherever it runs, Managed Flink included."""
    return resource_dir("prompts") / "tokenizer" / BUNDLED_MODEL


def token_counter(tokenizer_path: str) -> TokenCounter:
    """The counter ``prompt.tokenizer_path`` names: exact for a path; for ``auto``, exact
    with the bundled model's tokenizer (:func:`bundled_tokenizer_dir`) when the
    ``tokenizers`` library is installed, else the bound; for ``""``, the bound. Loaded
    once per path."""
    if tokenizer_path == AUTO_TOKENIZER:
        folder = bundled_tokenizer_dir()
        if not (folder / "tokenizer.json").exists() or find_spec("tokenizers") is None:
            log.info("prompt budget: no tokenizer at %s; counting UTF-8 bytes (a bound)", folder)
            return Utf8Bound()
        tokenizer_path = str(folder)
    if not tokenizer_path:
        return Utf8Bound()
    return _loaded(str(Path(tokenizer_path).resolve()))


@functools.lru_cache(maxsize=8)
def _loaded(path: str) -> ChatTemplateTokens:
    counter = ChatTemplateTokens.from_path(path)
    log.info("prompt budget: counting tokens with the tokenizer at %s", path)
    return counter


def _chat_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot read {config_path}: {exc}") from exc
    template_path = folder / "chat_template.jinja"
    template = template_path.read_text(encoding="utf-8") if template_path.exists() else None
    if template is None and isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    specials = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return template, specials


def _template_renderer(source: str, specials: Mapping[str, str]) -> Callable[[Messages], str]:
    """Renders a Hugging Face chat template as ``apply_chat_template`` does: a sandboxed
    Jinja environment with ``trim_blocks`` and ``lstrip_blocks``."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(source)

    def render(messages: Messages) -> str:
        return template.render(
            messages=[dict(m) for m in messages], add_generation_prompt=True, **specials
        )

    return render
