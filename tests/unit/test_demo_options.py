"""The demo's command-line options that shape the embedded stack."""

from __future__ import annotations

import argparse

import pytest

from flink_jobs.tools.cli import _core_list


def test_llm_cores_takes_a_comma_separated_list(monkeypatch) -> None:
    monkeypatch.setattr("inference_sidecar.workers.available_cores", lambda: (0, 1, 2, 3))

    assert _core_list("1") == (1,)
    assert _core_list("2,3") == (2, 3)


def test_llm_cores_all_leaves_the_pinning_to_the_cluster_default() -> None:
    assert _core_list("all") == ()


@pytest.mark.parametrize("text", ["one", "1,,2"])
def test_llm_cores_refuses_what_is_not_a_core_list(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected core numbers"):
        _core_list(text)


def test_llm_cores_refuses_a_core_this_process_may_not_use(monkeypatch) -> None:
    monkeypatch.setattr("inference_sidecar.workers.available_cores", lambda: (0, 1))

    with pytest.raises(argparse.ArgumentTypeError, match=r"\[5\] not among"):
        _core_list("1,5")
