"""Which images a compose stack needs and where each comes from: the project's builds, the
base images their Dockerfiles start FROM, and the images services pull (a local stand-in
under the same name where no registry answers)."""

from __future__ import annotations

from pathlib import Path

from deploy.compose_images import STANDINS, dockerfile_bases, pip_options, plan, repository

REPO = Path(__file__).resolve().parents[2]


def test_bases_resolve_arg_defaults_and_skip_own_stages():
    text = (
        "ARG FLINK_IMAGE=flink:2.2.1-scala_2.12-java17\n"
        "FROM ${FLINK_IMAGE} AS flink-python\n"
        "FROM flink-python AS build\n"
        "FROM flink-python\n"
    )
    assert dockerfile_bases(text) == ["flink:2.2.1-scala_2.12-java17"]


def test_a_build_argument_overrides_the_default():
    text = "ARG BASE=a:1\nFROM $BASE\n"
    assert dockerfile_bases(text, {"BASE": "b:2"}) == ["b:2"]


def test_repository_keeps_a_registry_port():
    assert repository("prom/prometheus:v3.5.0") == "prom/prometheus"
    assert repository("localhost:5000/x") == "localhost:5000/x"


def _config() -> dict:
    return {
        "name": "p",
        "services": {
            "jobmanager": {
                "image": "shopper-intents:0.1.0",
                "build": {"context": str(REPO), "dockerfile": "Dockerfile.flink"},
            },
            "kafka-init": {"image": "shopper-intents:0.1.0"},
            "model": {
                "image": "shopper-intents-model:0.1.0",
                "build": {"context": str(REPO), "dockerfile": "Dockerfile.model"},
            },
            "redis": {"image": "redis:7.2.5"},
            "grafana": {"image": "grafana/grafana:12.1.1"},
        },
    }


def test_the_stack_of_the_shipped_dockerfiles():
    decided = plan(_config())
    assert decided.wanted == (
        "flink:2.2.1-scala_2.12-java17",
        "vllm/vllm-openai-cpu:v0.32.0-x86_64",
        "grafana/grafana:12.1.1",
        "redis:7.2.5",
    )
    assert [b.image for b in decided.builds] == [
        "shopper-intents:0.1.0",
        "shopper-intents-model:0.1.0",
    ]
    assert [b.wheels for b in decided.builds] == ["app", "model"]


def test_an_image_another_service_builds_is_not_pulled():
    assert "shopper-intents:0.1.0" not in plan(_config()).wanted


def test_images_without_a_stand_in_are_named():
    assert plan(_config()).missing_standins == ("grafana/grafana:12.1.1",)


def test_every_stand_in_has_a_dockerfile():
    for folder in STANDINS.values():
        assert (REPO / "deploy" / "compose" / "standins" / folder / "Dockerfile").is_file()


def test_builds_read_wheels_only_from_the_loopback():
    options = pip_options("app", 39173)
    assert "--no-index" in options and "http://127.0.0.1:39173/app/" in options
