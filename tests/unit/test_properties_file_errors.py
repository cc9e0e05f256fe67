"""A malformed Managed Flink properties file is reported by the entry's position and keys,
never its values: the file holds passwords."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flink_jobs.config import ConfigError, read_property_groups

PASSWORD = "hunter2-redis-pw"
REDIS_GROUP = {"PropertyGroupId": "redis", "PropertyMap": {"url": "redis://127.0.0.1:6379/0"}}


def error_for(tmp_path: Path, entries: list[object]) -> str:
    path = tmp_path / "application_properties.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ConfigError) as err:
        read_property_groups(path)
    return str(err.value)


def test_an_entry_without_a_group_id_is_named_by_position_and_keys(tmp_path: Path) -> None:
    entry = {"PropertyMap": {"password": PASSWORD, "url": f"redis://:{PASSWORD}@10.0.0.5"}}
    message = error_for(tmp_path, [REDIS_GROUP, entry])
    assert "entry 2" in message and "PropertyGroupId" in message
    assert "PropertyMap" in message
    assert PASSWORD not in message


def test_an_entry_that_is_not_an_object_is_named_by_position_and_type(tmp_path: Path) -> None:
    message = error_for(tmp_path, [f"redis.password={PASSWORD}", REDIS_GROUP])
    assert "entry 1" in message and "str" in message
    assert PASSWORD not in message
