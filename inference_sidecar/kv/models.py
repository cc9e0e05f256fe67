"""What a worker serves, from its ``GET /v1/models``: the base model's context and its
LoRA adapters' paths (vLLM lists an adapter with ``root`` = its path and ``parent`` = the
base model; ``vllm/entrypoints/openai/models/serving.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from inference_sidecar.kv.blocks import BlockExtras


class UnknownModel(ValueError):
    """A request for a model the workers do not list: they will refuse it."""


@dataclass(frozen=True, slots=True)
class WorkerModels:
    """The models of the workers: base model names, adapters, and the context."""

    max_model_len: int | None = None
    base: frozenset[str] = frozenset()
    #: LoRA adapter name -> its path, which vLLM hashes into its blocks.
    loras: Mapping[str, str] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return bool(self.base or self.loras)

    def extras(self, body: Mapping[str, Any]) -> BlockExtras | None:
        """The extra keys vLLM hashes a request's blocks with: its adapter (when its
        model is one) and its ``cache_salt``. Raises ``UnknownModel``, or ``ValueError``
        for a salt that is not a non-empty string (vLLM refuses those)."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        model = body.get("model")
        lora = (
            (model, self.loras[model]) if isinstance(model, str) and model in self.loras else None
        )
        if lora is None and self.known and model not in self.base:
            raise UnknownModel(f"no worker serves {model!r:.80}")
        return BlockExtras(lora, salt) if lora is not None or salt else None


def models_from_list(text: str) -> WorkerModels | None:
    """``WorkerModels`` from a vLLM worker's ``GET /v1/models``; None if it is no list."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    context: int | None = None
    base: set[str] = set()
    loras: dict[str, str] = {}
    for card in data:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        if card.get("parent") is not None and isinstance(card.get("root"), str):
            loras[card["id"]] = card["root"]
            continue
        base.add(card["id"])
        value = card.get("max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            context = value
    return WorkerModels(context, frozenset(base), loras)
