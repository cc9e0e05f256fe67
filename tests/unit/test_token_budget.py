"""The prompt budget holds in the model's own tokens, whatever the script of the shoppers'
text: a rendered prompt and the answer's ``llm.max_tokens`` fit the model's context.

Tokens are counted here as the vLLM worker counts them, by the router's reproduction of it
(``inference_sidecar.kv.prompt_tokens``: the model folder's chat template rendered, then its
tokenizer.json), independently of the job's own counter. The model is the bundled one,
``<cache>/models/SmolLM2-135M-Instruct``, which ``scripts/setup.sh`` installs.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as count_case
from hypothesis import strategies as st

from flink_jobs.config import (
    AUTO_TOKENIZER,
    BUNDLED_MODEL,
    AppConfig,
    ConfigError,
    LlmConfig,
    PromptConfig,
    load_config,
)
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.prompting import PromptError, PromptRenderer, RenderedPrompt
from flink_jobs.core.session import SessionState
from flink_jobs.core.token_budget import (
    CHAT_OVERHEAD_TOKENS,
    ChatTemplateTokens,
    Utf8Bound,
    token_counter,
)
from flink_jobs.paths import cache_dir
from tests.support.builders import T0

MODEL_DIR = cache_dir() / "models" / BUNDLED_MODEL
if not (MODEL_DIR / "tokenizer.json").exists():
    pytest.skip(
        f"the bundled model is not installed at {MODEL_DIR}: run scripts/setup.sh",
        allow_module_level=True,
    )

from inference_sidecar.kv.prompt_tokens import PromptTokenizer  # noqa: E402 (after the skip)

LLM = LlmConfig()
PROMPT = PromptConfig()
TEMPLATES = ("shopper_intent_v1.j2", "shopper_intent_v2.j2", "shopper_intent_v3.j2")
PROPERTY = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

_reference = PromptTokenizer.from_model_dir(MODEL_DIR)
_exact = ChatTemplateTokens.from_path(MODEL_DIR)


def served_tokens(prompt: RenderedPrompt) -> int:
    """The prompt's tokens as the vLLM worker computes them."""
    ids = _reference.token_ids("chat/completions", {"messages": list(prompt.messages)})
    assert ids is not None
    return len(ids)


def renderer(template: str, counter=_exact, **overrides) -> PromptRenderer:
    return PromptRenderer(PromptConfig(template=template, **overrides), counter)


# --- text in any script ---------------------------------------------------------------------

SCRIPTS = {
    "cjk": st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    "kana": st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),
    "hangul": st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),
    "cyrillic": st.characters(min_codepoint=0x0400, max_codepoint=0x04FF),
    "arabic": st.characters(min_codepoint=0x0600, max_codepoint=0x06FF),
    "emoji": st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
    "digits": st.sampled_from("0123456789 "),
    "latin": st.sampled_from("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ-,."),
}


@st.composite
def titles(draw) -> str:
    """Up to 120 characters (``prompt.max_text_chars``) of one script, or of several."""
    scripts = draw(st.lists(st.sampled_from(sorted(SCRIPTS)), min_size=1, max_size=3))
    count_case("+".join(sorted(set(scripts))))
    alphabet = st.one_of(*(SCRIPTS[s] for s in scripts))
    return draw(st.text(alphabet, min_size=1, max_size=PROMPT.max_text_chars))


@st.composite
def sessions(draw) -> SessionState:
    """One shopper's session of 1 to ``session.max_events`` (40) events, its texts in any
    script."""
    count = draw(st.integers(min_value=1, max_value=40))
    kind = draw(st.sampled_from(["view", "click", "search", "add_to_cart"]))
    events = []
    for n in range(count):
        event_type = kind if n % 3 else "view"
        text = draw(titles())
        product = (
            {}
            if event_type == "search"
            else {
                "product_id": f"sku-{n}",
                "title": text,
                "category": f"{draw(titles())[:40]} > {draw(titles())[:40]}",
                "brand": draw(titles())[:30],
                "price": 10.0 + n,
            }
        )
        events.append(
            ShopperEvent(
                f"ev-{n}",
                "shopper-1",
                event_type,
                T0 + n * 10_000,
                query=text if event_type == "search" else "",
                **product,
            )
        )
    return SessionState(
        "shopper-1",
        events=tuple(events),
        session_started_ms=T0,
        newest_event_ms=events[-1].event_time_ms,
    )


