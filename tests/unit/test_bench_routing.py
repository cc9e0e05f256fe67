"""The routing benchmark's pure parts: workload, minimum tokens, metrics, targets."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import routing
from bench._affinity import computed_by_affinity
from bench._client import Outcome, base_url, chunk_usage
from bench._metrics import (
    COUNTERS,
    counters_delta,
    inflight_balance,
    kv_cache_tokens,
    parse_by_label,
    parse_samples,
    sample_weights,
    token_summary,
)
from bench._replicas import RoundRobin, judge_replicas, ratio, vs_one_replica
from bench._workload import (
    WorkloadConfig,
    build_requests,
    build_skewed_lanes,
    common_prefix_len,
    minimum_new_tokens,
    shared_prefix_tokens,
    zipf_schedule,
    zipf_weights,
)
from bench.routing import (
    PHASE_CHOICES,
    PHASES,
    PRESSURE_MIN_OVER_ALL_CACHES,
    ROUTERS,
    BenchConfig,
    RunParts,
    Sampled,
    check_pressure,
    chosen,
    dump,
    given_caches_fields,
    judge,
    judge_kv,
    judge_vs_peers,
    judged_phase,
    kv_bytes_per_token,
    ordered_concurrency,
    parse_args,
    parse_variant,
    phase_budget,
    pool_runs,
    pressure_doc,
    pressure_lines,
    pressure_workload,
    replica_specs,
    replicas_doc,
    replicas_table,
    router_decisions,
    router_labels,
    schedule,
    summarise,
    table,
)
from flink_jobs.tools.run_summary import percentile


class TestZipf:
    def test_weights_are_normalised_and_decreasing(self):
        w = zipf_weights(31, 0.8)
        assert math.isclose(sum(w), 1.0)
        assert all(a > b for a, b in itertools.pairwise(w))

    def test_exponent_zero_is_uniform(self):
        assert len(set(zipf_weights(5, 0.0))) == 1

    def test_schedule_is_seeded_skewed_and_not_in_rounds(self):
        ids = [f"s{i}" for i in range(31)]
        a = zipf_schedule(ids, 300, 1.0, random.Random(1))
        assert a == zipf_schedule(ids, 300, 1.0, random.Random(1))
        counts = Counter(a).most_common()
        assert counts[0][1] > 3 * (300 / 31)  # the hottest shopper is far above the mean
        rounds = [ids[i % 31] for i in range(300)]
        assert a != rounds
        assert any(a[i] == a[i + 1] for i in range(299)) or len(counts) < 31


class TestMinimumTokens:
    def test_common_prefix_len(self):
        assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
        assert common_prefix_len([], [1]) == 0
        assert common_prefix_len([1, 2], [1, 2, 3]) == 2

    def test_growing_prompt_costs_only_its_new_tokens(self):
        first = [0, 0, 1, 1, 1]
        second = [*first, 2, 2]
        assert minimum_new_tokens([first, second]) == [5, 2]

    def test_shared_prefix_of_another_shopper_counts(self):
        a = [9, 9, 9, 1, 1]
        b = [9, 9, 9, 2, 2, 2]
        assert minimum_new_tokens([a, b]) == [5, 3]

    def test_best_earlier_prompt_wins(self):
        a = [1, 2, 3]
        b = [5, 6]
        c = [1, 2, 3, 4]
        assert minimum_new_tokens([a, b, c]) == [3, 2, 1]

    def test_block_rounding_and_at_least_one_token(self):
        a = list(range(10))
        b = [*a, 10, 11]
        assert minimum_new_tokens([a, b], block_size=4) == [10, 4]  # 10 reused -> 8
        assert minimum_new_tokens([a, list(a)]) == [10, 1]

    def test_what_a_cache_held_beforehand_counts_as_reused(self):
        b = list(range(12))
        d = [0, 1, 2, 77, 78, 79, 80, 81]  # shares 3 tokens with b, and a worker held 6
        assert minimum_new_tokens([b, d]) == [12, 5]
        assert minimum_new_tokens([b, d], held=[8, 6]) == [4, 2]
        assert minimum_new_tokens([b, d], held=[8, 1]) == [4, 5]  # b's 3 shared tokens win

    def test_a_disrupted_phase_is_judged_against_its_minimum_given_the_caches(self):
        result = {"computed_tokens_per_request": 120.0}
        # Requests 100 and 102 were sent; 101 was not.
        got = given_caches_fields(result, {100, 102}, 100, [100, 10, 140])
        assert got == {
            "minimum_given_caches_tokens_per_request": 120.0,
            "computed_over_minimum_given_caches": 1.0,
        }
        missed = given_caches_fields(result, {100}, 100, [])
        assert missed["computed_over_minimum_given_caches"] is None

    def test_shared_prefix_tokens(self):
        prompts = [[7, 7, 1], [7, 7, 1, 2], [7, 7, 3]]
        assert shared_prefix_tokens(["a", "a", "b"], prompts) == 2
        assert shared_prefix_tokens(["a"], [[1]]) == 0


class TestWorkload:
    @pytest.fixture(scope="class")
    @classmethod
    def requests(cls):
        return build_requests(WorkloadConfig(shoppers=7, requests=30, seed=3))

    def test_same_instruction_prefix_for_everyone(self, requests):
        assert len({r.messages[0]["content"] for r in requests}) == 1

    def test_a_shoppers_context_grows_and_keeps_its_prefix(self, requests):
        last: dict[str, tuple[int, str]] = {}
        for r in requests:
            user = r.messages[1]["content"]
            events_part = user.split("</events>")[0]
            if r.shopper in last and not r.dropped:
                n, previous = last[r.shopper]
                assert 1 <= r.events - n <= 3
                assert events_part.startswith(previous)
            last[r.shopper] = (r.events, events_part)

    def test_default_workload_stays_within_the_prompt_budget(self):
        requests = build_requests(WorkloadConfig())
        assert sum(1 for r in requests if r.dropped) <= len(requests) // 50

    def test_per_shopper_part_dominates(self, requests):
        system = len(requests[0].messages[0]["content"])
        assert all(len(r.messages[1]["content"]) > 3 * system for r in requests)

    def test_deterministic(self, requests):
        again = build_requests(WorkloadConfig(shoppers=7, requests=30, seed=3))
        assert [r.messages for r in again] == [r.messages for r in requests]

    def test_skewed_lanes(self):
        lanes = build_skewed_lanes(
            hot=2, lanes_per_hot=3, per_hot=6, background_lanes=2, per_background=2, seed=5
        )
        assert len(lanes) == 2 * 3 + 2
        assert [{r.shopper for r in lane} for lane in lanes[:3]] == [{"hot-01"}] * 3
        hot = [r for lane in lanes[:3] for r in sorted(lane, key=lambda r: r.seq)]
        assert sorted(r.events for r in hot) == list(range(hot[0].events, hot[0].events + 6))
        cold = [r.shopper for lane in lanes[6:] for r in lane]
        assert len(cold) == len(set(cold)) == 4
        assert len({r.seq for lane in lanes for r in lane}) == 2 * 6 + 4

    def test_a_tag_makes_every_shopper_of_a_repeat_new(self):
        lanes = build_skewed_lanes(1, 2, 2, 1, 1, seed=5, tag="r2-")
        assert {r.shopper for lane in lanes for r in lane} == {"r2-hot-01", "r2-cold-001"}

    def test_config_validation(self):
        with pytest.raises(ValueError, match="growth"):
            WorkloadConfig(growth=(3, 2))


METRICS = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
"""


