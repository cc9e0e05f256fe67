"""docker-compose.yml end to end: the cpu profile brought up on the project's own Docker
Engine, the bundled sample replayed through the replayer service, a TaskManager killed
mid-stream, and the stack taken down again.

The stack is the shipped file with the test's override (``docker-compose.test.yml``: Tansu
for Apache Kafka, free loopback ports, a prompts topic, no Grafana); the images are the
shipped Dockerfiles built on local stand-ins of the images no registry serves here
(``deploy/compose_images.py``). ``scripts/compose_test.sh`` (``make compose-test``) makes
the engine and the images and runs this module.

One fixture drives the whole run and records what it saw; each test then checks one
promise of it. The run, in order:

1. ``up``: every service healthy, the job submitted by ``job-submit`` and running with
   both source subtasks started.
2. The replayer service replays ``data/sample_sessions.jsonl`` (300 shoppers, 3,098
   records with the sample's 9 bad ones) at 30x with event times rebased to now.
3. Mid-replay, once a checkpoint has completed and intents land, Prometheus's targets are
   read and one TaskManager is killed (``docker kill``); Docker's restart policy does not
   bring back a killed container, so the test starts it again as an orchestrator would.
   The job restarts from its checkpoint when both slots are back.
4. After the replay, the accounting the embedded tests use (``test_checkpoint_restart``):
   the consumer group has committed every record (a checkpoint covers them all), and every
   shopper's newest prompt has its intent in Redis at its version or a dead letter.
5. Who runs each container's processes, and what their command lines hold.
6. ``down -v``, then what the engine still has of the project.

Deadlines are sized from the first runs on this 2-core machine (docs/compose.md,
"Timings"): about three times what each step took there.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
import redis

from intent_reader.layout import intent_key
from tests.compose.stack import POLL_S, REPO, Stack, docker
from tests.support.waiting import WaitFailed, passes_within, until

pytestmark = pytest.mark.timeout(45 * 60)

EXPECTED = orjson.loads((REPO / "data" / "sample_sessions.expected.json").read_bytes())
INSPECT = Path(__file__).with_name("inspect_stack.py")
KEY_PREFIX = "si"
PARALLELISM = 2
#: Seen: the stack up with the job running in 3-4 min from cached images (vLLM's start
#: and four JVMs on two shared cores).
UP_TIMEOUT_S = 900.0
JOB_RUNNING_TIMEOUT_S = 600.0
#: The replay sends an hour of events at 30x (120 s), then lingers 30 s for a last scrape.
REPLAY_TIMEOUT_S = 900.0
#: Seen: the first checkpoint and ten intents within a minute of the replay's start.
BEFORE_KILL_TIMEOUT_S = 600.0
#: Six of Prometheus' 10 s scrape intervals (deploy/observability/prometheus.yml).
METRICS_TIMEOUT_S = 60.0
RESTART_TIMEOUT_S = 600.0
#: Every record committed and every newest prompt answered, after the replay's end.
SETTLE_TIMEOUT_S = 900.0
#: Unchanged prompts for this long after the replay: the last triggers have fired.
QUIET_S = 20.0


@dataclass
class Run:
    killed: str = ""
    restarted_after_kill: bool = False
    restored_checkpoint: dict | None = None
    replay_exit: int | None = None
    replay_output: str = ""
    lag: int | None = None
    prompts: list[dict] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)
    unanswered: dict = field(default_factory=dict)
    intents: set[str] = field(default_factory=set)
    targets: list[dict] = field(default_factory=list)
    job_metric_instances: set[str] = field(default_factory=set)
    process_uids: dict[str, set[int]] = field(default_factory=dict)
    command_lines: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def _newest_prompts(prompts: list[dict]) -> dict[str, tuple[int, int]]:
    newest: dict[str, tuple[int, int]] = {}
    for p in prompts:
        version = (p["version_ts"], p["seq"])
        newest[p["shopper_id"]] = max(newest.get(p["shopper_id"], version), version)
    return newest


def unanswered(prompts: list[dict], dead_letters: list[dict], client: redis.Redis) -> dict:
    """Shoppers whose newest prompt has neither its intent in Redis at its version (the
    rules-only record or the model's) nor a dead letter: ``test_checkpoint_restart``'s
    accounting."""
    dead = {
        (d["shopper_id"], d["context"]["prompt_seq"])
        for d in dead_letters
        if d.get("context") and "prompt_seq" in d["context"]
    }
    missing = {}
    for shopper, (version_ts, seq) in _newest_prompts(prompts).items():
        ts, stored_seq = client.hmget(intent_key(shopper, KEY_PREFIX), "version_ts", "version_seq")
        landed = ts is not None and (int(ts), int(stored_seq)) == (version_ts, seq)
        if not landed and (shopper, seq) not in dead:
            missing[shopper] = ((version_ts, seq), ts and (int(ts), int(stored_seq)))
    return missing


def _intents(client: redis.Redis) -> set[str]:
    marker = intent_key("", KEY_PREFIX)
    return {k.decode()[len(marker) :] for k in client.scan_iter(match=intent_key("*", KEY_PREFIX))}


def _stats(client: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(f"{KEY_PREFIX}:stats").items()}


def _restarted(stack: Stack, job_id: str) -> bool:
    detail = stack.flink(f"/jobs/{job_id}") or {}
    return bool(detail.get("timestamps", {}).get("RESTARTING"))


def _checkpoints(stack: Stack, job_id: str) -> dict:
    return stack.flink(f"/jobs/{job_id}/checkpoints") or {}


#: The official Flink image's user `flink` (the stand-in mirrors it).
FLINK_UID = 9999
#: Services whose images run as root by design: vLLM's official image does.
ROOT_BY_DESIGN = {"vllm-cpu"}


def _process_table(container: str) -> list[tuple[int, str]]:
    """(uid, command line) of every process in the container, as the host's ``ps`` sees
    them (uids, not names: the host has its own user names)."""
    out = docker("top", container, "-eo", "pid,uid,args")  # docker top needs the pid
    rows = []
    for line in out.splitlines()[1:]:
        _pid, uid, args = line.split(None, 2)
        rows.append((int(uid), args.strip()))
    return rows


def _run_state(container: str) -> str:
    """``false``, or ``true`` and when the container's current run started."""
    state = docker("inspect", "--format", "{{.State.Running}} {{.State.StartedAt}}", container)
    running, _, started_at = state.strip().partition(" ")
    return f"true {started_at}" if running == "true" else "false"


@pytest.fixture(scope="module")
def run() -> Run:
    stack = Stack.from_environment(f"si-compose-{time.time_ns() % 10**8}")
    result = Run(secrets=stack.secrets)
    started = time.monotonic()
    replay: subprocess.Popen | None = None
    try:
        stack.compose("up", "-d", "--no-build", "--pull", "never", timeout_s=UP_TIMEOUT_S)
        result.timings["up_s"] = time.monotonic() - started
        job = until(
            stack.running_job, "the job to run with every task",
            timeout_s=JOB_RUNNING_TIMEOUT_S, interval_s=POLL_S,
            explain=lambda: (stack.flink("/jobs/overview"), stack.logs("job-submit", tail=20)),
        )  # fmt: skip
        job_id = job["jid"]
        client = redis.Redis.from_url(stack.redis_url)
        until(
            lambda: _stats(client).get("task_starts", 0) >= PARALLELISM,
            "both source subtasks to start", timeout_s=JOB_RUNNING_TIMEOUT_S, interval_s=POLL_S,
            explain=lambda: _stats(client),
        )  # fmt: skip
        result.timings["job_running_s"] = time.monotonic() - started

        replay_started = time.monotonic()
        replay = subprocess.Popen(
            stack.compose_argv("run", "--rm", "--use-aliases", "-T", "replayer"),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        until(
            lambda: (
                _checkpoints(stack, job_id).get("counts", {}).get("completed", 0) > 0
                and len(_intents(client)) >= 10
            ),
            "a completed checkpoint and ten intents",
            timeout_s=BEFORE_KILL_TIMEOUT_S, interval_s=POLL_S,
            explain=lambda: (_checkpoints(stack, job_id).get("counts"), _stats(client)),
        )  # fmt: skip
        result.timings["first_checkpoint_after_replay_s"] = time.monotonic() - replay_started
        assert replay.poll() is None, "the replay ended before the kill: not mid-stream"
        until(
            lambda: sum(
                t["labels"].get("component") == "taskmanager" and t["health"] == "up"
                for t in stack.scrape_targets()
            ) == PARALLELISM,
            "Prometheus to scrape both TaskManagers", timeout_s=120, interval_s=POLL_S,
            explain=stack.scrape_targets,
        )  # fmt: skip
        result.targets = stack.scrape_targets()

        def job_metric_instances() -> set[str]:
            found = stack.prometheus(
                "/api/v1/query",
                {"query": "flink_taskmanager_job_task_operator_shopper_intents_events_in"},
            )
            result.job_metric_instances = {
                r["metric"]["instance"] for r in (found or {}).get("result", [])
            }
            return result.job_metric_instances

        # A TaskManager's job metrics reach Prometheus at its first scrape after its subtask
        # registered them, which may come after the target is already up; a timeout leaves
        # the instances seen for the test that asserts them.
        with contextlib.suppress(WaitFailed):
            until(
                lambda: len(job_metric_instances()) == PARALLELISM,
                "both TaskManagers' job metrics in Prometheus",
                timeout_s=METRICS_TIMEOUT_S, interval_s=POLL_S,
            )  # fmt: skip

        victim = stack.containers("taskmanager")[0]["Name"]
        before_kill = _run_state(victim)
        docker("kill", victim)
        result.killed = victim
        killed_at = time.monotonic()
        # Docker's restart policy acts within a second, if at all.
        restarted_by_docker = passes_within(
            lambda: _run_state(victim) not in (before_kill, "false"), 5, interval_s=POLL_S
        )
        if not restarted_by_docker:
            docker("start", victim)
        until(
            lambda: _restarted(stack, job_id) and stack.running_job() is not None,
            "the job to restart and run every task again",
            timeout_s=RESTART_TIMEOUT_S, interval_s=POLL_S,
            explain=lambda: (stack.flink(f"/jobs/{job_id}") or {}).get("state"),
        )  # fmt: skip
        result.restarted_after_kill = True
        result.restored_checkpoint = _checkpoints(stack, job_id).get("latest", {}).get("restored")
        result.timings["restart_after_kill_s"] = time.monotonic() - killed_at

        try:
            output, _ = replay.communicate(timeout=REPLAY_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise WaitFailed(f"the replay still running after {REPLAY_TIMEOUT_S:.0f} s") from exc
        result.replay_exit, result.replay_output = replay.returncode, output[-2000:]
        result.timings["replay_s"] = time.monotonic() - replay_started

        last = {"prompts": -1, "since": time.monotonic(), "seen": None}

        def settled() -> bool:
            inspected = stack.exec_python("jobmanager", INSPECT)
            if len(inspected["prompts"]) != last["prompts"]:
                last.update(prompts=len(inspected["prompts"]), since=time.monotonic())
            open_ = unanswered(inspected["prompts"], inspected["dead_letters"], client)
            last["seen"] = {
                "lag": inspected["lag"],
                "unanswered": len(open_),
                "prompts": len(inspected["prompts"]),
                "stats": _stats(client),
            }
            result.lag, result.unanswered = inspected["lag"], open_
            result.prompts, result.dead_letters = inspected["prompts"], inspected["dead_letters"]
            return (
                inspected["lag"] == 0 and not open_ and time.monotonic() - last["since"] > QUIET_S
            )

        until(
            settled, "every record committed and every newest prompt answered",
            timeout_s=SETTLE_TIMEOUT_S, interval_s=POLL_S, explain=lambda: last["seen"],
        )  # fmt: skip
        result.timings["settled_after_replay_s"] = time.monotonic() - replay_started
        result.intents = _intents(client)
        client.close()

        for row in stack.containers():
            name = row["Name"]
            table = _process_table(name)
            result.process_uids[row["Service"]] = result.process_uids.get(row["Service"], set()) | {
                u for u, _ in table
            }
            inspect = docker("inspect", "--format", "{{json .Config.Cmd}} {{json .Args}}", name)
            result.command_lines[name] = inspect + "\n".join(a for _, a in table)
    except BaseException:
        # The containers go with `down -v` below: their last lines say what went wrong.
        print(f"compose run failed; the services' last log lines:\n{stack.logs(tail=40)}")
        raise
    finally:
        if replay is not None and replay.poll() is None:
            replay.kill()
        try:
            stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
        finally:
            result.leftovers = stack.leftovers()
            result.timings["total_s"] = time.monotonic() - started
            print(f"compose run timings: {result.timings}")
    return result


def test_intents_land_for_nine_in_ten_shoppers(run: Run) -> None:
    shoppers = set(EXPECTED["qualifying_shoppers"])
    landed = shoppers & run.intents
    assert len(landed) >= 0.9 * len(shoppers), f"{len(landed)} of {len(shoppers)}"


def test_the_samples_bad_records_are_dead_lettered_with_their_reasons(run: Run) -> None:
    """Each bad record once (a restart may send a record's dead letter again: at least once,
    told apart by its source offset)."""
    decode = {
        (d["source"]["partition"], d["source"]["offset"]): d["reason"]
        for d in run.dead_letters
        if d["stage"] == "decode"
    }
    assert Counter(decode.values()) == Counter(EXPECTED["dead_letter_by_reason"])
    assert all(d["detail"] for d in run.dead_letters if d["stage"] == "decode")


def test_prometheus_scrapes_each_taskmanager_replica_and_the_router(run: Run) -> None:
    taskmanagers = [t for t in run.targets if t["labels"].get("component") == "taskmanager"]
    assert len({t["labels"]["instance"] for t in taskmanagers}) == PARALLELISM
    assert all(t["health"] == "up" for t in taskmanagers), taskmanagers
    router = [t for t in run.targets if t["labels"]["job"] == "router"]
    assert router and all(t["health"] == "up" for t in router), router


def test_the_jobs_metrics_keep_their_prometheus_names_on_each_taskmanager(run: Run) -> None:
    assert len(run.job_metric_instances) == PARALLELISM, run.job_metric_instances


def test_a_killed_taskmanager_makes_the_job_restore_its_checkpoint(run: Run) -> None:
    assert run.killed and run.restarted_after_kill
    assert run.restored_checkpoint and run.restored_checkpoint.get("id"), run.restored_checkpoint


def test_across_the_kill_every_record_is_committed_and_every_prompt_answered(run: Run) -> None:
    assert run.replay_exit == 0, run.replay_output
    assert run.lag == 0
    assert len(_newest_prompts(run.prompts)) >= 0.9 * len(EXPECTED["qualifying_shoppers"])
    assert run.unanswered == {}


def test_the_flink_services_run_as_the_flink_user(run: Run) -> None:
    for service in ("jobmanager", "taskmanager"):
        assert run.process_uids.get(service) == {FLINK_UID}, (service, run.process_uids)


def test_no_service_runs_as_root_but_vllm(run: Run) -> None:
    assert {"redis", "router-cpu", "prometheus"} <= run.process_uids.keys(), run.process_uids
    for service, uids in run.process_uids.items():
        if service not in ROOT_BY_DESIGN:
            assert 0 not in uids, (service, uids)


def test_no_secret_is_on_a_command_line(run: Run) -> None:
    assert run.command_lines and run.secrets
    for container, text in run.command_lines.items():
        for name, value in run.secrets.items():
            assert value not in text, f"{name} is on {container}'s command line"


def test_down_v_leaves_nothing_of_the_project(run: Run) -> None:
    assert run.leftovers == {"containers": [], "networks": [], "volumes": []}
