"""Train, validation and test splits by a stable hash of the shopper id.

A shopper's every trigger point lands in one split, so no test shopper's session is ever
seen in training, and the split of a shopper is the same on every machine, for every
source and every rerun. The test split is for the final evaluation only: training reads
the train split, early stopping and every choice the validation split.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
#: Shares in percent of the hash's 100 buckets: train, validation, test.
SHARES = (70, 10, 20)
#: Mixed into the hash, so the split is independent of other hashes of the id (the A/B
#: arm, the router's worker).
_SALT = b"shopper-intents:distill-split:"


def split_of(shopper_id: str) -> Split:
    """The split ``shopper_id`` belongs to (``SHARES`` of the shoppers each)."""
    digest = hashlib.blake2b(_SALT + shopper_id.encode("utf-8"), digest_size=8).digest()
    bucket = int.from_bytes(digest, "big") % 100
    bound = 0
    for split, share in zip(SPLITS, SHARES, strict=True):
        bound += share
        if bucket < bound:
            return split
    raise AssertionError("unreachable: the shares sum to 100")
