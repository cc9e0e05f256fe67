"""The ``workers`` load view's rules: a worker's load read from its ``/metrics`` page, the
requests this router sent since the sample added, never below its own count, and its own
count standing in where no recent sample is (``inference_sidecar.load_view``)."""

from __future__ import annotations

import pytest

from inference_sidecar.load_view import (
    Sample,
    WorkerLoad,
    WorkerLoads,
    combine,
    reported_load,
    sample_lifetime,
)
from inference_sidecar.policies import make_policy
from inference_sidecar.policies.bounded_hash import preference_order
from inference_sidecar.routing_state import RoutingState
from tests.support.clock import FakeClock

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"

#: A worker's page as vLLM writes it, cut down: other gauges, a histogram, the waiting
#: gauge by reason (which sums to the waiting gauge), and both gauges of two engines.
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 12.5
"""


class TestReportedLoad:
    def test_is_running_plus_waiting_over_every_engine(self) -> None:
        assert reported_load(PAGE) == 6

    def test_the_waiting_gauge_by_reason_is_not_counted_again(self) -> None:
        without = "\n".join(line for line in PAGE.splitlines() if "by_reason" not in line)
        assert reported_load(without) == reported_load(PAGE)

    def test_gauges_without_help_or_labels_are_read(self) -> None:
        page = "vllm:num_requests_running 2\nvllm:num_requests_waiting 5\n"
        assert reported_load(page) == 7

    def test_a_page_without_a_gauge_is_an_error_naming_it(self) -> None:
        page = "vllm:num_requests_running 2\n"
        with pytest.raises(ValueError, match="vllm:num_requests_waiting"):
            reported_load(page)

    def test_a_page_of_another_server_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="no vllm:num_requests_running"):
            reported_load("<html>not found</html>")

    def test_a_value_that_is_no_number_is_an_error(self) -> None:
        page = "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n"
        with pytest.raises(ValueError, match="nan"):
            reported_load(page)


class TestCombine:
    LIFETIME = 3.0

    def test_no_sample_counts_the_routers_own_requests(self) -> None:
        assert combine(2, None, 7, 10.0, self.LIFETIME) == WorkerLoad(2, "own")

    def test_the_reported_load_plus_what_this_router_sent_since_the_answer(self) -> None:
        sample = Sample(reported=5, taken_at=9.0, sent_mark=10)
        got = combine(1, sample, 13, 10.0, self.LIFETIME)
        assert got == WorkerLoad(8, "workers", 5, 3, 1.0)

    def test_what_this_router_saw_end_since_the_answer_comes_off_the_report(self) -> None:
        sample = Sample(reported=5, taken_at=9.0, sent_mark=10, finished_mark=2)
        assert combine(1, sample, 10, 10.0, self.LIFETIME, finished_total=4).load == 3

    def test_never_below_the_routers_own_requests_in_flight(self) -> None:
        sample = Sample(reported=0, taken_at=9.0, sent_mark=4)
        assert combine(3, sample, 4, 10.0, self.LIFETIME).load == 3

    def test_a_sample_is_trusted_for_its_whole_lifetime(self) -> None:
        sample = Sample(reported=5, taken_at=7.0, sent_mark=0)
        assert combine(0, sample, 0, 10.0, self.LIFETIME).source == "workers"

    def test_a_stale_sample_gives_way_to_the_routers_own_count(self) -> None:
        sample = Sample(reported=5, taken_at=6.9, sent_mark=0)
        assert combine(2, sample, 9, 10.0, self.LIFETIME) == WorkerLoad(2, "own")

    def test_a_lifetime_lets_one_poll_fail_or_hang(self) -> None:
        assert sample_lifetime(0.5, 1.0) == 3.0


class TestWorkerLoads:
    def make(self) -> tuple[WorkerLoads, FakeClock]:
        clock = FakeClock(100.0)
        return WorkerLoads(sample_lifetime(0.5, 1.0), clock), clock

    def test_a_request_sent_while_the_poll_was_out_is_not_counted_twice(self) -> None:
        """The page counted it: the report alone holds it."""
        loads, clock = self.make()
        loads.sent(A)
        clock.advance(0.1)
        loads.record(A, 4)
        assert loads.figure(A, own_in_flight=1) == WorkerLoad(4, "workers", 4, 0, 0.0)

    def test_one_the_page_missed_still_counts_as_this_routers_own(self) -> None:
        loads, _ = self.make()
        loads.sent(A)
        loads.record(A, 0)
        assert loads.loads({A: 1}, [A]) == {A: 1}

    def test_a_request_that_ended_before_the_answer_arrived_is_not_taken_off(self) -> None:
        """The worker may have counted it when it rendered its page: the view errs busy."""
        loads, _ = self.make()
        loads.finished(A)
        loads.record(A, 2)
        assert loads.loads({A: 0}, [A]) == {A: 2}

    def test_the_next_sample_absorbs_what_was_sent_before_it(self) -> None:
        loads, _ = self.make()
        loads.record(A, 0)
        for _ in range(3):
            loads.sent(A)
        assert loads.loads({A: 0}, [A]) == {A: 3}
        loads.record(A, 2)
        assert loads.loads({A: 0}, [A]) == {A: 2}

    def test_a_failed_poll_keeps_the_last_sample_until_it_is_stale(self) -> None:
        loads, clock = self.make()
        loads.record(A, 6)
        clock.advance(1.0)
        loads.failed(A, "timeout: no answer within 1 s")
        assert loads.figure(A, 1).source == "workers"
        clock.advance(2.5)
        assert loads.figure(A, 1) == WorkerLoad(1, "own")
        assert loads.errors == {A: "timeout: no answer within 1 s"}

    def test_a_run_of_failures_is_reported_once_and_its_end_once(self) -> None:
        loads, _ = self.make()
        assert loads.failed(A, "connect: refused") is True
        assert loads.failed(A, "connect: refused") is False
        assert loads.record(A, 0) is True
        assert loads.record(A, 0) is False
        assert loads.errors == {}

    def test_a_worker_that_left_is_forgotten(self) -> None:
        loads, _ = self.make()
        loads.sent(A)
        loads.record(A, 5)
        loads.forget(A)
        assert loads.figure(A, 0) == WorkerLoad(0, "own")
        loads.record(A, 0)
        assert loads.figure(A, 0).sent_since_sample == 0


class TestPoolWithTheWorkersView:
    def pool(self) -> tuple[RoutingState, WorkerLoads]:
        loads = WorkerLoads(sample_lifetime(0.5, 1.0), FakeClock())
        pool = RoutingState("worker", [A, B], make_policy("bounded_hash"), worker_loads=loads)
        return pool, loads

    def test_a_key_leaves_its_worker_when_the_worker_reports_the_load_other_routers_sent(
        self,
    ) -> None:
        pool, loads = self.pool()
        key = next(k for k in (f"s{i}" for i in range(100)) if preference_order(k, [A, B])[0] == A)
        first = pool.choose(key)
        assert first is not None and first.worker == A
        pool.finish(A, True, 0.1, 0.0, pool.start(A, key))
        loads.record(A, 10)
        loads.record(B, 1)
        choice = pool.choose(key)
        assert choice is not None and (choice.worker, choice.decision) == (B, "spilled")

    def test_a_request_started_counts_as_sent(self) -> None:
        pool, loads = self.pool()
        loads.record(A, 0)
        pool.start(A)
        pool.start(A)
        assert pool.loads()[A] == 2

    def test_with_one_router_the_view_follows_its_own_requests_between_polls(self) -> None:
        pool, loads = self.pool()
        tickets = [pool.start(A) for _ in range(3)]
        loads.record(A, 3)
        for ticket in tickets[:2]:
            pool.finish(A, True, 0.1, 0.0, ticket)
        assert pool.loads()[A] == pool.in_flight[A] == 1

    def test_health_says_where_each_load_comes_from(self) -> None:
        pool, loads = self.pool()
        loads.record(A, 4)
        pool.start(B)
        status = pool.status()
        assert (status[A]["load"], status[A]["load_source"]) == (4, "workers")
        assert (status[B]["load"], status[B]["load_source"]) == (1, "own")

    def test_without_the_view_the_load_is_the_routers_own(self) -> None:
        pool = RoutingState("worker", [A, B], make_policy("bounded_hash"))
        pool.start(A)
        assert pool.loads() == {A: 1, B: 0}
        assert pool.status()[A]["load_source"] == "own"
