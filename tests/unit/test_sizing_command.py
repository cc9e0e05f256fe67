"""``shopper-intents plan`` on the command line: what it prints and its exit status."""

from __future__ import annotations

import argparse
import re

import orjson

from flink_jobs.config import TriggerConfig
from flink_jobs.tools.sizing import command
from tests.support.builders import ESPRESSO, HEADPHONES, raw_event

CAPACITY = {
    "phases": {
        "drain": {
            "cpu_ms_per_event": {"flink_jvm": 0.4, "llm_call_process": 0.1},
            "stats": {"events_accepted": 1000, "llm_calls": 250, "prompts_sent": 250},
        }
    }
}
REDIS = {"shapes": {"job": {"upsert_ops_per_s": 10000}}}


def results(folder, **documents):
    for stem, document in documents.items():
        (folder / f"{stem}.json").write_bytes(orjson.dumps(document))
    return str(folder)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="command"))
    return command.run(parser.parse_args(["plan", *argv]))


def test_a_results_folder_without_the_routers_figure_leaves_it_unsized_and_says_why(
    tmp_path, capsys
):
    folder = results(tmp_path, pipeline_capacity=CAPACITY, redis_upsert=REDIS)
    code = run(["--events-per-s", "1000", "--results", folder])
    out, err = capsys.readouterr()
    assert code == 1
    assert re.search(r"Redis +1  shard \(node\)", out)
    assert f"router: {tmp_path}/router_load.json: the file is missing" in err


def test_a_bad_input_exits_2_naming_the_flag(tmp_path, capsys):
    assert run(["--events-per-s", "-5", "--results", str(tmp_path)]) == 2
    assert "--events-per-s must be > 0" in capsys.readouterr().err


def test_json_output_carries_each_figure_with_its_source(tmp_path, capsys):
    folder = results(tmp_path, pipeline_capacity=CAPACITY, redis_upsert=REDIS)
    run(["--events-per-s", "1000", "--results", folder, "--json"])
    plan = orjson.loads(capsys.readouterr().out)
    figure = plan["figures"]["redis_writes_per_node_per_s"]
    assert figure["key"] == "shapes.job.upsert_ops_per_s"
    assert figure["source"] == f"{tmp_path}/redis_upsert.json"


def events_file(path, *records: bytes):
    path.write_bytes(b"".join(r + b"\n" for r in records))
    return str(path)


def trigger_policy(*rates: float, long_rate: float) -> dict:
    """``trigger_policy.json`` with one row, at the default trigger settings."""
    defaults = TriggerConfig()
    trigger = {
        "quiet_s": defaults.quiet_s,
        "max_wait_s": defaults.max_wait_s,
        "min_interval_s": defaults.min_interval_s,
    }
    return {
        "timings": [
            {
                "trigger": trigger,
                "samples": [{"prompts_per_event": r} for r in rates],
                "long_sample": {"prompts_per_event": long_rate},
            }
        ]
    }


def test_an_events_files_trigger_rate_is_planned_for_and_cited(tmp_path, capsys):
    folder = results(tmp_path, pipeline_capacity=CAPACITY, redis_upsert=REDIS)
    events = events_file(
        tmp_path / "events.jsonl",
        raw_event("a", 0.0, "view", product=HEADPHONES),
        raw_event("a", 0.1, "view", product=ESPRESSO),  # one prompt covers both
        raw_event("b", 0.0, "view", product=HEADPHONES),
        b"not an event",
    )
    run(["--events-per-s", "1000", "--results", folder, "--events-file", events])
    out = capsys.readouterr().out
    assert (
        f"Trigger rate: 0.6667 LLM calls and 0.6667 prompts per accepted event, from {events}"
        in out
    )
    assert re.search(rf"prompts per event +0\.6667  input +{re.escape(events)}: 2 prompts", out)
    assert "Per second: 1,000 events, 666.7 LLM calls" in out


def test_an_events_file_with_no_valid_event_exits_2_saying_so(tmp_path, capsys):
    events = events_file(tmp_path / "events.jsonl")
    folder = results(tmp_path, pipeline_capacity=CAPACITY, redis_upsert=REDIS)
    assert run(["--events-per-s", "1000", "--results", folder, "--events-file", events]) == 2
    assert f"--events-file {events}: no valid events" in capsys.readouterr().err


def test_an_events_file_and_a_trigger_rate_flag_exit_2(tmp_path, capsys):
    events = events_file(tmp_path / "events.jsonl", raw_event("a", 0.0, "search", query="tea"))
    argv = ["--events-per-s", "1000", "--results", str(tmp_path), "--events-file", events]
    assert run([*argv, "--prompts-per-event", "0.2"]) == 2
    assert "leave out --prompts-per-event" in capsys.readouterr().err


def test_the_drains_trigger_rate_comes_with_the_range_the_results_hold(tmp_path, capsys):
    policy = trigger_policy(0.3, 0.25, long_rate=0.4)
    folder = results(tmp_path, pipeline_capacity=CAPACITY, trigger_policy=policy)
    run(["--events-per-s", "1000", "--results", folder])
    trigger = next(line for line in capsys.readouterr().out.splitlines() if "Trigger rate" in line)
    assert "0.25 LLM calls and 0.25 prompts per accepted event" in trigger
    assert "property of the traffic" in trigger
    assert f"0.25-0.4 prompts per event across the sample generator's workloads ({tmp_path}" in (
        trigger
    )


def test_a_trigger_rate_given_comes_without_the_results_range(tmp_path, capsys):
    policy = trigger_policy(0.3, 0.25, long_rate=0.4)
    folder = results(tmp_path, pipeline_capacity=CAPACITY, trigger_policy=policy)
    run(["--events-per-s", "1000", "--results", folder, "--prompts-per-event", "0.1"])
    trigger = next(line for line in capsys.readouterr().out.splitlines() if "Trigger rate" in line)
    assert "0.1 LLM calls and 0.1 prompts per accepted event, from command line" in trigger
    assert "0.25-0.4" not in trigger
