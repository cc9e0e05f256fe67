"""The eval command's pure steps: the events it replays, the points it compares, its report."""

from __future__ import annotations

import orjson

from flink_jobs.core.events import parse_event_time
from flink_jobs.tools import eval_runner
from flink_jobs.tools.intent_eval import IntentWrite
from intent_reader.client import IntentLabel
from tests.support.builders import raw_event


def _time(value: bytes) -> int:
    return parse_event_time(orjson.loads(value)["event_time"])


def test_moved_events_keep_their_spacing_and_the_newest_lands_on_now():
    values = [raw_event(at_s=s, event_id=i, query="shoes") for i, s in (("a", 0.0), ("b", 30.0))]
    now = 1_800_000_000_000
    records, events = eval_runner.moved_to_now(values, now)
    assert [_time(r) for r in records] == [now - 30_000, now]
    assert [e.event_time_ms for e in events] == [now - 30_000, now]


def test_only_points_every_arm_answered_are_common():
    def write(shopper: str, version: int) -> IntentWrite:
        return IntentWrite(shopper, version, (IntentLabel("browsing", 0.5, None),))

    def arm(*writes: IntentWrite) -> eval_runner.ArmRun:
        return eval_runner.ArmRun("t", "p", list(writes), {}, {}, 0.0)

    arms = [
        arm(write("s1", 1), write("s1", 2), write("s2", 1)),
        arm(write("s1", 2), write("s2", 1)),
    ]
    assert eval_runner.common_points(arms) == {("s1", 2), ("s2", 1)}


def test_saved_writes_load_back_as_the_same_writes(tmp_path):
    import argparse

    labels = (IntentLabel("ready_to_buy", 0.7, "Headphones"), IntentLabel("browsing", 0.2, None))
    writes = [IntentWrite("s1", 1_800_000_000_000, labels, "model", "v2.j2", "m")]
    args = argparse.Namespace(
        out=tmp_path, dataset="sample", events=tmp_path / "e.jsonl", shoppers=3, split="test"
    )

    path = eval_runner.save_writes(
        args, 1_800_000_000_000, [eval_runner.ArmRun("v2.j2", "p", writes, {}, {}, 0.0)]
    )
    saved, arms = eval_runner.load_writes(path)

    assert arms == {"v2.j2": writes}
    assert (saved["now_ms"], saved["shoppers"], saved["split"]) == (1_800_000_000_000, 3, "test")


def test_the_report_says_where_the_record_and_the_answer_beat_tie_and_lose_to_the_rules():
    def group(template, ndcg, browsing):
        answer = {"ndcg_at_10": ndcg, "browsing_with_signal": browsing, "purchase_auc": None}
        record = {"ndcg_at_10": 0.3, "browsing_with_signal": 0.0, "purchase_auc": 0.7}
        rules = {"ndcg_at_10": 0.3, "browsing_with_signal": 0.0, "purchase_auc": 0.6}
        return {"template": template, "answer": answer, "record": record, "rules": rules}

    lines = eval_runner._verdict_lines([group("v1.j2", 0.1, 0.5), group("v2.j2", 0.4, 0.0)])

    assert lines[0] == (
        "- v1.j2: the record beats the rules-only intent on purchase_auc 0.700 vs 0.600;"
        " ties on ndcg_at_10 0.300 vs 0.300, browsing_with_signal 0.000 vs 0.000; loses on none."
    )
    assert lines[1] == (
        "- v1.j2: the model's answer alone beats the rules-only intent on none; ties on none;"
        " loses on ndcg_at_10 0.100 vs 0.300, browsing_with_signal 0.500 vs 0.000."
    )
    assert "alone beats the rules-only intent on ndcg_at_10 0.400 vs 0.300; ties on" in lines[3]
    assert "- ndcg_at_10, the model's answers: v2.j2 beats v1.j2 (0.400 vs 0.100)." in lines


# --- the commit a run records ------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _eval_document(code: dict) -> dict:
    import argparse
    from pathlib import Path

    args = argparse.Namespace(
        dataset="sample",
        events=Path("data/sample_sessions.jsonl"),
        split="",
        templates=["shopper_intent_v3.j2"],
        adapter=Path("adapters/si-compact-lora"),
        serve="merged",
    )
    return eval_runner.eval_document(args, 10, 2, [], {"differences": []}, code, 1.0)


def test_an_eval_run_records_the_commit_it_ran_on():
    code = {"commit": COMMIT, "dirty": False}

    assert _eval_document(code)["git"] == code


def test_the_figures_table_shows_an_eval_runs_commit():
    from bench import report

    document = _eval_document({"commit": COMMIT, "dirty": True})
    rows = report.figures_rows({"intent_quality": {"datasets": {"sample": document}}})

    assert [row[5] for row in rows] == ["0123456789 (uncommitted changes)"]


def test_the_eval_report_names_the_commit_when_the_run_recorded_one():
    document = {"when": "2026-01-02 03:04", "host": "x86_64", "elapsed_s": 5.0}

    assert eval_runner._run_line({**document, "git": {"commit": COMMIT, "dirty": False}}) == (
        "Run 2026-01-02 03:04 on x86_64, commit 0123456789; 5 s."
    )
    assert eval_runner._run_line(document) == "Run 2026-01-02 03:04 on x86_64; 5 s."


def test_outside_a_git_checkout_no_commit_is_claimed(tmp_path):
    from flink_jobs.tools.provenance import git_state

    assert git_state(tmp_path) == {"commit": None, "dirty": False}
