"""The distribution installs as a wheel, not only from the source tree.

A non-editable wheel, built from the checkout and installed into a clean venv, carries the
schemas, templates and sample as package data: the CLI answers ``--help``, a prompt is
rendered from the packaged template and an event is validated against the packaged schema,
all from outside the checkout. The reader's extra resolves without PyFlink.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from flink_jobs.config import PromptConfig

REPO = Path(__file__).resolve().parents[2]
#: What the three checks import, installed beside the wheel (the ``job`` extra would also
#: bring PyFlink, ~860 MB, which none of them needs).
#: tokenizers counts the prompt budget with the packaged tokenizer (prompt.tokenizer_path=auto).
RUNTIME_NEEDS = (
    "redis",
    "orjson",
    "jinja2",
    "fastjsonschema",
    "httpx",
    "prometheus-client",
    "tokenizers",
)

pytestmark = pytest.mark.timeout(600)


def _run(argv: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{argv[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out)]
    _run([*pip_wheel, str(REPO)], out)
    (built,) = out.glob("shopper_intents-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv (no system site-packages) with the wheel and what the checks import."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", str(wheel)], env_dir)
    _run([*pip, *RUNTIME_NEEDS], env_dir)
    return python


def test_the_wheel_carries_its_data_and_license(wheel: Path):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "flink_jobs/schemas/shopper_event.schema.json",
        "flink_jobs/schemas/shopper_intent.schema.json",
        "flink_jobs/prompts/shopper_intent_v1.j2",
        "flink_jobs/sample/sample_sessions.jsonl",
        "flink_jobs/prompts/tokenizer/SmolLM2-135M-Instruct/tokenizer.json",
    ):
        assert data in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "deploy/")) for n in names)


def test_the_wheel_carries_every_python_package_of_the_checkout(wheel: Path):
    import zipfile

    shipped = {
        str(Path(n).parent) for n in zipfile.ZipFile(wheel).namelist() if n.endswith("__init__.py")
    }
    in_checkout = {
        str(init.parent.relative_to(REPO))
        for root in ("flink_jobs", "inference_sidecar", "intent_reader")
        for init in (REPO / root).rglob("__init__.py")
    }
    assert in_checkout - shipped == set()


def test_the_installed_cli_answers_help(installed: Path, tmp_path: Path):
    done = _run([str(installed.parent / "shopper-intents"), "--help"], tmp_path)
    assert "demo" in done.stdout and "run" in done.stdout


def test_the_installed_package_renders_a_prompt_and_validates_an_event(
    installed: Path, tmp_path: Path
):
    """Run from a folder outside the checkout: everything comes from site-packages."""
    sample = REPO / "data" / "sample_sessions.jsonl"
    raw = next(line for line in sample.read_bytes().splitlines() if b'"view"' in line)
    code = f"""
import json, sys, flink_jobs
from flink_jobs.config import load_config
from flink_jobs.core.events import ShopperEvent, decode_event, parse_event_time
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.session import apply_event, new_session_state

config = load_config(environ={{}})
raw = {raw!r}
now_ms = parse_event_time(json.loads(raw)["event_time"])
event = decode_event(raw, None, now_ms=now_ms, max_bytes=config.job.max_event_bytes)
assert isinstance(event, ShopperEvent), event
state, _ = apply_event(
    new_session_state(event.shopper_id), event, config.session, config.trigger.high_signal_types
)
prompt = PromptRenderer(config.prompt).render(state)
print(json.dumps({{"package": flink_jobs.__file__, "messages": len(prompt.messages),
                  "template": prompt.template}}))
"""
    done = _run([str(installed), "-c", code], tmp_path)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).is_relative_to(installed.parent.parent / "lib")
    assert result["messages"] >= 2 and result["template"] == PromptConfig().template


def test_the_reader_extra_does_not_pull_in_pyflink(tmp_path: Path):
    report = tmp_path / "report.json"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--disable-pip-version-check",
            "-q",
            "--report",
            str(report),
            f"{REPO}[reader]",
        ],
        tmp_path,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "redis" in names and "shopper-intents" in names
    assert not names & {"apache-flink", "apache-beam", "pandas", "pyarrow", "httpx", "jinja2"}
