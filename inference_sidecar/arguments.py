"""The command line's flags: ``inference-sidecar router ...`` and ``... cluster ...``.

Each number a flag takes is checked by its argparse type (``number``, ``integer``,
``core_list``): NaN, an infinity, a negative, or zero where the router needs more stops
the command at once, with argparse's ``argument --<flag>: ...`` message.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from inference_sidecar.config import (
    ADMIN_HOST,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_PORT,
    DEFAULT_TOKENIZER_WORKERS,
)
from inference_sidecar.kv.blocks import SUPPORTED_ALGOS
from inference_sidecar.kv.index import DEFAULT_STALE_AFTER_S
from inference_sidecar.load_view import DEFAULT_LOAD_VIEW, DEFAULT_POLL_INTERVAL_S, LOAD_VIEWS
from inference_sidecar.policies import POLICY_NAMES
from inference_sidecar.policies.bounded_hash import (
    DEFAULT_NEW_KEY_PLACEMENT,
    DEFAULT_REQUEST_COST,
    NEW_KEY_PLACEMENTS,
)

#: Where the router reads its admin token when ``--admin-token-file`` is not given.
ADMIN_TOKEN_ENV = "SI_ROUTER_ADMIN_TOKEN"
#: Where the router reads its load view when ``--load-view`` is not given: one setting
#: for every replica of a deployment. Checked by ``RouterConfig`` (``ConfigError``).
LOAD_VIEW_ENV = "SI_ROUTER_LOAD_VIEW"


def number(minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number at least (``above``: more than) ``minimum``."""
    bound = f"> {minimum:g}" if above else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``minimum..maximum``."""
    span = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text!r}")
        return value

    return parse


def core_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated CPU core numbers (0 or more)."""
    try:
        cores = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected core numbers like 0,1, got {text!r}") from None
    if any(c < 0 for c in cores):
        raise argparse.ArgumentTypeError(f"core numbers are 0 or more, got {text!r}")
    return cores