# --- the property ---------------------------------------------------------------------------


class TestAnyScriptFitsTheContext:
    @PROPERTY
    @given(state=sessions(), template=st.sampled_from(TEMPLATES))
    def test_with_the_tokenizer_the_count_is_the_servers_and_the_prompt_fits(
        self, state: SessionState, template: str
    ) -> None:
        prompt = renderer(template).render(state)
        served = served_tokens(prompt)
        count_case("events dropped" if prompt.events_dropped else "all events kept")

        assert served == prompt.estimated_tokens
        assert served <= PROMPT.max_prompt_tokens
        assert served + LLM.max_tokens <= LLM.max_model_len
        assert prompt.events_included >= 1

    @PROPERTY
    @given(state=sessions())
    def test_without_the_tokenizer_the_bound_never_undercounts_and_the_prompt_fits(
        self, state: SessionState
    ) -> None:
        prompt = renderer("shopper_intent_v1.j2", Utf8Bound()).render(state)
        served = served_tokens(prompt)

        assert served <= prompt.estimated_tokens <= PROMPT.max_prompt_tokens
        assert served + LLM.max_tokens <= LLM.max_model_len


class TestSessionsThatOverflowedTheContext:
    """40-event sessions whose titles cost more tokens than bytes / 3 guessed: the estimate
    let 4,168-5,449 served tokens through against a 4,096 context."""

    @pytest.mark.parametrize(
        "title",
        [
            "ソニック スタジオ プロ ワイヤレス ノイズキャンセリング オーバーイヤー ヘッドホン、"
            "ミッドナイトブラック 高音質 長時間再生",
            "索尼克录音室专业无线降噪头戴式耳机，午夜黑，高保真音质，长续航，舒适佩戴，蓝牙五点三连接稳定可靠",  # noqa: RUF001
            "🎧🔥✨ Super 🎵 Bass 💥 Headphones 🖤🖤 🎶🎶🎶 😍😍 🚀🚀🚀 💯💯 🎁🎁 ⭐⭐⭐⭐⭐",
            "9837465 1029384756 2938475610 5647382910 1234567890 0987654321 1122334455 66778899",
        ],
        ids=["japanese", "chinese", "emoji", "digits"],
    )
    @pytest.mark.parametrize("template", TEMPLATES)
    def test_a_forty_event_session_is_cut_to_the_budget_in_served_tokens(
        self, title: str, template: str
    ) -> None:
        product = {"title": title, "category": "Electronics > Audio > Headphones"}
        events = tuple(
            ShopperEvent(
                f"e{n}",
                "s",
                "view",
                T0 + n * 10_000,
                f"sku-{n}",
                brand="Sonique",
                price=108.99,
                **product,
            )
            for n in range(40)
        )
        state = SessionState(
            "s", events=events, session_started_ms=T0, newest_event_ms=events[-1].event_time_ms
        )

        prompt = renderer(template, token_counter(AUTO_TOKENIZER)).render(state)

        assert served_tokens(prompt) <= PROMPT.max_prompt_tokens
        assert prompt.events_dropped > 0


