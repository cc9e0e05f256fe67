"""``shopper-intents plan`` on the command line: what it prints and its exit status."""

from __future__ import annotations

import argparse
import re

import orjson

from flink_jobs.tools.sizing import command

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
