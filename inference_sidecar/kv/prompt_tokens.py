"""A request's prompt token ids, as the vLLM worker will compute them.

The KV-aware policy needs the exact tokens the worker caches: the chat template rendered
the way Hugging Face's ``apply_chat_template`` renders it (a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, the tokenizer's special tokens as variables,
``add_generation_prompt`` on), then tokenized without adding special tokens, as vLLM's
chat endpoint does; a completion's ``prompt`` string is tokenized with them, as vLLM's
completions endpoint does, and a list of token ids is taken as is.

The tokenizer and template are the model folder's own (``tokenizer.json``, and
``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), the files the
worker loads. Requests this cannot reproduce faithfully (images, tools, a client-chosen
template or template arguments, message content that is not text) yield ``None``: the
policy then routes them by hashing, and the router counts them.

A prompt that cannot fit the model's context (``max_tokens``) cannot be served anyway,
so it is never tokenized in full (``OverContext``): a text longer than ``max_tokens``
times the longest token of the vocabulary (``max_token_bytes``) is refused before
tokenizing, and what is tokenized is at most that long.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_UNREPRODUCIBLE_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
    "mm_processor_kwargs",
    "prompt_embeds",
)
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class OverContext(ValueError):
    """The prompt has more tokens than the model's context: not worth tokenizing."""


def message_text(content: Any) -> str | None:
    """A message's content as the template sees it: a string, or text parts joined by
    newlines (vLLM's "string" content format); None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "\n".join(texts)
    return None


def _special_token(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, Mapping) else None
    return content if isinstance(content, str) else None


class PromptTokenizer:
    """Renders and tokenizes chat and completion prompts like the worker does.

    ``encode(text, add_special_tokens)`` and the template are injectable so the logic is
    tested without a model; ``from_model_dir`` loads the real ones. ``max_token_bytes``:
    the most UTF-8 bytes one token stands for (None: unknown, so only the token count
    is checked, after tokenizing).
    """

    def __init__(
        self,
        encode: Callable[[str, bool], Sequence[int]],
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        max_token_bytes: int | None = None,
    ) -> None:
        self._encode = encode
        self.special_tokens = dict(special_tokens or {})
        self.max_token_bytes = max_token_bytes
        self._template = None
        if chat_template is not None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        """The tokenizer and chat template of the model folder the workers serve."""
        from tokenizers import Tokenizer  # the router's optional dependency

        folder = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text() if template_path.exists() else None
        if template is None and isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        specials = {
            name: token
            for name in _SPECIAL_TOKEN_NAMES
            if (token := _special_token(config.get(name))) is not None
        }

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

        return cls(encode, template, specials, longest_token_bytes(tokenizer))

    def chat_prompt(self, body: Mapping[str, Any]) -> str | None:
        """The rendered chat prompt of a ``/v1/chat/completions`` body, or None."""
        if self._template is None or any(body.get(f) is not None for f in _UNREPRODUCIBLE_FIELDS):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        rendered: list[dict[str, Any]] = []
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                return None
            if any(k not in ("role", "content", "name") for k in message):
                return None  # tool calls and the like take template paths not mirrored here
            text = message_text(message.get("content"))
            if text is None:
                return None
            rendered.append({"role": message["role"], "content": text})
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            return None
        try:
            return self._template.render(
                messages=rendered,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except Exception:  # a template error is the worker's to report; route by hashing
            return None

    def token_ids(
        self, endpoint: str, body: Mapping[str, Any], max_tokens: int | None = None
    ) -> list[int] | None:
        """The prompt's token ids for ``endpoint`` (``chat/completions`` or
        ``completions``), or None when they cannot be reproduced here. Raises
        ``OverContext`` when the prompt has more than ``max_tokens`` tokens."""
        if endpoint == "chat/completions":
            prompt = self.chat_prompt(body)
            if prompt is None:
                return None
            add_special = body.get("add_special_tokens", False)
            return self._tokens(prompt, add_special is True, max_tokens)
        if any(body.get(f) is not None for f in _UNREPRODUCIBLE_FIELDS):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            add_special = body.get("add_special_tokens", True)
            return self._tokens(prompt, add_special is True, max_tokens)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return _within(list(prompt), max_tokens)
        return None

    def _tokens(self, text: str, add_special: bool, max_tokens: int | None) -> list[int]:
        # Every token stands for at most max_token_bytes bytes: a longer text has more
        # tokens than the context holds, whatever they are (characters first: cheaper).
        most = self.max_token_bytes
        bound = max_tokens * most if max_tokens is not None and most is not None else None
        if bound is not None and (len(text) > bound or len(text.encode()) > bound):
            raise OverContext(f"more than {max_tokens} tokens")
        return _within(list(self._encode(text, add_special)), max_tokens)


def _within(tokens: list[int], max_tokens: int | None) -> list[int]:
    if max_tokens is not None and len(tokens) > max_tokens:
        raise OverContext(f"{len(tokens)} tokens, more than {max_tokens}")
    return tokens


def longest_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any token of ``tokenizer`` (a ``tokenizers.Tokenizer``)
    stands for, plus one for a leading space a decoder may drop."""
    longest = 1
    for token_id in tokenizer.get_vocab(with_added_tokens=True).values():
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        longest = max(longest, len(text.encode()))
    return longest + 1


def _raise_template_error(message: str) -> None:
    raise ValueError(message)