class TestTrimming:
    def test_only_as_many_oldest_events_are_dropped_as_the_budget_needs(self) -> None:
        title = "ヘッドホン ワイヤレス ノイズキャンセリング 高音質 " * 3
        events = tuple(
            ShopperEvent(f"e{n}", "s", "view", T0 + n * 1000, f"sku-{n}", title=title)
            for n in range(40)
        )
        state = SessionState(
            "s", events=events, session_started_ms=T0, newest_event_ms=events[-1].event_time_ms
        )
        prompt = renderer("shopper_intent_v3.j2").render(state)
        one_more = dataclasses.replace(state, events=events[prompt.events_dropped - 1 :])
        unbounded = renderer("shopper_intent_v3.j2", max_prompt_tokens=10**6).render(one_more)

        assert prompt.events_dropped > 0
        assert prompt.estimated_tokens <= PROMPT.max_prompt_tokens
        assert unbounded.estimated_tokens > PROMPT.max_prompt_tokens
        assert f'"{title[:120].strip()}' in prompt.messages[1]["content"]


class TestCounters:
    def test_the_bundled_templates_overhead_is_within_the_bounds_allowance(self) -> None:
        messages = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
        empty = RenderedPrompt(tuple(messages), "t", "h", 0, 0, 0)

        assert 0 < served_tokens(empty) <= CHAT_OVERHEAD_TOKENS

    def test_auto_counts_with_the_bundled_models_tokenizer_when_it_is_installed(self) -> None:
        assert token_counter(AUTO_TOKENIZER).method == "tokenizer"

    def test_an_empty_path_counts_with_the_bound(self) -> None:
        assert token_counter("").method == "utf8_bound"

    def test_a_tokenizer_json_alone_counts_the_messages_and_the_overhead(self) -> None:
        alone = ChatTemplateTokens.from_path(MODEL_DIR / "tokenizer.json")
        messages = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "там"}]
        prompt = RenderedPrompt(tuple(messages), "t", "h", 0, 0, 0)

        assert served_tokens(prompt) <= alone.count(messages)

    def test_a_template_whose_fixed_text_exceeds_the_budget_by_the_bound_refuses_to_start(
        self,
    ) -> None:
        """v3's instructions are about 5 KB: by the byte bound alone they exceed 3,500."""
        with pytest.raises(PromptError, match=r"v3\.j2.*utf8_bound.*prompt\.tokenizer_path"):
            renderer("shopper_intent_v3.j2", Utf8Bound())


class TestConfiguration:
    def test_a_budget_and_answer_longer_than_the_context_are_refused_at_start(self) -> None:
        with pytest.raises(ConfigError) as caught:
            load_config(environ={"SI_PROMPT_MAX_PROMPT_TOKENS": "4000"})

        assert "prompt.max_prompt_tokens: 4000 plus llm.max_tokens (192) is 4192" in str(
            caught.value
        )
        assert "llm.max_model_len (4096)" in str(caught.value)

    def test_the_defaults_fit_the_context(self) -> None:
        config = AppConfig()

        assert config.prompt.max_prompt_tokens + config.llm.max_tokens <= config.llm.max_model_len

    def test_a_tokenizer_path_that_does_not_exist_is_refused_naming_the_key(self) -> None:
        with pytest.raises(ConfigError, match=r"prompt\.tokenizer_path: '/no/such'"):
            load_config(environ={"SI_PROMPT_TOKENIZER_PATH": "/no/such"})

    def test_the_model_folder_is_accepted_as_the_tokenizer_path(self) -> None:
        config = load_config(environ={"SI_PROMPT_TOKENIZER_PATH": str(MODEL_DIR)})

        assert token_counter(config.prompt.tokenizer_path).method == "tokenizer"


class TestTheJobStarts:
    def test_a_budget_its_template_cannot_fit_is_refused_before_the_job_is_built(self) -> None:
        from flink_jobs.job import check_prompts

        config = load_config(environ={"SI_PROMPT_TOKENIZER_PATH": ""})  # the bound, and v3

        with pytest.raises(ConfigError, match=r"v3\.j2.*utf8_bound.*prompt\.tokenizer_path"):
            check_prompts(config)

    def test_the_default_setup_starts(self) -> None:
        from flink_jobs.job import check_prompts

        check_prompts(load_config(environ={}))
