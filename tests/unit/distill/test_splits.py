"""Splits by a stable hash of the shopper id."""

from __future__ import annotations

from collections import Counter

from flink_jobs.tools.distill.splits import SHARES, SPLITS, split_of


def test_a_shopper_is_always_in_the_same_split():
    assert split_of("shopper-00146") == split_of("shopper-00146")
    # Pinned: a change to the hash would move shoppers between the splits of trained
    # adapters and their evaluations.
    assert [split_of(f"shopper-{i:05d}") for i in range(1, 9)] == [
        "train",
        "train",
        "val",
        "train",
        "val",
        "test",
        "train",
        "val",
    ]


def test_the_splits_take_their_shares_of_many_shoppers():
    counts = Counter(split_of(f"cj-hh-{i}") for i in range(20_000))

    for split, share in zip(SPLITS, SHARES, strict=True):
        assert abs(counts[split] / 20_000 - share / 100) < 0.01
