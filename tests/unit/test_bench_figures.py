"""The benchmarks' figures in the docs and in REPORT.md are generated from the results files."""

from __future__ import annotations

import pytest

from bench import report
from bench._common import RESULTS_DIR

REGENERATE = f"stale: `{report.REGENERATE}` rebuilds it from bench/results/*.json"


def _run(targets, commit="0123456789abcdef", dirty=False, **rest):
    return {
        "benchmark": "b",
        "timestamp": "2026-01-02T03:04:05Z",
        "git": {"commit": commit, "dirty": dirty},
        "targets": targets,
        **rest,
    }


def _target(name, value, op, limit, met):
    return {"name": name, "value": value, "op": op, "limit": limit, "met": met, "note": ""}


def test_the_figures_table_in_the_docs_is_the_one_the_results_files_give():
    expected = report.figures_table(report.load_results(RESULTS_DIR))
    assert report.table_in(report.FIGURES_DOC.read_text()) == expected, REGENERATE


def test_report_md_is_the_one_the_results_files_give():
    results = report.load_results(RESULTS_DIR)
    expected = report.report(results, report.plots_present(RESULTS_DIR))
    assert (RESULTS_DIR / "REPORT.md").read_text() == expected, REGENERATE


def test_each_judged_target_is_a_row_with_its_limit_verdict_commit_and_time():
    results = {"b": _run([_target("t", 0.6, ">=", 0.5, True), _target("u", 2, "<", 1, False)])}
    assert report.figures_rows(results) == [
        ["b", "t", "0.6", ">= 0.5", "yes", "0123456789", "2026-01-02T03:04:05Z"],
        ["b", "u", "2", "< 1", "**no**", "0123456789", "2026-01-02T03:04:05Z"],
    ]


def test_a_run_from_a_tree_with_uncommitted_changes_says_so():
    rows = report.figures_rows({"b": _run([_target("t", 1, "<=", 1, True)], dirty=True)})
    assert rows[0][5] == "0123456789 (uncommitted changes)"


def test_a_missing_value_or_verdict_is_shown_as_not_available():
    rows = report.figures_rows({"b": _run([_target("t", None, "<", None, None)])})
    assert rows[0][1:5] == ["t", "n/a", "< None", "n/a"]


def test_a_results_file_that_judges_no_target_has_one_row_saying_so():
    rows = report.figures_rows({"b": _run([])})
    assert rows == [["b", "no target judged", "", "", "", "0123456789", "2026-01-02T03:04:05Z"]]


def test_a_file_of_several_datasets_has_a_row_per_dataset_with_its_own_time():
    results = {"q": {"datasets": {"one": {"when": "2026-01-01 10:00"}, "two": {}}}}
    assert report.figures_rows(results) == [
        ["q (one)", "no target judged", "", "", "", "not recorded", "2026-01-01 10:00"],
        ["q (two)", "no target judged", "", "", "", "not recorded", "not recorded"],
    ]


def test_a_pipe_in_a_target_name_does_not_split_its_cell():
    table = report.figures_table({"b": _run([_target("a | b", 1, "<=", 1, True)])})
    assert "| a \\| b |" in table


def test_the_table_replaces_only_what_stands_between_the_markers():
    text = f"before\n{report.BEGIN}\nold\n{report.END}\nafter\n"
    new = report.with_table(text, "new")
    assert new == f"before\n{report.BEGIN}\nnew\n{report.END}\nafter\n"
    assert report.table_in(new) == "new"


@pytest.mark.parametrize(
    "text",
    [
        "no markers",
        f"{report.END}\n{report.BEGIN}",
        f"{report.BEGIN}\n{report.BEGIN}\n{report.END}",
    ],
)
def test_a_document_without_one_ordered_pair_of_markers_is_refused(text):
    with pytest.raises(ValueError):
        report.with_table(text, "table")


def test_the_report_has_a_section_per_benchmark_run_and_none_for_other_files():
    results = {"b": _run([]), "q": {"datasets": {"one": {}}}}
    text = report.report(results, {})
    assert "## b" in text and "## q" not in text
    assert "| q (one) | no target judged |" in text


def test_the_sizing_example_in_the_deploy_readme_is_the_one_the_results_files_give():
    expected = report.sizing_example(report.load_results(RESULTS_DIR))
    text = report.SIZING_DOC.read_text()
    assert report.table_in(text, report.SIZING_BEGIN, report.SIZING_END) == expected, REGENERATE


def test_the_sizing_example_is_the_plan_at_its_rate_with_the_default_inputs():
    example = report.sizing_example(report.load_results(RESULTS_DIR))
    assert f"--events-per-s {report.SIZING_EVENTS_PER_S}`" in example
    assert "| Managed Flink |" in example and "| vLLM workers |" in example


def test_each_pair_of_markers_replaces_only_its_own_block():
    text = f"{report.BEGIN}\na\n{report.END}\n{report.SIZING_BEGIN}\nb\n{report.SIZING_END}\n"
    new = report.with_table(text, "c", report.SIZING_BEGIN, report.SIZING_END)
    assert report.table_in(new) == "a"
    assert report.table_in(new, report.SIZING_BEGIN, report.SIZING_END) == "c"