class TestMetrics:
    def test_parse_sums_label_sets_and_skips_others(self):
        got = parse_samples(METRICS, COUNTERS)
        assert got["vllm:prompt_tokens_total"] == 1200
        assert got["vllm:request_success_total"] == 5
        assert parse_samples("", ["x"]) == {"x": 0.0}

    def test_parse_by_label(self):
        text = (
            'inference_sidecar_routing_decisions_total{decision="sticky",policy="b",pool="w"} 7.0\n'
            'inference_sidecar_routing_decisions_total{decision="spilled",policy="b"} 2.0\n'
            'inference_sidecar_routing_decisions_created{decision="sticky"} 1.7e9\n'
        )
        got = parse_by_label(text, "inference_sidecar_routing_decisions_total", "decision")
        assert got == {"sticky": 7.0, "spilled": 2.0}

    def test_delta_and_token_summary(self):
        before = {"w1": parse_samples(METRICS, COUNTERS), "w2": dict.fromkeys(COUNTERS, 0.0)}
        after = {
            "w1": {**before["w1"], "vllm:prompt_tokens_total": 2200.0,
                   "vllm:prefix_cache_hits_total": 1700.0},
            "w2": {**before["w2"], "vllm:prompt_tokens_total": 1000.0},
        }  # fmt: skip
        delta = counters_delta(before, after)
        assert delta["w1"]["vllm:prompt_tokens_total"] == 1000
        s = token_summary(delta, requests=4)
        assert (s.prompt_tokens, s.cache_hits, s.computed) == (2000, 800, 1200)
        assert s.hit_ratio == pytest.approx(0.4)
        assert s.computed_per_request == 300

    def test_kv_cache_tokens_from_log(self):
        log = "INFO [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum ..."
        assert kv_cache_tokens(log) == 46592
        assert kv_cache_tokens("nothing") is None

    def test_percentile(self):
        assert percentile([3, 1, 2], 50) == 2
        assert percentile(list(range(1, 101)), 99) == 99
        assert math.isnan(percentile([], 50))

    def test_inflight_balance(self):
        even = inflight_balance([[2, 2, 2], [1, 1, 1]])
        assert even["max_over_mean"] == pytest.approx(1.0)
        skewed = inflight_balance([[6, 0, 0], [3, 0, 0], [0, 0, 0]])
        assert skewed["max_over_mean"] == pytest.approx(3.0)
        assert skewed["peak_max_over_mean"] == pytest.approx(3.0)
        assert skewed["peak"] == 6
        assert math.isnan(inflight_balance([])["max_over_mean"])


def _phase(**values):
    return {"sidecar_bounded_hash": values["ours"], "sidecar_round_robin": values["rr"],
            "vllm_router_consistent_hash": values["ch"]}  # fmt: skip


