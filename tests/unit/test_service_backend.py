"""The service tier's backend is an explicit choice: local processes unless told docker; a
Docker engine that merely answers changes nothing (the compose tier runs one)."""

from __future__ import annotations

import pytest

from tests.conftest import choose_backend


def test_local_processes_by_default():
    assert choose_backend({}) == "local"


def test_an_engine_on_the_default_socket_changes_nothing():
    assert choose_backend({"DOCKER_HOST": "unix:///var/run/docker.sock"}) == "local"


def test_docker_when_asked():
    assert choose_backend({"SI_TEST_SERVICES": "docker"}) == "docker"


def test_an_unknown_backend_is_refused():
    with pytest.raises(pytest.UsageError):
        choose_backend({"SI_TEST_SERVICES": "kubernetes"})
