"""A pool's routing state, router configuration, PD rewriting and the command line."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from inference_sidecar import cli, pd
from inference_sidecar.arguments import LOAD_VIEW_ENV
from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.health import HealthEvent
from inference_sidecar.policies import make_policy
from inference_sidecar.routing_state import Choice, RoutingState, classify, work_units

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


class TestClassify:
    def test_cases(self) -> None:
        assert classify(None, A, [A, B]) == "balanced"
        assert classify(A, A, [A, B]) == "sticky"
        assert classify(A, B, [A, B]) == "spilled"
        assert classify(A, B, [B]) == "failed_over"


class TestRoutingState:
    def pool(self, **kw) -> RoutingState:
        return RoutingState("worker", [A, B, C], make_policy("bounded_hash"), **kw)

    def test_placed_then_sticky_then_failed_over_when_home_excluded(self) -> None:
        pool = self.pool()
        first = pool.choose("k", size=1000)
        assert first is not None and first.decision == "placed"
        pool.finish(first.worker, True, 0.1, 0.0, pool.start(first.worker, "k", 1000))
        again = pool.choose("k", size=1010)
        assert again == Choice(first.worker, "sticky")
        other = pool.choose("k", exclude=[first.worker], size=1010)
        assert other is not None and other.worker != first.worker
        assert other.decision == "failed_over"

    def test_a_key_spilled_by_cost_is_reported_as_spilled(self) -> None:
        pool = self.pool()
        first = pool.choose("k", size=100)
        assert first is not None
        pool.start(first.worker, "k", 100)  # in flight: its 100 tokens are queued there
        pool.start(first.worker, "new", 6000)  # a new shopper's big prompt queued there too
        spilled = pool.choose("k", size=110)
        assert spilled is not None and spilled.worker != first.worker
        assert spilled.decision == "spilled"

    def test_none_when_everything_excluded(self) -> None:
        assert self.pool().choose("k", exclude=[A, B, C]) is None

    def test_in_flight_accounting_never_negative(self) -> None:
        pool = self.pool()
        ticket = pool.start(A)
        pool.finish(A, True, 0.1, 0.0, ticket)
        pool.finish(A, True, 0.1, 0.0, ticket)
        assert pool.in_flight[A] == 0

    def test_events_are_reported_and_ejected_worker_skipped(self) -> None:
        events: list[tuple[str, HealthEvent]] = []
        pool = self.pool(on_event=lambda name, e: events.append((name, e)))
        for _ in range(3):
            pool.finish(B, False, 0.1, 0.0, pool.start(B))
        assert events == [("worker", HealthEvent("ejected", B, "consecutive_failures"))]
        assert B not in pool.candidates()
        assert all(pool.choose(f"k{i}").worker != B for i in range(50))  # type: ignore[union-attr]

    def test_latency_counts_the_requests_served_at_once(self) -> None:
        """A takes three times as long while it serves three requests: not an outlier."""
        events: list[tuple[str, HealthEvent]] = []
        pool = self.pool(on_event=lambda name, e: events.append((name, e)))
        for _ in range(8):
            for worker in (B, C):
                pool.finish(worker, True, 1.0, 0.0, pool.start(worker))
            tickets = [pool.start(A) for _ in range(3)]
            for ticket in tickets:
                pool.finish(A, True, 6.0, 0.0, ticket)
        assert events == [] and pool.is_in_service(A)
        assert [o.latency_s for o in pool.health.get(A).outcomes[:3]] == [2.0, 2.0, 2.0]

    @pytest.mark.parametrize(
        ("slow_on_cached", "ejected"),
        [(False, False), (True, True)],
        ids=["slower-on-whole-prompts-stays", "as-slow-on-cached-prompts-is-ejected"],
    )
    def test_latency_counts_the_prompt_tokens_each_worker_computes(
        self, slow_on_cached: bool, ejected: bool
    ) -> None:
        """A computes new shoppers' whole prompts while B and C answer returning shoppers
        from their caches: six times as long per request, not an outlier. The same worker
        as slow on cached prompts is one."""
        pool = self.pool()

        def round_trip(worker: str, key: str, size: int, seconds: float) -> None:
            pool.finish(worker, True, seconds, 0.0, pool.start(worker, key, size))

        for worker in (A, B, C):
            round_trip(worker, f"{worker}-home", 2000, 1.0)
        for i in range(8):
            for worker in (B, C):
                round_trip(worker, f"{worker}-home", 2000 + i, 1.0)
            key, size = (f"{A}-home", 2000 + i) if slow_on_cached else (f"new-{i}", 2000)
            round_trip(A, key, size, 6.0)
        assert pool.is_in_service(A) is not ejected

    def test_a_prefix_still_in_prefill_counts_as_work_for_the_next_request_of_its_key(
        self,
    ) -> None:
        """A hot shopper's second request, sent while its first is still in prefill on the
        same worker, computes the whole prompt there; once the first byte came, only the
        new tail."""
        pool = self.pool()
        first = pool.start(A, "hot", 2000)
        during = pool.start(A, "hot", 2050)
        pool.prefilled(A, first)
        pool.prefilled(A, during)
        after = pool.start(A, "hot", 2100)
        assert (first.own_work, during.own_work) == (work_units(2000), work_units(2050))
        assert after.own_work == work_units(2100 - 2050)

    def test_client_errors_do_not_count(self) -> None:
        pool = self.pool()
        for _ in range(5):
            pool.finish(A, None, 0.1, 0.0, pool.start(A))
        assert pool.is_in_service(A) and pool.health.get(A).outcomes == ()

    def test_duplicates_and_empty(self) -> None:
        assert RoutingState("p", [A, A, B], make_policy("round_robin")).workers == (A, B)
        with pytest.raises(ValueError):
            RoutingState("p", [], make_policy("round_robin"))


class TestRouterConfig:
    def test_aggregated_and_normalised_urls(self) -> None:
        cfg = RouterConfig(workers=(A + "/", A.replace("9001", "9002") + "/v1"))
        assert cfg.workers == (A, B) and cfg.mode == "aggregated"
        assert cfg.host == "127.0.0.1"

    def test_disaggregated(self) -> None:
        assert RouterConfig(prefill=(A,), decode=(B,)).mode == "disaggregated"

    @pytest.mark.parametrize(
        ("kw", "key"),
        [
            ({}, "workers"),
            ({"workers": (A,), "prefill": (B,), "decode": (C,)}, "workers"),
            ({"prefill": (A,)}, "workers"),
            ({"workers": ("127.0.0.1:9001",)}, "workers"),
            ({"workers": (A, A)}, "workers"),
            ({"workers": (A,), "policy": "random"}, "policy"),
            ({"workers": (A,), "load_factor": 0.5}, "load_factor"),
            ({"workers": (A,), "residency_factor": 0.9}, "residency_factor"),
            ({"workers": (A,), "port": 0}, "port"),
            ({"workers": (A,), "max_attempts": 0}, "max_attempts"),
        ],
    )
    def test_invalid(self, kw, key) -> None:
        with pytest.raises(ConfigError) as err:
            RouterConfig(**kw)
        assert err.value.key == key

    def test_key_headers_lowercased(self) -> None:
        assert RouterConfig(workers=(A,), key_headers=("X-User-ID",)).key_headers == ("x-user-id",)


class TestPdRewriting:
    BODY: ClassVar[dict[str, Any]] = {
        "model": "m",
        "messages": [],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
    }

    def test_prefill_body(self) -> None:
        out = pd.prefill_body(self.BODY)
        assert out["max_tokens"] == 1 and out["stream"] is False
        assert "stream_options" not in out and "min_tokens" not in out
        assert out["kv_transfer_params"] == pd.PREFILL_KV_TRANSFER_PARAMS
        assert self.BODY["max_tokens"] == 50  # the client's body is untouched
        assert "max_completion_tokens" not in out

    def test_prefill_params_are_a_copy(self) -> None:
        pd.prefill_body(self.BODY)["kv_transfer_params"]["remote_host"] = "x"
        assert pd.PREFILL_KV_TRANSFER_PARAMS["remote_host"] is None

    def test_decode_body(self) -> None:
        params = {"remote_engine_id": "e", "remote_block_ids": [1]}
        out = pd.decode_body(self.BODY, {"kv_transfer_params": params})
        assert out == {**self.BODY, "kv_transfer_params": params}

    def test_decode_body_without_params(self) -> None:
        body = {**self.BODY, "kv_transfer_params": {"stale": True}}
        assert "kv_transfer_params" not in pd.decode_body(body, {"kv_transfer_params": None})
        assert "kv_transfer_params" not in pd.decode_body(body, "not a dict")


class TestCli:
    def test_router_flags(self) -> None:
        args = cli.build_parser().parse_args(
            ["router", "--port", "9500", "--worker", A, B, "--worker", C, "--policy",
             "round_robin", "--load-factor", "1.5", "--residency-factor", "1.75",
             "--key-header", "X-User-ID"]
        )  # fmt: skip
        cfg = cli.router_config(args, workers=tuple(args.worker))
        assert cfg.workers == (A, B, C) and cfg.port == 9500 and cfg.host == "127.0.0.1"
        assert cfg.policy == "round_robin" and cfg.load_factor == 1.5
        assert cfg.residency_factor == 1.75
        assert cfg.key_headers == ("x-user-id",)

    def test_the_load_view_is_own_unless_chosen(self, monkeypatch) -> None:
        monkeypatch.delenv(LOAD_VIEW_ENV, raising=False)
        args = cli.build_parser().parse_args(["router", "--worker", A])
        cfg = cli.router_config(args, workers=tuple(args.worker))
        assert (cfg.load_view, cfg.load_poll_interval_s) == ("own", 0.5)

    def test_load_view_flags(self) -> None:
        args = cli.build_parser().parse_args(
            ["router", "--worker", A, "--load-view", "workers", "--load-poll-interval", "0.25"]
        )
        cfg = cli.router_config(args, workers=tuple(args.worker))
        assert (cfg.load_view, cfg.load_poll_interval_s) == ("workers", 0.25)

    def test_the_load_view_comes_from_the_environment_unless_flagged(self, monkeypatch) -> None:
        monkeypatch.setenv(LOAD_VIEW_ENV, "workers")
        args = cli.build_parser().parse_args(["router", "--worker", A])
        assert cli.router_config(args, workers=(A,)).load_view == "workers"
        flagged = cli.build_parser().parse_args(["router", "--worker", A, "--load-view", "own"])
        assert cli.router_config(flagged, workers=(A,)).load_view == "own"

    def test_a_load_view_from_the_environment_that_is_none_stops_the_router(
        self, monkeypatch, capsys
    ) -> None:
        monkeypatch.setenv(LOAD_VIEW_ENV, "shared")
        assert cli.main(["router", "--worker", A]) == 2
        err = capsys.readouterr().err
        assert "load_view: must be one of ('own', 'workers'), got 'shared'" in err

    def test_router_pd_flags(self) -> None:
        args = cli.build_parser().parse_args(["router", "--prefill", A, "--decode", B, C])
        cfg = cli.router_config(args, prefill=tuple(args.prefill), decode=tuple(args.decode))
        assert cfg.mode == "disaggregated" and cfg.decode == (B, C)

    def test_router_without_workers_is_a_clear_error(self, capsys) -> None:
        assert cli.main(["router", "--port", "9500"]) == 2
        assert "workers" in capsys.readouterr().err

    def test_cluster_flags_override_the_file(self, tmp_path) -> None:
        path = tmp_path / "c.toml"
        path.write_text('mode = "disaggregated"\nprefill = 2\nbase_port = 9000\n')
        args = cli.build_parser().parse_args(
            ["cluster", "--config", str(path), "--decode-workers", "3", "--base-port", "9100"]
        )
        cfg = cli.cluster_config(args)
        assert (cfg.mode, cfg.prefill, cfg.decode, cfg.base_port) == ("disaggregated", 2, 3, 9100)

    def test_cluster_flags_alone(self) -> None:
        args = cli.build_parser().parse_args(
            ["cluster", "--workers", "3", "--profile", "gpu", "--cores", "2,3"]
        )
        cfg = cli.cluster_config(args)
        assert cfg.workers == 3 and cfg.profile == "gpu" and cfg.mode == "aggregated"
        assert cfg.cores == (2, 3)