class TestTargets:
    def test_judge_reports_each_target(self):
        steady = _phase(
            ours={"computed_tokens_per_request": 110, "minimum_tokens_per_request": 100,
                  "computed_over_minimum": 1.1},
            rr={"computed_tokens_per_request": 300},
            ch={"computed_tokens_per_request": 112},
        )  # fmt: skip
        skewed = _phase(
            ours={
                "inflight_max_over_mean_per_repeat": 1.2,
                "latency_p99_s": 2.0,
                "computed_tokens": 1000,
            },
            rr={},
            ch={"latency_p99_s": 1.5, "computed_tokens": 1000},
        )
        got = {t["name"]: t["met"] for t in judge(steady, skewed)}
        assert got == {
            "steady.computed_per_request_vs_minimum": True,
            "steady.computed_per_request_vs_round_robin": True,
            "skewed.inflight_max_over_mean": True,
            "skewed.latency_p99_vs_consistent_hash": False,
        }

    def test_each_target_names_the_phase_it_judges(self):
        targets = judge({}, {}) + judge_kv({}) + judge_vs_peers({}, PHASES)
        assert {judged_phase(t["name"]) for t in targets} == set(PHASES)

    def test_missing_values_are_not_met(self):
        targets = judge({}, {}) + judge_kv({}) + judge_vs_peers({}, PHASES)
        assert all(t["met"] is False for t in targets)

    def test_after_a_join_ours_must_beat_every_peer_within_a_tenth_of_the_minimum(self):
        join = {
            "sidecar_kv_prefix": {"computed_tokens": 900, "computed_over_minimum": 1.08},
            "vllm_router_cache_aware": {"computed_tokens": 950},
            "vllm_router_kv_aware": {"computed_tokens": 880},
        }
        got = {t["name"]: t["met"] for t in judge_kv({"join": join})}
        assert got["kv.join.computed_vs_minimum"] is True
        assert got["kv.join.computed_vs_every_peer"] is False
        assert got["kv.restart.computed_vs_every_peer"] is False

    def test_table_lists_every_router(self):
        row = {"prefix_cache_hit_ratio": 0.5, "errors": 0}
        text = table({"steady": _phase(ours=row, rr=row, ch=row)}, router_labels({}))
        assert "sidecar bounded_hash" in text and "vllm-router consistent_hash" in text

    def test_a_variant_runs_its_router_under_its_own_key_with_its_arguments(self):
        spec = parse_variant("bh_lf2=sidecar_bounded_hash --load-factor=2 --min-bound=4")
        assert (spec.key, spec.router, spec.policy) == ("bh_lf2", "sidecar", "bounded_hash")
        assert spec.args == ("--load-factor=2", "--min-bound=4")
        assert spec.label == "sidecar bounded_hash --load-factor=2 --min-bound=4"

    @pytest.mark.parametrize(
        "value",
        ["bh_lf2=no_such_router --load-factor=2", "bh_lf2=sidecar_bounded_hash",
         "sidecar_kv_prefix=sidecar_bounded_hash --load-factor=2", "=sidecar_bounded_hash -x"],
    )  # fmt: skip
    def test_a_variant_needs_a_new_key_a_known_router_and_an_argument(self, value):
        with pytest.raises(SystemExit, match="--variant"):
            parse_variant(value)

    def test_a_variant_is_tabled_after_the_routers_under_its_label(self):
        doc = {"policies": {"bh_lf2": {"label": "sidecar bounded_hash --load-factor=2"}}}
        row = {"prefix_cache_hit_ratio": 0.5, "errors": 0}
        text = table({"steady": {"bh_lf2": row, "sidecar_bounded_hash": row}}, router_labels(doc))
        lines = text.splitlines()
        assert "sidecar bounded_hash --load-factor=2" in lines[-1]
        assert "sidecar bounded_hash " in lines[-2]


class TestTimeWeightedBalance:
    def test_each_sample_holds_until_the_next_and_the_last_until_the_end(self):
        assert sample_weights([0.0, 0.2, 0.5], end=1.0) == pytest.approx([0.2, 0.3, 0.5])
        assert sample_weights([0.0, 0.2, 0.4]) == pytest.approx([0.2, 0.2, 0.2])
        assert sample_weights([]) == []

    def test_a_long_gap_weighs_its_sample_more(self):
        rows = [[3, 0, 0], [1, 1, 1]]
        equal = inflight_balance(rows)
        weighted = inflight_balance(rows, [9.0, 1.0])  # the skewed sample held 9 s
        assert weighted["max_over_mean"] > equal["max_over_mean"]
        assert weighted["max_over_mean"] == pytest.approx((2.8) / (3.0 / 3))
        assert weighted["span_s"] == 10.0

    def test_weights_must_match_samples(self):
        with pytest.raises(ValueError):
            inflight_balance([[1, 1]], [1.0, 2.0])


SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "dtype": "bfloat16",
}


class TestKvCacheSize:
    def test_a_bf16_token_takes_k_and_v_of_every_kv_head_in_two_bytes(self):
        assert kv_bytes_per_token(SMOLLM2_135M, "bfloat16") == 30 * 3 * 64 * 2 * 2

    def test_a_float32_token_takes_twice_the_bytes(self):
        assert kv_bytes_per_token(SMOLLM2_135M, "float32") == 2 * kv_bytes_per_token(
            SMOLLM2_135M, "bfloat16"
        )

    def test_auto_uses_the_models_own_dtype(self):
        assert kv_bytes_per_token(SMOLLM2_135M, "auto") == 23_040

    def test_head_dim_defaults_to_hidden_size_over_heads(self):
        shape = {k: v for k, v in SMOLLM2_135M.items() if k != "head_dim"}
        assert kv_bytes_per_token(shape, "bfloat16") == 23_040


