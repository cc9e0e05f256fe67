"""Request rewriting for disaggregated prefill/decode, as pure functions.

The flow is vLLM's (``toy_proxy_server``): the prompt goes to a prefill worker with
``max_tokens: 1`` and ``kv_transfer_params`` asking it to keep the KV for a remote
decode; its reply carries ``kv_transfer_params`` telling a decode worker where to fetch
that KV; the decode request is the client's original body plus those parameters.
"""

from __future__ import annotations

import copy
from typing import Any

#: What the prefill step asks of the prefill worker (NixlConnector reads all of them;
#: ExampleConnector matches KV by prompt tokens on shared storage and ignores them).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Fields that make no sense for a one-token, non-streamed prefill.
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "n", "best_of")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request for a client ``body`` (which is left untouched)."""
    out = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = copy.deepcopy(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], prefill_reply: Any) -> dict[str, Any]:
    """The decode request: the client's ``body`` plus the prefill reply's KV parameters.

    A reply without ``kv_transfer_params`` (a connector that needs none) yields the body
    without the field, so the decode worker computes or loads the prompt on its own.
    """
    out = dict(body)
    params = prefill_reply.get("kv_transfer_params") if isinstance(prefill_reply, dict) else None
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out
