"""Key extraction precedence: header, then ``user``, then a hash of the prompt."""

from __future__ import annotations

from inference_sidecar.routing_key import (
    MAX_KEY_CHARS,
    RoutingKey,
    estimate_prompt_tokens,
    extract_routing_key,
    header_key,
    prompt_key,
    user_key,
)

MESSAGES = [{"role": "user", "content": "hello"}]


class TestHeaderKey:
    def test_session_header_is_used(self) -> None:
        assert header_key({"X-Session-ID": "shopper-1"}) == "shopper-1"

    def test_header_name_is_case_insensitive(self) -> None:
        assert header_key({"x-session-id": "a"}) == "a"
        assert header_key({"X-SESSION-ID": "a"}) == "a"

    def test_blank_header_is_ignored(self) -> None:
        assert header_key({"X-Session-ID": "   "}) is None

    def test_value_is_stripped(self) -> None:
        assert header_key({"X-Session-ID": "  s1 "}) == "s1"

    def test_other_headers_are_ignored(self) -> None:
        assert header_key({"X-User-ID": "u"}) is None

    def test_configured_names_in_order(self) -> None:
        headers = {"X-User-ID": "u", "X-Tenant": "t"}
        assert header_key(headers, ("x-session-id", "x-tenant", "x-user-id")) == "t"

    def test_overlong_value_is_hashed_stably(self) -> None:
        long = "s" * (MAX_KEY_CHARS + 1)
        key = header_key({"X-Session-ID": long})
        assert key is not None and key.startswith("h:") and len(key) < 40
        assert key == header_key({"X-Session-ID": long})
        assert key != header_key({"X-Session-ID": long + "x"})


class TestUserKey:
    def test_string_user(self) -> None:
        assert user_key({"user": "alice"}) == "alice"

    def test_integer_user(self) -> None:
        assert user_key({"user": 42}) == "42"

    def test_bool_and_blank_and_other_types_are_ignored(self) -> None:
        for value in (True, False, "", "  ", None, 1.5, ["a"], {"id": 1}):
            assert user_key({"user": value}) is None, value

    def test_missing(self) -> None:
        assert user_key({}) is None


class TestPromptKey:
    def test_same_messages_same_key(self) -> None:
        assert prompt_key({"messages": MESSAGES}) == prompt_key({"messages": list(MESSAGES)})

    def test_key_order_inside_messages_does_not_matter(self) -> None:
        reordered = [{"content": "hello", "role": "user"}]
        assert prompt_key({"messages": MESSAGES}) == prompt_key({"messages": reordered})

    def test_different_messages_different_key(self) -> None:
        other = [{"role": "user", "content": "hello!"}]
        assert prompt_key({"messages": MESSAGES}) != prompt_key({"messages": other})

    def test_completion_prompt(self) -> None:
        assert prompt_key({"prompt": "abc"}) == prompt_key({"prompt": "abc"})
        assert prompt_key({"prompt": "abc"}) != prompt_key({"prompt": "abd"})

    def test_messages_and_prompt_with_same_text_differ(self) -> None:
        assert prompt_key({"prompt": ["x"]}) != prompt_key({"messages": ["x"]})

    def test_other_fields_do_not_change_the_key(self) -> None:
        a = prompt_key({"messages": MESSAGES, "temperature": 0})
        b = prompt_key({"messages": MESSAGES, "temperature": 1, "max_tokens": 9})
        assert a == b

    def test_empty_or_missing_prompt(self) -> None:
        assert prompt_key({}) is None
        assert prompt_key({"prompt": ""}) is None
        assert prompt_key({"messages": []}) is None

    def test_stable_across_processes(self) -> None:
        # blake2b, not hash(): the same prompt must map to the same worker after a restart
        assert prompt_key({"prompt": "abc"}) == "p:63c198be73291c6cbff9f601"


class TestPrecedence:
    def test_header_beats_user_and_prompt(self) -> None:
        body = {"user": "u", "messages": MESSAGES}
        assert extract_routing_key({"X-Session-ID": "s"}, body) == RoutingKey("s", "header")

    def test_user_beats_prompt(self) -> None:
        body = {"user": "u", "messages": MESSAGES}
        assert extract_routing_key({}, body) == RoutingKey("u", "user")

    def test_prompt_is_the_fallback(self) -> None:
        key = extract_routing_key({}, {"messages": MESSAGES})
        assert key.source == "prompt" and key.value.startswith("p:")

    def test_nothing_at_all(self) -> None:
        assert extract_routing_key({}, {}) == RoutingKey("", "none")
        assert extract_routing_key({}, None) == RoutingKey("", "none")

    def test_blank_header_falls_through_to_user(self) -> None:
        assert extract_routing_key({"X-Session-ID": ""}, {"user": "u"}).source == "user"

    def test_custom_header_names(self) -> None:
        key = extract_routing_key({"X-User-ID": "u1"}, {}, header_names=("x-user-id",))
        assert key == RoutingKey("u1", "header")


class TestPromptSize:
    def test_chat_counts_message_text_and_a_little_per_message(self) -> None:
        parts = [{"type": "text", "text": "y" * 800}]
        body = {
            "messages": [
                {"role": "system", "content": "x" * 400},
                {"role": "user", "content": parts},
            ]
        }
        assert estimate_prompt_tokens(body) == (400 + 800) // 4 + 2 * 4

    def test_completions_prompt_string_or_token_ids(self) -> None:
        assert estimate_prompt_tokens({"prompt": "z" * 1000}) == 250
        assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
        assert estimate_prompt_tokens({"prompt": ["ab" * 10, "cd" * 10]}) == 10

    def test_nothing_to_measure_is_zero(self) -> None:
        assert estimate_prompt_tokens({"model": "m"}) == 0
        assert estimate_prompt_tokens({"messages": "not a list", "prompt": 7}) == 0

    def test_a_longer_prompt_of_one_shopper_is_estimated_larger(self) -> None:
        events = "".join(f'{{"type": "view", "sku": "{i}"}}\n' for i in range(40))
        short = {"messages": [{"role": "user", "content": events}]}
        longer = {"messages": [{"role": "user", "content": events + '{"type": "cart"}\n'}]}
        assert estimate_prompt_tokens(longer) > estimate_prompt_tokens(short)
