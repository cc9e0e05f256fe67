"""The router service: an OpenAI-compatible front for a pool of vLLM workers.

Per completion request, top to bottom:

1. read the body (bounded by ``max_body_bytes``), parse it, check ``model`` (``app``);
2. extract the routing key (``routing_key``): header, ``user``, prompt hash; with
   kv_prefix, the prompt's KV block hashes too (``kv.feed``);
3. aggregated mode: send the client's bytes unchanged to the worker the policy picks;
   disaggregated mode: a one-token prefill on the key's prefill worker, then the decode
   on the key's decode worker with the prefill's ``kv_transfer_params`` (``core``, ``pd``);
4. a worker that fails before any byte reached the client is recorded against it and the
   request goes to the key's next worker, up to ``max_attempts`` workers (``upstream``);
5. streamed answers are passed through chunk by chunk (``streaming``).

Modules, by concern::

    app          the HTTP surface: routes, body reading, admission, errors as responses
    core         Router: the parts of one router and the path of a request through them
    upstream     attempts on the workers: retries, deadlines, forwarded headers
    streaming    a worker's stream relayed to the client
    attempts     a parsed request and one worker's attempt at it
    membership   the pools: workers joining, health checks, readiness
    load_polling the workers' loads read from their /metrics (the ``workers`` load view)
    bodies       request and error bodies in OpenAI's shapes
"""

from inference_sidecar.router.app import build_app, create_app
from inference_sidecar.router.core import Router
from inference_sidecar.router.upstream import PREFILL_WORKER_HEADER, WORKER_HEADER

__all__ = ["PREFILL_WORKER_HEADER", "WORKER_HEADER", "Router", "build_app", "create_app"]