def _add_router_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)")
    p.add_argument(
        "--port", type=integer(1, 65535), default=DEFAULT_PORT, help="port (default %(default)s)"
    )
    p.add_argument("--policy", choices=POLICY_NAMES, default="bounded_hash")
    p.add_argument(
        "--load-factor",
        type=number(1.0),
        default=1.25,
        help="bound on a worker's in-flight requests, as a multiple of the mean (default 1.25)",
    )
    p.add_argument(
        "--residency-factor",
        type=number(1.0),
        default=1.25,
        help="bound on a worker's resident prompt tokens (the last prompt of every shopper "
        "homed there), as a multiple of the mean, for where a new shopper may go "
        "(default 1.25)",
    )
    p.add_argument(
        "--min-load-bound",
        type=integer(1),
        default=3,
        help="in-flight requests a worker may always take before keys spill (default 3)",
    )
    p.add_argument(
        "--recompute-weight",
        type=number(0.0),
        default=2.0,
        help="weight of a prompt's uncached tokens against a worker's queued ones when "
        "bounded_hash chooses where to send it (default 2; 0 routes on queues alone)",
    )
    p.add_argument(
        "--request-cost",
        type=integer(0),
        default=DEFAULT_REQUEST_COST,
        help="bounded_hash: queue cost of one request in flight on a worker, in prompt "
        "tokens (default %(default)s)",
    )
    p.add_argument(
        "--new-key-placement",
        choices=NEW_KEY_PLACEMENTS,
        default=DEFAULT_NEW_KEY_PLACEMENT,
        help="bounded_hash: where a new shopper goes: least_loaded (the roomy workers with "
        "the fewest requests in flight, by cost among them), fewest_first (the fewest "
        "requests in flight, then the roomy ones among them), cost, or hash (the first of "
        "its rendezvous order under the load bound) (default %(default)s)",
    )
    p.add_argument(
        "--load-view",
        choices=LOAD_VIEWS,
        default=None,
        help="the load each worker counts at for the load bound: own (this router's "
        "requests in flight) or workers (each worker's running + waiting requests from its "
        "/metrics, polled, plus this router's since; use it with more than one router "
        f"replica). Default ${LOAD_VIEW_ENV}, else {DEFAULT_LOAD_VIEW}",
    )
    p.add_argument(
        "--load-poll-interval",
        type=number(0.0, above=True),
        default=DEFAULT_POLL_INTERVAL_S,
        help="--load-view workers: seconds between two polls of the workers' /metrics "
        "(default %(default)s)",
    )
    p.add_argument(
        "--kv-stale-after",
        type=number(0.0, above=True),
        default=DEFAULT_STALE_AFTER_S,
        help="kv_prefix: seconds of silence after a request before a worker's KV events "
        "are distrusted and its cache estimated by hashing (default %(default)s)",
    )
    p.add_argument("--max-attempts", type=integer(1), default=3, help="workers tried per request")
    p.add_argument(
        "--request-timeout",
        type=number(0.0, above=True),
        default=120.0,
        help="total seconds one attempt on one worker may take, streamed or not",
    )
    p.add_argument(
        "--body-timeout",
        type=number(0.0, above=True),
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client may take to send a request's body; past it the request "
        "gets a 408 (default %(default)s)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=integer(1),
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="completion requests served at once; more get a 429 with Retry-After "
        "(default %(default)s)",
    )
    p.add_argument(
        "--health-interval",
        type=number(0.0),
        default=2.0,
        help="seconds between probes; 0 disables",
    )
    p.add_argument("--max-body-bytes", type=integer(1024), default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--tokenizer-workers",
        type=integer(0),
        default=DEFAULT_TOKENIZER_WORKERS,
        help="kv_prefix: processes that tokenize and hash prompts off the event loop; 0 "
        "does it in a thread of the router (default %(default)s)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="enables POST/DELETE /workers for requests carrying 'Authorization: Bearer "
        f"<token>', the token read from FILE (or from ${ADMIN_TOKEN_ENV}); off by default",
    )
    p.add_argument(
        "--admin-port",
        type=integer(1, 65535),
        help=f"serves POST/DELETE /workers on this port of {ADMIN_HOST} only (not on --port)",
    )
    p.add_argument(
        "--key-header",
        action="append",
        dest="key_headers",
        metavar="NAME",
        help="header carrying the routing key (repeatable; default X-Session-ID)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-sidecar",
        description="Shopper-sticky, load-bounded router for vLLM workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    router = sub.add_parser("router", help="serve the router in front of running workers")
    _add_router_options(router)
    router.add_argument("--worker", action="extend", nargs="+", default=[], metavar="URL")
    router.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL")
    router.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL")
    router.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="kv_prefix: where a worker publishes its KV cache events (ZMQ, e.g. "
        "http://127.0.0.1:8100=tcp://127.0.0.1:10100,tcp://127.0.0.1:11100); repeat per worker",
    )
    router.add_argument(
        "--tokenizer", metavar="DIR", help="kv_prefix: the model folder the workers serve"
    )
    router.add_argument(
        "--max-model-len",
        type=integer(1),
        help="kv_prefix: the workers' context in tokens (default: read from a worker's "
        "/v1/models); a prompt that cannot fit is never tokenized",
    )
    router.add_argument(
        "--kv-block-size",
        type=integer(1),
        help="kv_prefix: the workers' KV block size (default: read, with the hash "
        "algorithm, from a worker's /metrics)",
    )
    router.add_argument(
        "--kv-hash-algo",
        choices=SUPPORTED_ALGOS,
        default="sha256",
        help="kv_prefix, with --kv-block-size: the workers' prefix caching hash algorithm",
    )

    cluster = sub.add_parser("cluster", help="start vLLM workers and the router in front")
    _add_router_options(cluster)
    cluster.add_argument("--config", type=Path, help="cluster settings (.toml or .json)")
    cluster.add_argument("--mode", choices=["aggregated", "disaggregated"])
    cluster.add_argument("--workers", type=integer(1), help="workers in aggregated mode")
    cluster.add_argument("--prefill-workers", type=integer(1), dest="prefill")
    cluster.add_argument("--decode-workers", type=integer(1), dest="decode")
    cluster.add_argument("--base-port", type=integer(1024, 65535))
    cluster.add_argument("--model-dir", type=Path)
    cluster.add_argument("--served-model-name")
    cluster.add_argument("--profile", choices=["cpu", "gpu"])
    cluster.add_argument("--kv-connector", choices=["ExampleConnector", "NixlConnector"])
    cluster.add_argument("--max-model-len", type=integer(16))
    cluster.add_argument("--kv-cache-bytes", type=integer(1 << 20))
    cluster.add_argument("--log-dir", type=Path)
    cluster.add_argument(
        "--cores",
        type=core_list,
        help="CPU cores to pin workers to, e.g. 0,1 (default: all usable cores)",
    )
    cluster.add_argument("--ready-timeout", type=number(0.0, above=True), default=300.0)
    return parser
