"""Router-side memory of the kv_prefix policy with many shoppers (pure Python, no workers).

Simulates three workers with LRU KV caches of ``--cache-blocks`` blocks, sends one new
shopper's prompt at a time through ``KVPrefixPolicy`` (no load), feeds the index the
events a worker would publish (stored blocks, evicted blocks), and prints the memory
``tracemalloc`` traces at each checkpoint, the index's blocks per worker and the
policy's history size::

    .cache/venv/bin/python -m bench.kv_index_memory 10000 50000 100000

CPU-bound for minutes at 100,000 shoppers: run it under the heavy lock.
"""

from __future__ import annotations

import argparse
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Sequence

from inference_sidecar.kv import EventBatch, KVIndex, Removed, Stored
from inference_sidecar.kv.blocks import BlockHashing
from inference_sidecar.policies import KVPrefixPolicy

WORKERS = ("http://w0", "http://w1", "http://w2")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_index_memory")
    p.add_argument("checkpoints", type=int, nargs="+", help="shopper counts to report at")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--cache-blocks", type=int, default=34_944 // 32)
    p.add_argument("--shared-tokens", type=int, default=320)
    a = p.parse_args(argv)
    hashing = BlockHashing(a.block_size)
    rng = random.Random(1)
    tracemalloc.start()
    index = KVIndex(WORKERS, hashing=hashing)
    policy = KVPrefixPolicy(index)
    caches: dict[str, OrderedDict[int, None]] = {w: OrderedDict() for w in WORKERS}
    seqs = dict.fromkeys(WORKERS, 0)
    shared = [rng.randrange(49_152) for _ in range(a.shared_tokens)]
    for n in range(1, max(a.checkpoints) + 1):
        tokens = shared + [rng.randrange(49_152) for _ in range(rng.randrange(200, 1500))]
        blocks = hashing.block_hashes(tokens)
        key = f"shopper-{n}"
        worker = policy.pick(key, WORKERS, {}, len(tokens), blocks)
        policy.on_finish(worker, policy.on_start(worker, key, len(tokens), blocks), True)
        cache = caches[worker]
        for b in blocks:
            cache.pop(b, None)
            cache[b] = None
        evicted = []
        while len(cache) > a.cache_blocks:
            evicted.append(cache.popitem(last=False)[0])
        events: tuple[Stored | Removed, ...] = (Stored(blocks, None, tuple(tokens), a.block_size),)
        if evicted:
            events += (Removed(tuple(evicted)),)
        index.apply(worker, EventBatch(seqs[worker], events))
        seqs[worker] += 1
        if n in a.checkpoints:
            current, peak = tracemalloc.get_traced_memory()
            print(
                f"{n} shoppers: traced {current / 2**20:.1f} MiB (peak {peak / 2**20:.1f}), "
                f"index blocks per worker {[index.block_count(w) for w in WORKERS]}, "
                f"policy history {policy.history_size and len(policy._history)} keys"
            )


if __name__ == "__main__":
    main()