class TestPerRequestUsage:
    def test_the_last_chunk_gives_prompt_and_cached_tokens(self):
        line = (
            'data: {"id":"c","choices":[],"usage":{"prompt_tokens":2300,"completion_tokens":8,'
            '"prompt_tokens_details":{"cached_tokens":2240}}}'
        )
        assert chunk_usage(line)["prompt_tokens_details"]["cached_tokens"] == 2240

    def test_content_chunks_and_the_end_marker_have_none(self):
        assert chunk_usage('data: {"choices":[{"delta":{"content":"x"}}],"usage":null}') is None
        assert chunk_usage("data: [DONE]") is None
        assert chunk_usage('data: {"usage": ') is None


def _config(**changes):
    base = BenchConfig(
        workload=WorkloadConfig(), concurrency=3, max_tokens=8, kv_cache_bytes=1, cores=(),
        block_size=32, hot=3, lanes_per_hot=3, per_hot=24, background=3, per_background=3,
        time_limit_s=60, out_dir=None,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


class TestSchedule:
    def test_each_skewed_repeat_rotates_the_routers_and_round_robin_runs_once(self):
        keys = ("sidecar_bounded_hash", "sidecar_round_robin", "vllm_router_consistent_hash")
        specs = [spec for spec in ROUTERS if spec.key in keys]
        plan = schedule(specs, _config(skewed_repeats=3))
        steady = [spec.key for kind, _, spec in plan if kind == "steady"]
        assert steady == list(keys)
        skewed = [(r, spec.policy) for kind, r, spec in plan if kind == "skewed"]
        assert skewed == [
            (0, "bounded_hash"), (0, "round_robin"), (0, "consistent_hash"),
            (1, "consistent_hash"), (1, "bounded_hash"),
            (2, "consistent_hash"), (2, "bounded_hash"),
        ]  # fmt: skip

    def test_the_restart_then_the_join_phase_run_last_once_per_router(self):
        plan = schedule(ROUTERS, _config(phases=("steady", "skewed", "restart", "join")))
        n = len(ROUTERS)
        assert [(kind, spec.key) for kind, _, spec in plan[-2 * n :]] == [
            *(("restart", spec.key) for spec in ROUTERS),
            *(("join", spec.key) for spec in ROUTERS),
        ]

    def test_phases_can_be_left_out(self):
        plan = schedule(ROUTERS, _config(skewed_repeats=2, phases=("skewed",)))
        assert {kind for kind, _, _ in plan} == {"skewed"}


def _outcome(seq, total_s, cached=None):
    return Outcome(seq, f"s{seq}", True, total_s / 2, total_s, "http://w0", "", 100.0 + seq,
                   1000, cached)  # fmt: skip


class TestPooledRepeats:
    def test_repeats_pool_latencies_and_sum_tokens_and_keep_each_run(self):
        workers = ["http://w0"]
        parts, runs = [], []
        for computed in (300.0, 500.0):
            outcomes = [_outcome(i, float(i + 1)) for i in range(50)]
            delta = {"http://w0": {"vllm:prompt_tokens_total": 1000.0,
                                   "vllm:prefix_cache_hits_total": 1000.0 - computed}}  # fmt: skip
            sampled = Sampled([[1.0], [2.0]], [1.0, 1.0])
            run = summarise(outcomes, delta, sampled, workers, 5.0, 10.0, False)
            run["router_decisions"] = {"sticky": 49, "placed": 1}
            runs.append(run)
            parts.append(RunParts(outcomes, delta, sampled, [5] * 50))
        pooled = pool_runs(runs, parts, workers)
        assert pooled["requests"] == 100
        assert pooled["computed_tokens"] == 800
        assert pooled["computed_tokens_per_request"] == 8.0
        assert pooled["wall_s"] == 20.0
        assert pooled["router_decisions"] == {"sticky": 98, "placed": 2}
        assert [r["computed_tokens"] for r in pooled["runs"]] == [300, 500]
        assert "per_request" not in pooled and "per_request" in pooled["runs"][0]

    def test_balance_is_judged_per_repeat_not_on_the_repeats_samples_pooled(self):
        """Two repeats, each with everything on one worker, a different one each time:
        pooled, the two workers look equally busy; per repeat, neither was."""
        workers = ["http://w0", "http://w1"]
        parts, runs = [], []
        for busy in ([4.0, 0.0], [0.0, 4.0]):
            outcomes = [_outcome(i, 1.0) for i in range(10)]
            delta = {w: {"vllm:prompt_tokens_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
                     for w in workers}  # fmt: skip
            sampled = Sampled([busy, busy], [1.0, 1.0])
            runs.append(summarise(outcomes, delta, sampled, workers, 1.0, 1.0, False))
            parts.append(RunParts(outcomes, delta, sampled, [1] * 10))

        pooled = pool_runs(runs, parts, workers)

        assert pooled["inflight_max_over_mean"] == 1.0
        assert pooled["inflight_max_over_mean_per_repeat"] == 2.0
        skewed = {"sidecar_bounded_hash": pooled}
        verdicts = {t["name"]: t["met"] for t in judge({}, skewed)}
        assert verdicts["skewed.inflight_max_over_mean"] is False

    def test_a_request_row_holds_its_worker_time_and_cached_tokens(self):
        outcomes = [_outcome(0, 2.0, cached=960), _outcome(1, 4.0)]
        delta = {
            "http://w0": {"vllm:prompt_tokens_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        }
        rows = summarise(outcomes, delta, Sampled([], []), ["http://w0"], 1.0, 1.0, False)
        assert rows["per_request"] == [
            [0, "s0", 0, 0.0, 1.0, 2.0, 1000, 960],
            [1, "s1", 0, 1.0, 2.0, 4.0, 1000, None],
        ]


class TestResultsFile:
    def test_each_request_row_is_one_line_and_the_json_reads_back_the_same(self):
        doc = {"phases": {"steady": {"per_request": [[0, "s-1", 2, 0.0, 1.5, 2.0, 900, 860],
                                                     [1, "s-2", None, 0.5, 1.0, 1.25, 800, None]],
                                     "notes": ["a [bracketed] note"]}}}  # fmt: skip
        text = dump(doc)
        assert '[0, "s-1", 2, 0.0, 1.5, 2.0, 900, 860]' in text.splitlines()[4]
        assert json.loads(text) == doc


class TestReplicasPhase:
    def test_the_spreading_client_sends_each_request_to_the_next_replica_in_turn(self):
        spread = RoundRobin(["http://r1", "http://r2", "http://r3"])
        assert [spread() for _ in range(7)] == [
            "http://r1", "http://r2", "http://r3", "http://r1", "http://r2", "http://r3",
            "http://r1",
        ]  # fmt: skip

    def test_one_replica_takes_every_request(self):
        spread = RoundRobin(["http://r1"])
        assert {spread() for _ in range(5)} == {"http://r1"}

    def test_a_spreading_client_needs_a_replica(self):
        with pytest.raises(ValueError, match="at least one replica"):
            RoundRobin([])

    def test_a_request_goes_to_its_targets_choice_made_when_it_is_sent(self):
        spread = RoundRobin(["http://r1", "http://r2"])
        assert [base_url(spread), base_url(spread)] == ["http://r1", "http://r2"]
        assert base_url("http://router") == "http://router"

    def test_each_run_is_compared_with_one_replicas(self):
        runs = {
            1: {"computed_tokens_per_request": 400.0, "inflight_max_over_mean": 1.2},
            2: {"computed_tokens_per_request": 410.0, "inflight_max_over_mean": 1.5},
            3: {"computed_tokens_per_request": 500.0, "inflight_max_over_mean": None},
        }
        assert vs_one_replica(runs) == {
            1: {"computed_tokens_per_request": 1.0, "inflight_max_over_mean": 1.0},
            2: {"computed_tokens_per_request": 1.025, "inflight_max_over_mean": 1.25},
            3: {"computed_tokens_per_request": 1.25, "inflight_max_over_mean": None},
        }

    @pytest.mark.parametrize(("value", "base"), [(1.0, None), (None, 1.0), (1.0, 0.0),
                                                 (math.nan, 1.0), (1.0, math.nan)])  # fmt: skip
    def test_a_ratio_without_both_figures_is_none(self, value, base):
        assert ratio(value, base) is None

    def test_two_and_three_replicas_are_judged_against_one(self):
        runs = {
            1: {"computed_tokens_per_request": 400.0, "inflight_max_over_mean": 1.2},
            2: {"computed_tokens_per_request": 420.0, "inflight_max_over_mean": 1.32},
            3: {"computed_tokens_per_request": 422.0, "inflight_max_over_mean": 1.33},
        }
        got = {t["name"]: (t["value"], t["limit"], t["met"]) for t in judge_replicas(runs, "ours")}
        assert got == {
            "replicas.2.computed_per_request_vs_one": (1.05, 1.05, True),
            "replicas.2.inflight_max_over_mean_vs_one": (1.1, 1.1, True),
            "replicas.3.computed_per_request_vs_one": (1.055, 1.05, False),
            "replicas.3.inflight_max_over_mean_vs_one": (1.108, 1.1, False),
        }

    def test_without_a_one_replica_run_nothing_is_met(self):
        runs = {2: {"computed_tokens_per_request": 400.0, "inflight_max_over_mean": 1.0}}
        assert all(t["met"] is False for t in judge_replicas(runs, "ours"))

    def test_ours_runs_with_each_load_view_beside_vllm_routers_peers(self):
        specs = replica_specs([spec.key for spec in ROUTERS])
        assert [(s.key, s.args) for s in specs] == [
            ("sidecar_bounded_hash_load_view_workers", ("--load-view", "workers")),
            ("sidecar_bounded_hash_load_view_own", ("--load-view", "own")),
            ("vllm_router_consistent_hash", ()),
            ("vllm_router_cache_aware", ()),
        ]

    def test_a_variant_of_ours_runs_with_the_workers_load_view(self):
        variant = parse_variant("ours_hash=sidecar_bounded_hash --new-key-placement=hash")
        specs = replica_specs(["sidecar_bounded_hash"], [variant])
        assert (specs[-1].key, specs[-1].args) == (
            "ours_hash_load_view_workers",
            ("--new-key-placement=hash", "--load-view", "workers"),
        )

    def test_the_phase_runs_the_routers_chosen_only(self):
        specs = replica_specs(["vllm_router_cache_aware", "sidecar_round_robin"])
        assert [s.key for s in specs] == ["vllm_router_cache_aware"]

    def test_one_to_three_replicas_of_each_router_run_after_the_other_phases(self):
        cfg = _config(phases=("steady", "replicas"), routers=("sidecar_bounded_hash",))
        specs = [spec for spec in ROUTERS if spec.key == "sidecar_bounded_hash"]
        plan = [(kind, n, spec.key) for kind, n, spec in schedule(specs, cfg)]
        assert plan == [
            ("steady", 0, "sidecar_bounded_hash"),
            *(
                ("replicas", n, f"sidecar_bounded_hash_load_view_{view}")
                for n in (1, 2, 3)
                for view in ("workers", "own")
            ),
        ]

    def test_the_phase_is_selectable_alone(self):
        assert chosen("--phases", "replicas", PHASE_CHOICES) == ("replicas",)
        plan = schedule(ROUTERS, _config(phases=("replicas",)))
        assert {kind for kind, _, _ in plan} == {"replicas"}

    def test_the_results_key_each_run_by_its_replica_count(self):
        specs = {s.key: s for s in replica_specs(["sidecar_bounded_hash"])}
        run = {"computed_tokens_per_request": 400.0, "inflight_max_over_mean": 1.2, "errors": 0}
        runs = {"sidecar_bounded_hash_load_view_workers": {2: run, 1: run}}
        doc = replicas_doc(runs, specs, seed=11)
        assert list(doc) == ["sidecar_bounded_hash_load_view_workers"]
        entry = doc["sidecar_bounded_hash_load_view_workers"]
        assert list(entry["runs"]) == ["1", "2"]
        assert entry["vs_one_replica"]["2"]["computed_tokens_per_request"] == 1.0
        assert json.loads(dump(doc)) == doc

    def test_the_table_has_a_row_per_router_and_replica_count(self):
        specs = {s.key: s for s in replica_specs(["sidecar_bounded_hash"])}
        one = {"computed_tokens_per_request": 400.0, "inflight_max_over_mean": 1.2, "errors": 0}
        two = {"computed_tokens_per_request": 440.0, "inflight_max_over_mean": 1.2, "errors": 0}
        doc = replicas_doc({"sidecar_bounded_hash_load_view_own": {1: one, 2: two}}, specs, 11)
        lines = replicas_table(doc).splitlines()
        assert len(lines) == 4
        assert "--load-view own | 2 " in lines[-1] and "1.100" in lines[-1]

    def test_decisions_are_summed_over_the_replicas(self, monkeypatch):
        pages = {
            "http://r1/metrics": 'inference_sidecar_routing_decisions_total{decision="sticky"} 3',
            "http://r2/metrics": 'inference_sidecar_routing_decisions_total{decision="sticky"} 2\n'
            'inference_sidecar_routing_decisions_total{decision="spilled"} 1',
        }

        def get(url, timeout):
            return SimpleNamespace(text=pages[url])

        monkeypatch.setattr(routing.httpx, "get", get)
        assert router_decisions(RoundRobin(["http://r1", "http://r2"])) == {
            "sticky": 5.0,
            "spilled": 1.0,
        }

    def test_a_run_starts_fresh_replicas_spreads_over_them_and_stops_them_whatever_happens(
        self, monkeypatch
    ):
        started, stopped, seen = [], [], {}

        def start(spec, pool, block_size, log_dir, sidecar_args=()):
            started.append((spec.key, spec.args))
            return SimpleNamespace(stop=lambda: stopped.append(spec.key)), f"http://{spec.key}"

        async def phase(kind, target, workers, model, work, cfg, deadline):
            seen.update(kind=kind, workers=workers, urls=[target() for _ in range(4)])
            raise RuntimeError("the phase failed")

        monkeypatch.setattr(routing, "start_router", start)
        monkeypatch.setattr(routing, "run_phase", phase)
        spec = replica_specs(["sidecar_bounded_hash"])[0]
        pool = SimpleNamespace(urls=["http://w1", "http://w2", "http://w3"])
        with pytest.raises(RuntimeError, match="the phase failed"):
            asyncio.run(routing.run_replicas(spec, 2, pool, _config(), Path("."), "m", [], 0.0))
        keys = [f"{spec.key}_x2_1", f"{spec.key}_x2_2"]
        assert started == [(key, ("--load-view", "workers")) for key in keys]
        assert seen == {
            "kind": "skewed",
            "workers": pool.urls,
            "urls": [f"http://{key}" for key in keys] * 2,
        }
        assert stopped == keys


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """``parse_args`` reads the model's shape to size the caches: a stand-in for it."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    monkeypatch.setattr(routing, "find_model_dir", lambda: tmp_path)
    monkeypatch.setattr(routing, "host_cpu_dtype", lambda: "bfloat16")
    return tmp_path


class TestPressurePhase:
    def test_it_runs_by_default_and_alone(self, model_dir):
        assert "pressure" in parse_args([]).phases
        assert parse_args(["--phases", "pressure"]).phases == ("pressure",)
        plan = schedule(ROUTERS, _config(phases=("pressure",)))
        assert [(kind, spec.key) for kind, _, spec in plan] == [
            ("pressure", spec.key) for spec in ROUTERS
        ]

    def test_it_runs_each_router_once_after_the_skewed_phase_and_before_the_disruptions(self):
        phases = ("steady", "skewed", "pressure", "restart", "join")
        plan = schedule(ROUTERS, _config(skewed_repeats=2, phases=phases))
        kinds = [kind for kind, _, _ in plan]
        assert kinds.index("pressure") > max(i for i, k in enumerate(kinds) if k == "skewed")
        assert max(i for i, k in enumerate(kinds) if k == "pressure") < kinds.index("restart")
        assert [spec.key for kind, _, spec in plan if kind == "pressure"] == [
            spec.key for spec in ROUTERS
        ]

    def test_its_workload_is_more_shoppers_of_the_steady_kind_under_new_keys(self, model_dir):
        cfg = parse_args([])
        assert cfg.pressure.shoppers >= 3 * cfg.workload.shoppers
        assert (cfg.pressure.growth, cfg.pressure.zipf_exponent) == (
            cfg.workload.growth,
            cfg.workload.zipf_exponent,
        )
        small = _config(
            phases=("pressure",), pressure=WorkloadConfig(shoppers=5, requests=12, seed=3)
        )
        requests = pressure_workload(small)
        assert len(requests) == 12
        assert all(r.shopper.startswith("pressure-") for r in requests)
        assert pressure_workload(_config(phases=("steady",))) == []

    def test_its_requests_are_sent_in_order_with_its_own_concurrency(self, model_dir):
        cfg = parse_args(["--pressure-concurrency", "9", "--concurrency", "2"])
        assert ordered_concurrency("pressure", cfg) == 9
        assert ordered_concurrency("steady", cfg) == 2
        assert ordered_concurrency("skewed", cfg) is None

    def test_its_flags_set_its_shoppers_and_requests(self, model_dir):
        cfg = parse_args(["--pressure-shoppers", "131", "--pressure-requests", "300"])
        assert (cfg.pressure.shoppers, cfg.pressure.requests) == (131, 300)
        assert cfg.pressure_min_over_all_caches == PRESSURE_MIN_OVER_ALL_CACHES == 1.5

    def test_a_quick_run_does_not_require_pressure(self, model_dir):
        cfg = parse_args(["--quick"])
        assert cfg.pressure_min_over_all_caches == 0
        assert cfg.pressure.requests < 50

    def test_a_working_set_below_the_bound_stops_the_run_saying_what_to_change(self):
        with pytest.raises(SystemExit, match=r"1\.40x .* --pressure-shoppers \(now 97\)"):
            check_pressure(140_000, 100_000 // 3, 3, 1.5, shoppers=97)

    def test_a_working_set_at_the_bound_passes_and_gives_its_ratio(self):
        assert check_pressure(157_500, 35_000, 3, 1.5, 97) == pytest.approx(1.5)
        assert check_pressure(177_176, 34_944, 3, 1.5, 97) == pytest.approx(1.69, abs=0.01)
        with pytest.raises(SystemExit, match=r"at least 1\.5x \(157500 tokens\)"):
            check_pressure(157_499, 35_000, 3, 1.5, 97)

    def test_without_the_cache_size_the_bound_cannot_be_checked(self):
        with pytest.raises(SystemExit, match="KV cache size"):
            check_pressure(200_000, None, 3, 1.5, 97)
        assert math.isnan(check_pressure(200_000, None, 3, 0.0, 11))

    def test_it_gets_three_shares_of_the_time_left(self):
        assert phase_budget(600.0, ["pressure", "pressure", "restart"]) == pytest.approx(
            600 * 3 / 7
        )
        assert phase_budget(600.0, ["restart", "join", "pressure"]) == pytest.approx(120.0)
        assert phase_budget(600.0, []) == 600.0

    def test_the_results_record_its_working_set_against_the_caches(self):
        cfg = _config(pressure=WorkloadConfig(shoppers=2, requests=3))
        requests = build_requests(cfg.pressure, prefix="pressure")
        tokens = [[1] * n for n in (100, 200, 300)]
        doc = pressure_doc(cfg, requests, tokens, [100, 20, 300], 400, 100, 400 / 300)
        assert doc["working_set_tokens"] == 400
        assert doc["working_set_over_one_cache"] == 4.0
        assert doc["working_set_over_all_caches"] == 1.33
        assert doc["required_over_all_caches"] == 1.5
        assert doc["concurrency"] == 6
        assert doc["minimum_tokens_per_request"] == 140.0
        assert doc["prompt_tokens"]["max"] == 300
        assert json.loads(dump(doc))["working_set_over_all_caches"] == 1.33
        line = pressure_lines(doc)[0]
        assert "400 tokens = 1.33x all three caches (at least 1.5x required)" in line
        assert pressure_lines(None) == []


def _vs_peers(**per_request):
    return {key: {"computed_tokens_per_request": v} for key, v in per_request.items()}


class TestTokensAgainstThePeers:
    def test_each_phase_run_is_judged_against_the_best_peer_and_consistent_hash(self):
        phases = {
            "skewed": _vs_peers(
                sidecar_bounded_hash=330.0,
                vllm_router_cache_aware=300.0,
                vllm_router_consistent_hash=340.0,
                vllm_router_kv_aware=360.0,
            )
        }
        got = {
            t["name"]: (t["value"], t["limit"], t["met"])
            for t in judge_vs_peers(phases, ["skewed"])
        }
        assert got == {
            "skewed.computed_per_request_vs_best_peer": (1.1, 1.1, True),
            "skewed.computed_per_request_vs_consistent_hash": (330.0, 340.0, True),
        }

    def test_within_a_tenth_of_the_best_peer_yet_above_consistent_hash_is_a_miss(self):
        """The user's figures under pressure, with our policy 5% above cache_aware."""
        phases = {
            "pressure": _vs_peers(
                sidecar_bounded_hash=223.0,
                vllm_router_cache_aware=212.0,
                vllm_router_consistent_hash=222.0,
                vllm_router_kv_aware=360.0,
            )
        }
        got = {t["name"]: t["met"] for t in judge_vs_peers(phases, ["pressure"])}
        assert got == {
            "pressure.computed_per_request_vs_best_peer": True,
            "pressure.computed_per_request_vs_consistent_hash": False,
        }

    def test_the_users_measurement_misses_both(self):
        phases = {
            "pressure": _vs_peers(
                sidecar_bounded_hash=319.0,
                sidecar_kv_prefix=263.0,
                sidecar_round_robin=384.0,
                vllm_router_cache_aware=212.0,
                vllm_router_consistent_hash=246.0,
                vllm_router_kv_aware=360.0,
            )
        }
        got = {t["name"]: (t["value"], t["met"]) for t in judge_vs_peers(phases, ["pressure"])}
        assert got == {
            "pressure.computed_per_request_vs_best_peer": (1.505, False),
            "pressure.computed_per_request_vs_consistent_hash": (319.0, False),
        }

    def test_our_other_policies_and_variants_are_not_peers(self):
        phases = {
            "steady": {
                **_vs_peers(sidecar_bounded_hash=500.0, vllm_router_consistent_hash=500.0),
                **_vs_peers(sidecar_kv_prefix=100.0, sidecar_bounded_hash_lf2=100.0),
            }
        }
        best = judge_vs_peers(phases, ["steady"])[0]
        assert (best["value"], best["met"]) == (1.0, True)
        assert "consistent_hash 500.0" in best["note"]

    def test_only_the_phases_asked_for_are_judged(self):
        names = [t["name"] for t in judge_vs_peers({}, ["steady", "pressure"])]
        assert names == [
            "steady.computed_per_request_vs_best_peer",
            "steady.computed_per_request_vs_consistent_hash",
            "pressure.computed_per_request_vs_best_peer",
            "pressure.computed_per_request_vs_consistent_hash",
        ]

    def test_without_peers_nothing_is_met(self):
        phases = {"join": _vs_peers(sidecar_bounded_hash=300.0)}
        assert [t["met"] for t in judge_vs_peers(phases, ["join"])] == [False, False]


def _served(seq, shopper, worker, prompt=1000, cached=900, ok=True):
    return Outcome(seq, shopper, ok, 0.1, 0.2, worker, "", float(seq), prompt, cached)


class TestComputedByAffinity:
    def test_each_request_is_first_stayed_or_moved_against_its_shoppers_previous_one(self):
        outcomes = [
            _served(0, "a", "w0", 1000, 160),
            _served(1, "b", "w1", 800, 160),
            _served(2, "a", "w0", 1040, 1000),
            _served(3, "a", "w2", 1080, 160),  # spilled: a cold prefill on w2
            _served(4, "b", "w1", 840, 800),
        ]
        assert computed_by_affinity(outcomes) == {
            "first": {"requests": 2, "computed_tokens": 840 + 640, "recomputed_over_half": 2},
            "stayed": {"requests": 2, "computed_tokens": 40 + 40, "recomputed_over_half": 0},
            "moved": {"requests": 1, "computed_tokens": 920, "recomputed_over_half": 1},
            "without_usage": 0,
        }

    def test_a_stay_whose_prefix_was_evicted_counts_as_recomputed(self):
        outcomes = [_served(0, "a", "w0", 1000, 0), _served(1, "a", "w0", 1040, 160)]
        assert computed_by_affinity(outcomes)["stayed"] == {
            "requests": 1,
            "computed_tokens": 880,
            "recomputed_over_half": 1,
        }

    def test_requests_are_taken_in_schedule_order_not_the_order_they_ended(self):
        outcomes = [_served(1, "a", "w1", 1040, 1000), _served(0, "a", "w0", 1000, 0)]
        got = computed_by_affinity(outcomes)
        assert got["first"]["computed_tokens"] == 1000 and got["moved"]["requests"] == 1

    def test_without_the_worker_a_later_request_is_a_return(self):
        outcomes = [_served(0, "a", "", 1000, 0), _served(1, "a", "", 1040, 1000)]
        assert computed_by_affinity(outcomes) == {
            "first": {"requests": 1, "computed_tokens": 1000, "recomputed_over_half": 1},
            "returned": {"requests": 1, "computed_tokens": 40, "recomputed_over_half": 0},
            "without_usage": 0,
        }

    def test_failures_are_left_out_and_replies_without_usage_counted_apart(self):
        outcomes = [
            _served(0, "a", "w0", ok=False),
            _served(1, "a", "w0", None, None),
            _served(2, "a", "w1"),
        ]
        got = computed_by_affinity(outcomes)
        assert got["without_usage"] == 1
        assert "first" not in got and got["moved"]["requests"] == 1

    def test_every_phase_records_it(self):
        outcomes = [_served(0, "a", "http://w0", 1000, 0)]
        delta = {
            "http://w0": {"vllm:prompt_tokens_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        }
        result = summarise(outcomes, delta, Sampled([], []), ["http://w0"], 1.0, 1.0, False)
        assert result["computed_by_affinity"]["first"]["requests"] == 1
