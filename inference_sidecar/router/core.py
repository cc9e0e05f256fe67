"""``Router``: one router's parts, and the path of a completion request through them.

The parts: ``Membership`` (pools, joins, health), ``Upstream`` (attempts on the workers),
with kv_prefix a ``KVFeed`` (the workers' KV events and a prompt's blocks), and with the
``workers`` load view ``WorkerLoads`` (the workers' reported loads, ``load_polling``). Routing
decisions, in-flight counts and health live in ``RoutingState`` objects, which are
synchronous: the asyncio code only moves bytes and feeds them outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import orjson
from starlette.responses import Response

from inference_sidecar import pd
from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import UpstreamError
from inference_sidecar.health import HealthEvent
from inference_sidecar.kv.batches import EventBatch
from inference_sidecar.kv.blocks import BlockHashing
from inference_sidecar.kv.feed import KVFeed
from inference_sidecar.kv.index import KVIndex
from inference_sidecar.kv.prompt_blocks import BlockComputer
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.load_view import WorkerLoad, WorkerLoads, sample_lifetime
from inference_sidecar.metrics import RouterMetrics
from inference_sidecar.policies import KVPrefixPolicy, Policy, make_policy
from inference_sidecar.router.admission import Admission
from inference_sidecar.router.attempts import RoutedRequest
from inference_sidecar.router.bodies import parse_body
from inference_sidecar.router.load_polling import poll_loop, poll_once
from inference_sidecar.router.membership import Membership
from inference_sidecar.router.upstream import PREFILL_WORKER_HEADER, Upstream
from inference_sidecar.routing_key import estimate_prompt_tokens, extract_routing_key
from inference_sidecar.routing_state import RoutingState
from intent_reader.config_errors import redact_url

log = logging.getLogger(__name__)


class Router:
    """State and behaviour of one router; ``app.build_app`` serves it over HTTP.

    ``transport`` replaces the network in tests (``httpx.MockTransport`` or an
    ``httpx.ASGITransport`` around a fake worker); ``clock`` replaces ``time.monotonic``.
    With the kv_prefix policy, ``tokenizer`` and ``kv_hashing`` replace the model folder's
    tokenizer and the block size and algorithm read from the workers' ``/metrics``.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        tokenizer: PromptTokenizer | None = None,
        kv_hashing: BlockHashing | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = RouterMetrics()
        self.policy_name = config.policy
        self.kv: KVFeed | None = None
        if config.policy == KVPrefixPolicy.name:
            assert config.tokenizer_dir is not None  # RouterConfig checks it
            if kv_hashing is None and config.kv_block_size is not None:
                kv_hashing = BlockHashing(config.kv_block_size, config.kv_hash_algo)
            self.kv = KVFeed(
                [redact_url(u) for u in (*config.workers, *config.prefill, *config.decode)],
                {redact_url(u): s for u, s in config.kv_events.items()},
                _block_computer(config, tokenizer),
                hashing=kv_hashing,
                max_model_len=config.max_model_len,
                stale_after_s=config.kv_stale_after_s,
                clock=clock,
                on_error=self._kv_error,
                on_unhashed=lambda reason: self.metrics.kv_unhashed.labels(reason).inc(),
            )
        self.worker_loads: WorkerLoads | None = None
        """The loads the workers report (``load_view`` "workers"), polled by ``start``."""
        if config.load_view == "workers":
            self.worker_loads = WorkerLoads(
                sample_lifetime(config.load_poll_interval_s, config.health_timeout_s),
                lambda: self.clock(),
            )
        self.membership = Membership(
            config,
            self.metrics,
            self._make_policy,
            lambda: self.clock(),
            self.kv,
            self.worker_loads,
        )
        self.metrics.watch_loads(self._load_figures)
        client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
            ),
        )
        self.upstream = Upstream(
            config,
            self.metrics,
            client,
            self.membership.urls,
            lambda: self.clock(),
            on_served=self._served if self.kv is not None else None,
        )
        self.admission = Admission(
            config.max_concurrent_requests,
            config.max_concurrent_requests * config.max_body_bytes,
        )
        """Slots of the completion requests served at once and the body bytes held."""
        self._health_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._kv_config_task: asyncio.Task[None] | None = None
        if self.kv is not None:
            self.metrics.watch_kv_index(self.kv.index, self._kv_fallbacks)

    def _make_policy(self) -> Policy:
        c = self.config
        return make_policy(
            c.policy,
            load_factor=c.load_factor,
            min_bound=c.min_load_bound,
            residency_factor=c.residency_factor,
            recompute_weight=c.recompute_weight,
            request_cost=c.request_cost,
            new_key_placement=c.new_key_placement,
            kv_index=self.kv_index,
        )

    # ----- the parts, as the rest of the package and the tests see them ----------------

    @property
    def pools(self) -> dict[str, RoutingState]:
        return self.membership.pools

    @property
    def serving_pool(self) -> RoutingState:
        return self.membership.serving_pool

    @property
    def kv_index(self) -> KVIndex | None:
        return self.kv.index if self.kv is not None else None

    @property
    def _client(self) -> httpx.AsyncClient:
        """The HTTP client every call to a worker goes through."""
        return self.upstream.client

    @_client.setter
    def _client(self, client: httpx.AsyncClient) -> None:
        self.upstream.client = client

    def add_worker(
        self, url: str, role: str = "worker", kv_events: EventSource | None = None
    ) -> bool:
        """``Membership.add_worker``."""
        return self.membership.add_worker(url, role, kv_events)

    async def probe_all(self) -> None:
        await self.membership.probe_all(self._client)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.membership.readiness()

    async def poll_loads(self) -> None:
        """Read every worker's load from its ``/metrics`` once (``load_view`` "workers")."""
        assert self.worker_loads is not None
        await poll_once(
            self.worker_loads,
            self.membership.workers(),
            self._read_metrics,
            self.config.health_timeout_s,
            self._load_error,
        )

    def _load_figures(self) -> dict[tuple[str, str], WorkerLoad]:
        return {
            (pool.name, worker): figure
            for pool in self.pools.values()
            for worker, figure in pool.load_figures().items()
        }

    def _on_health_event(self, pool: str, event: HealthEvent) -> None:
        self.membership.on_health_event(pool, event)

    def apply_kv_events(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        """Apply a worker's batches, in order, to the KV index (on the event loop)."""
        assert self.kv is not None
        self.kv.apply(worker, items)

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start active health checks (if enabled) and, for kv_prefix, the KV event
        subscriber and the reading of the workers' cache configuration."""
        if self.config.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.create_task(
                self.membership.health_loop(lambda: self._client), name="health-checks"
            )
        if self.worker_loads is not None and self._load_task is None:
            self._load_task = asyncio.create_task(
                poll_loop(
                    self.worker_loads,
                    self.membership.workers,
                    self._read_metrics,
                    self.config.load_poll_interval_s,
                    self.config.health_timeout_s,
                    self._load_error,
                ),
                name="load-polling",
            )
        if self.kv is not None:
            await self.kv.start()
            needs = self.kv.index.hashing is None or self.kv.max_model_len is None
            if needs and self._kv_config_task is None:
                self._kv_config_task = asyncio.create_task(
                    self.kv.learn_workers(
                        self.membership.workers, self._read_worker, (httpx.HTTPError,)
                    ),
                    name="kv-cache-config",
                )

    async def aclose(self) -> None:
        for task in (self._health_task, self._load_task, self._kv_config_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._health_task = self._load_task = self._kv_config_task = None
        if self.kv is not None:
            await self.kv.stop()
        await self._client.aclose()

    # ----- KV events (kv_prefix) -------------------------------------------------------

    async def _read_worker(self, worker: str, path: str) -> str:
        """The text of ``worker``'s ``GET path`` within ``health_timeout_s``; an httpx
        error when it cannot be had (``HTTPStatusError`` for a status that is not 2xx)."""
        reply = await self._client.get(
            f"{self.membership.urls[worker]}{path}", timeout=self.config.health_timeout_s
        )
        reply.raise_for_status()
        return reply.text

    async def _read_metrics(self, worker: str) -> str:
        return await self._read_worker(worker, "/metrics")

    def _load_error(self, worker: str, kind: str) -> None:
        self.metrics.worker_errors.labels("load_metrics", worker, kind).inc()

    def _served(self, worker: str, since: float) -> None:
        assert self.kv is not None
        self.kv.index.expect_events(worker, since=since)

    def _kv_error(self, worker: str, kind: str) -> None:
        self.metrics.worker_errors.labels("kv_events", worker, kind).inc()

    def _kv_fallbacks(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pool in self.pools.values():
            if isinstance(pool.policy, KVPrefixPolicy):
                for worker, n in pool.policy.fallbacks.items():
                    total[worker] = total.get(worker, 0) + n
        return total

    # ----- a completion request ----------------------------------------------------------

    async def prepare(
        self, endpoint: str, raw: bytes, headers: Mapping[str, str], received: float
    ) -> RoutedRequest:
        """Parse a client's request once, as every routing step needs it: its body, its
        routing key with the prompt's size (and blocks, kv_prefix, computed off the event
        loop), the headers a worker gets. Raises ``RequestError`` saying what is wrong."""
        body = parse_body(raw)
        key = extract_routing_key(headers, body, self.config.key_headers)
        key = dataclasses.replace(key, size=estimate_prompt_tokens(body))
        forwarded = self.upstream.forwarded_headers(headers)  # a bad header: before the work
        if self.kv is not None:
            key = await self.kv.with_blocks(key, endpoint, raw, body)
        return RoutedRequest(
            endpoint=endpoint,
            raw=raw,
            body=body,
            key=key,
            headers=forwarded,
            received=received,
        )

    async def answer(self, request: RoutedRequest) -> Response:
        """The response to a prepared request, from the workers."""
        if self.config.mode == "aggregated":
            return await self._aggregated(request)
        return await self._disaggregated(request)

    async def _aggregated(self, request: RoutedRequest) -> Response:
        """The client's bytes, unchanged, to the key's worker."""
        return await self.upstream.serve(self.pools["worker"], request, request.raw, {})

    async def _disaggregated(self, request: RoutedRequest) -> Response:
        """Prefill on the key's prefill worker, decode on its decode worker.

        Degrades instead of failing: with no prefill worker answering, the decode
        worker computes the prompt itself; with no decode worker answering, a prefill
        worker runs the whole request. Each fallback is counted as ``pd_fallback``.
        """
        prefill_pool, decode_pool = self.pools["prefill"], self.pools["decode"]
        body = request.body
        extra: dict[str, str] = {}
        try:
            prefill = await self.upstream.exchange(
                prefill_pool, request, orjson.dumps(pd.prefill_body(body))
            )
        except UpstreamError as exc:
            log.warning("prefill failed (%s); the decode worker computes the prompt", exc)
            self.metrics.decisions.labels(self.policy_name, "prefill", "pd_fallback").inc()
            decode_content = orjson.dumps(pd.decode_body(body, None))
        else:
            if prefill.status >= 300:
                return Response(
                    prefill.body, status_code=prefill.status, media_type=prefill.content_type
                )
            decode_content = orjson.dumps(pd.decode_body(body, orjson.loads(prefill.body)))
            extra[PREFILL_WORKER_HEADER] = prefill.worker
        try:
            return await self.upstream.serve(decode_pool, request, decode_content, extra)
        except UpstreamError as exc:
            if not extra:  # the prefill pool failed already: nothing left to try
                raise
            log.warning("decode failed (%s); a prefill worker runs the whole request", exc)
            self.metrics.decisions.labels(self.policy_name, "decode", "pd_fallback").inc()
            whole = orjson.dumps(pd.decode_body(body, None))
            return await self.upstream.serve(prefill_pool, request, whole, {})


def _block_computer(config: RouterConfig, tokenizer: PromptTokenizer | None) -> BlockComputer:
    """Tokenizer processes loading the model folder's tokenizer; a thread when there are
    none, or when a tokenizer is given in code (it cannot be sent to a process)."""
    if tokenizer is not None:
        return BlockComputer(tokenizer, None, 0)
    assert config.tokenizer_dir is not None
    if config.tokenizer_workers == 0:
        return BlockComputer(PromptTokenizer.from_model_dir(config.tokenizer_dir), None, 0)
    return BlockComputer(None, config.tokenizer_dir, config.tokenizer_workers)
