"""Redis answers with an error instead of writing.

A server that cannot take writes for a while (a replica after a failover: READONLY; a
replica cut off from its primary that serves no stale data: MASTERDOWN; a primary short of
replicas under ``min-replicas-to-write``: NOREPLICAS; a cluster slot being moved: TRYAGAIN;
a long script: BUSY; out of memory under ``noeviction``: OOM) is waited out like an
unreachable one: the write is retried with backoff within ``redis.write_retry_budget_s`` and
lands once the server recovers, and past the budget it fails loudly. After READONLY the
store drops its idle connections, so a failover's new primary behind the same endpoint is
found. A key that cannot take the write at all (another type at one shopper's key:
WRONGTYPE) dead-letters that shopper's intent with the reason, counted, without failing
the outbox (so the job does not restart), and other shoppers' intents go on landing. And
what asynchronous replication can lose: a write the primary acknowledged and had not yet
sent to its replica when it died.

Each test puts its own ``redis-server`` into the state, never the session's shared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import AppConfig, LlmConfig
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.metrics import OutcomeRecorder
from flink_jobs.runtime.counters import StatsReporter
from flink_jobs.runtime.inference import (
    PromptRunner,
    RedisUnavailable,
    run_task,
    upsert_with_retry,
)
from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentRecord,
    Notify,
    StoreBusyError,
)
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.runtime.outbox import Outbox
from flink_jobs.tools.local_services import RedisService, free_port, start_redis
from tests.support import builders
from tests.support.tcp_forwarder import TcpForwarder
from tests.support.waiting import until

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z
MODEL = "SmolLM2-135M-Instruct"
LLM = LlmConfig(base_url="http://llm.test/v1", model=MODEL, max_attempts=1)
# Long enough that a state lifted after LIFT_AFTER_S is always waited out.
BUDGET_S = 10.0
LIFT_AFTER_S = 0.6

INTENT = {
    "intents": [{"label": "comparing_options", "confidence": 0.65, "category": "headphones"}],
    "summary": "Comparing over-ear headphones from Sonique and Auralis.",
}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisService]:
    with start_redis(workdir=tmp_path / "redis") as service:
        yield service


@pytest.fixture
def admin(private_redis: RedisService) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


def record(shopper_id: str = "shopper-00146", seq: int = 3) -> IntentRecord:
    return IntentRecord(
        shopper_id=shopper_id,
        version_ts=T0 + 95_000,
        version_seq=seq,
        intent_json=orjson.dumps(INTENT).decode(),
        top_label="comparing_options",
        top_confidence=0.65,
        summary=INTENT["summary"],
        event_time_ms=T0 + 95_000,
        template="shopper_intent_v1.j2",
        template_hash="56171ff6b9a3",
        model=MODEL,
    )


class CountingStore:
    """The real store, counting the attempts the retry makes and the codes it was refused
    with."""

    def __init__(self, store: AsyncIntentStore) -> None:
        self.store, self.attempts, self.refusals = store, 0, []

    async def upsert(self, r: IntentRecord) -> bool:
        self.attempts += 1
        try:
            return await self.store.upsert(r)
        except StoreBusyError as exc:
            self.refusals.append(exc.code)
            raise


@dataclass(frozen=True)
class Upserted:
    """How one ``upsert_with_retry`` ended: whether it wrote, the attempts it took and the
    codes the server refused it with."""

    written: bool
    attempts: int
    refusals: set[str]


def upsert_while_lifting(
    url: str,
    lift: Callable[[], object] | None,
    budget_s: float = BUDGET_S,
    *,
    prefix: str = "si",
    notify: Notify | None = None,
) -> Upserted:
    """``upsert_with_retry`` of one intent while ``lift`` ends the server's state after
    ``LIFT_AFTER_S`` (never, if None)."""
    timer = threading.Timer(LIFT_AFTER_S, lift) if lift else None

    async def main() -> Upserted:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        counting = CountingStore(AsyncIntentStore(client, prefix, notify=notify))
        try:
            if timer:
                timer.start()
            written = await upsert_with_retry(counting, record(), budget_s)
            return Upserted(written, counting.attempts, set(counting.refusals))
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    finally:
        if timer:
            timer.join()


def stored_version(
    admin: redis.Redis, shopper_id: str = "shopper-00146", prefix: str = "si"
) -> tuple[int, int]:
    ts, seq = admin.hmget(f"{prefix}:intent:{shopper_id}", "version_ts", "version_seq")
    return int(ts), int(seq)


def assert_waited_out(
    upserted: Upserted, refusal: str, server: redis.Redis, prefix: str = "si"
) -> None:
    """The write was refused with ``refusal`` at least once, then landed once the state
    lifted."""
    assert upserted.written is True
    assert upserted.attempts >= 2
    assert upserted.refusals == {refusal}
    assert stored_version(server, prefix=prefix) == (T0 + 95_000, 3)


def read_only_replica(admin: redis.Redis) -> None:
    """The server becomes a replica of a primary that is gone: as after a failover, it
    refuses writes until it is promoted."""
    admin.replicaof("127.0.0.1", str(free_port()))
    with pytest.raises(redis.exceptions.ReadOnlyError):
        admin.set("probe", "1")


def spin_until_killed(client: redis.Redis) -> None:
    """A script that runs until SCRIPT KILL ends it."""
    with contextlib.suppress(redis.ResponseError):
        client.eval("while true do end", 0)


class TestTransientServerStates:
    def test_a_replica_refusing_writes_is_waited_out_until_it_is_promoted(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        read_only_replica(admin)

        upserted = upsert_while_lifting(private_redis.url, lambda: admin.replicaof("NO", "ONE"))

        assert_waited_out(upserted, "READONLY", admin)

    def test_a_replica_cut_off_from_its_primary_answers_masterdown_until_promoted(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("replica-serve-stale-data", "no")  # a stale replica refuses reads too
        admin.replicaof("127.0.0.1", str(free_port()))

        upserted = upsert_while_lifting(private_redis.url, lambda: admin.replicaof("NO", "ONE"))

        assert_waited_out(upserted, "MASTERDOWN", admin)

    def test_a_primary_short_of_replicas_answers_noreplicas_until_one_is_enough(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("min-replicas-to-write", "1")  # and no replica is connected

        upserted = upsert_while_lifting(
            private_redis.url, lambda: admin.config_set("min-replicas-to-write", "0")
        )

        assert_waited_out(upserted, "NOREPLICAS", admin)

    def test_a_cluster_slot_being_moved_answers_tryagain_until_it_is_stable(
        self, tmp_path: Path
    ) -> None:
        """The intent and its notification stream share a slot (a hash tag in the prefix);
        while the slot migrates and one of the two keys is not on this node yet, Redis
        answers TRYAGAIN."""
        cluster = ("--cluster-enabled", "yes", "--cluster-config-file")
        with (
            start_redis(
                workdir=tmp_path / "a", extra_args=(*cluster, str(tmp_path / "a.conf"))
            ) as a,
            start_redis(
                workdir=tmp_path / "b", extra_args=(*cluster, str(tmp_path / "b.conf"))
            ) as b,
            redis.Redis.from_url(a.url, socket_timeout=5) as node,
            redis.Redis.from_url(b.url, socket_timeout=5) as other,
        ):
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            node.execute_command("CLUSTER", "MEET", "127.0.0.1", b.port)
            until(
                lambda: node.cluster("info")["cluster_state"] == "ok",
                "the cluster to be up",
                timeout_s=20,
                interval_s=0.05,
            )
            prefix, notify = "{si}", Notify("{si}:intent-updates")
            node.hset(f"{prefix}:intent:shopper-00146", "version_ts", 1)  # here; the stream not
            slot = node.execute_command("CLUSTER", "KEYSLOT", notify.stream)
            other_id = other.execute_command("CLUSTER", "MYID").decode()
            node.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", other_id)

            upserted = upsert_while_lifting(
                a.url,
                lambda: node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE"),
                prefix=prefix,
                notify=notify,
            )

            assert_waited_out(upserted, "TRYAGAIN", node, prefix=prefix)

    def test_a_server_out_of_memory_is_waited_out_until_memory_frees(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")

        upserted = upsert_while_lifting(
            private_redis.url, lambda: admin.config_set("maxmemory", "0")
        )

        assert_waited_out(upserted, "OOM", admin)

    def test_a_server_busy_with_a_long_script_is_waited_out_until_the_script_ends(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("busy-reply-threshold", "100")  # ms before other clients get BUSY
        spinner = redis.Redis.from_url(private_redis.url, socket_timeout=BUDGET_S)
        spinning = threading.Thread(target=spin_until_killed, args=(spinner,))
        spinning.start()
        try:

            def busy() -> bool:
                try:
                    admin.ping()
                except redis.ResponseError as exc:
                    assert str(exc).startswith("BUSY")
                    return True
                return False

            until(busy, "the script to make the server busy", timeout_s=5, interval_s=0.05)

            upserted = upsert_while_lifting(private_redis.url, admin.script_kill)
        finally:
            spinning.join()
            spinner.close()

        assert_waited_out(upserted, "BUSY", admin)

    def test_after_readonly_the_new_primary_behind_the_same_endpoint_is_found(
        self, private_redis: RedisService, admin: redis.Redis, tmp_path: Path
    ) -> None:
        """A failover behind one endpoint: the old primary becomes a replica (READONLY on the
        store's pooled connection), the endpoint now leads to the promoted server. The store
        drops its idle connections after READONLY, so its next attempt reaches the new
        primary; kept, every attempt would meet the old one until the budget ran out."""
        with (
            start_redis(workdir=tmp_path / "promoted") as promoted,
            redis.Redis.from_url(promoted.url, socket_timeout=5) as new_primary,
            TcpForwarder(("127.0.0.1", private_redis.port)) as endpoint,
        ):

            async def main() -> tuple[bool, bool, int]:
                client = redis.asyncio.Redis.from_url(endpoint.url(), socket_timeout=2)
                store = CountingStore(AsyncIntentStore(client))
                try:
                    first = await upsert_with_retry(store, record(seq=2), BUDGET_S)
                    read_only_replica(admin)  # the old primary, on the pooled connection
                    endpoint.target = ("127.0.0.1", promoted.port)
                    second = await upsert_with_retry(store, record(seq=3), 3.0)
                    return first, second, store.attempts
                finally:
                    await client.aclose()

            first, second, attempts = asyncio.run(main())

            assert (first, second) == (True, True)
            assert attempts == 3  # one write, then one READONLY and one on the new primary
            assert stored_version(new_primary) == (T0 + 95_000, 3)
            assert stored_version(admin) == (T0 + 95_000, 2)

    def test_a_state_that_outlasts_the_budget_fails_the_write_loudly(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        read_only_replica(admin)

        with pytest.raises(RedisUnavailable, match="shopper-00146") as raised:
            upsert_while_lifting(private_redis.url, None, budget_s=0.5)

        assert "read only" in str(raised.value)


async def completion_handler(request: httpx.Request) -> httpx.Response:
    body = {
        "model": "smollm2-served",
        "choices": [
            {"message": {"role": "assistant", "content": orjson.dumps(INTENT).decode()},
             "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 412, "completion_tokens": 30},
    }  # fmt: skip
    return httpx.Response(200, content=orjson.dumps(body))


def prompt_task(shopper_id: str, seq: int = 3) -> PromptTask:
    """A one-event prompt of ``shopper_id``, versioned at ``T0 + 95 s``."""
    return builders.prompt_task(
        shopper_id, seq, at_s=95, user="<events>\n+01:35 view\n</events>", events_included=1
    )


def run_tasks(url: str, *tasks: PromptTask) -> list[TaskResult]:
    """Each prompt's whole trip, in order, as the job's call runner makes it."""

    async def main() -> list[TaskResult]:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        llm = LlmClient(LLM, transport=httpx.MockTransport(completion_handler))
        try:
            store = AsyncIntentStore(client)
            return [await run_task(t, llm, store, MODEL, BUDGET_S) for t in tasks]
        finally:
            await llm.aclose()
            await client.aclose()

    return asyncio.run(main())


class TestPerKeyErrors:
    def test_a_key_of_another_type_dead_letters_that_shoppers_intent_and_others_land(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.set("si:intent:shopper-00999", "written by someone else")

        poisoned, healthy = run_tasks(
            private_redis.url, prompt_task("shopper-00999"), prompt_task("shopper-00146")
        )

        assert poisoned.outcome == "dead_letter"
        dead_letter = poisoned.dead_letter
        assert (dead_letter.stage, dead_letter.reason) == ("store", "key_wrong_type")
        assert dead_letter.shopper_id == "shopper-00999"
        assert "WRONGTYPE" in dead_letter.detail
        assert orjson.loads(dead_letter.context["intent"]) == INTENT  # nothing lost
        assert admin.get("si:intent:shopper-00999") == b"written by someone else"
        assert healthy.outcome == "written"
        assert stored_version(admin, "shopper-00146") == (T0 + 95_000, 3)

    def test_it_is_counted_and_fails_no_outbox_so_the_job_does_not_restart(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        """The job restarts only when its outbox fails (a call that raises). Through the
        job's runner, outbox and outcome recorder: the poisoned shopper's prompt settles as a
        dead letter, counted in the Redis stats, and the outbox goes on taking prompts."""
        admin.set("si:intent:shopper-00999", "written by someone else")
        stats = StatsReporter(private_redis.url, "si", flush_interval_s=60)
        recorder = OutcomeRecorder(stats)

        def clients() -> tuple[LlmClient, AsyncIntentStore]:
            store = AsyncIntentStore(redis.asyncio.Redis.from_url(private_redis.url))
            return LlmClient(LLM, transport=httpx.MockTransport(completion_handler)), store

        outbox = Outbox(PromptRunner(replace(AppConfig(), llm=LLM), clients), 8, 2).start()
        try:
            outbox.submit(prompt_task("shopper-00999"))
            for settled in outbox.wait("shopper-00999", 3, BUDGET_S):
                recorder.settled(settled)
            outbox.submit(prompt_task("shopper-00146", seq=4))  # the outbox still takes prompts
            for settled in outbox.wait("shopper-00146", 4, BUDGET_S):
                recorder.settled(settled)
            stats.flush()
        finally:
            outbox.close()
            stats.close()

        counts = {k.decode(): int(v) for k, v in admin.hgetall("si:stats").items()}
        assert {k: counts.get(k) for k in ("dead_letter_inference", "intents_written")} == {
            "dead_letter_inference": 1,
            "intents_written": 1,
        }
        assert counts["dead_letter_store_key_wrong_type"] == 1
        assert stored_version(admin, "shopper-00146") == (T0 + 95_000, 4)

    def test_the_dead_letter_of_a_poisoned_key_serialises_with_its_intent(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.rpush("si:intent:shopper-00999", "a list, not a hash")

        (poisoned,) = run_tasks(private_redis.url, prompt_task("shopper-00999", seq=4))

        body = orjson.loads(poisoned.dead_letter.to_json(T0 + 100_000))
        assert (body["stage"], body["reason"], body["shopper_id"]) == (
            "store",
            "key_wrong_type",
            "shopper-00999",
        )
        assert body["context"]["prompt_seq"] == 4
        assert orjson.loads(body["context"]["intent"]) == INTENT


class TestReplication:
    """Replication is asynchronous and the job does not call ``WAIT``: a write the primary
    acknowledged is gone when the primary dies before its replica received it and the
    replica is promoted. What is lost is at most what the replica had not received (its
    replication lag); the prompt behind such a write was settled as written, so the
    shopper's next prompt, not a resend, writes a newer intent."""

    def test_an_acknowledged_write_not_yet_replicated_is_lost_on_failover(
        self, tmp_path: Path
    ) -> None:
        primary = start_redis(workdir=tmp_path / "primary")
        try:
            with (
                start_redis(workdir=tmp_path / "replica") as replica_service,
                redis.Redis.from_url(replica_service.url, socket_timeout=5) as replica,
                redis.Redis.from_url(primary.url, socket_timeout=5) as old_primary,
                TcpForwarder(("127.0.0.1", primary.port)) as link,
            ):
                replica.replicaof("127.0.0.1", str(link.port))
                until(
                    lambda: replica.info("replication")["master_link_status"] == "up",
                    "the replica to sync",
                    timeout_s=20,
                    interval_s=0.05,
                )
                replicated = upsert_while_lifting(primary.url, None)
                until(
                    lambda: replica.exists("si:intent:shopper-00146") == 1,
                    "the copy",
                    timeout_s=20,
                    interval_s=0.05,
                )
                link.hold()  # the replica hears nothing more from its primary
                newer = record(seq=4)
                assert upsert_store(primary.url, newer)  # acknowledged by the primary
                assert stored_version(old_primary) == (T0 + 95_000, 4)

                os.kill(primary.process.pid, signal.SIGKILL)  # it dies with the write unsent
                replica.replicaof("NO", "ONE")  # the failover promotes the replica

                assert replicated.written is True
                assert stored_version(replica) == (T0 + 95_000, 3)  # the write acked at seq 4: lost
        finally:
            primary.stop()


def upsert_store(url: str, r: IntentRecord) -> bool:
    async def main() -> bool:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        try:
            return await AsyncIntentStore(client).upsert(r)
        finally:
            await client.aclose()

    return asyncio.run(main())
