"""The one ``ConfigError`` and the one ``redact_url`` (``intent_reader.config_errors``), which
the job, the router and the reader share.

- **ConfigError** names the setting at fault (``key``) and says ``key: what is wrong``; the
  job raises it as it is, the router as one of its ``SidecarError`` family, and an
  ``except`` on the shared class catches both.
- **redact_url** hides all of a URL's userinfo and every ``password=`` query parameter,
  whatever characters the password holds, in URLs and in strings that are none.
"""

from __future__ import annotations

import pytest

import flink_jobs.config
import inference_sidecar.exceptions
from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import SidecarError
from intent_reader.config_errors import ConfigError, redact_url

# --- ConfigError --------------------------------------------------------------------------


class TestConfigError:
    def test_it_names_the_key_and_says_what_is_wrong(self) -> None:
        error = ConfigError("redis.url", "must start with redis://")

        assert error.key == "redis.url"
        assert str(error) == "redis.url: must start with redis://"

    def test_it_is_a_value_error(self) -> None:
        assert isinstance(ConfigError("k", "bad"), ValueError)

    def test_the_job_raises_the_shared_class_itself(self) -> None:
        assert flink_jobs.config.ConfigError is ConfigError
        with pytest.raises(ConfigError) as caught:
            flink_jobs.config.load_config(overrides={"job": {"max_parallelism": 0}}, environ={})
        assert caught.value.key == "job.max_parallelism"

    def test_the_routers_is_the_shared_class_in_the_routers_family(self) -> None:
        with pytest.raises(inference_sidecar.exceptions.ConfigError) as caught:
            RouterConfig(workers=())

        assert isinstance(caught.value, ConfigError)
        assert isinstance(caught.value, SidecarError)

    def test_an_except_on_the_shared_class_catches_the_routers(self) -> None:
        with pytest.raises(ConfigError, match=r"^workers: "):
            RouterConfig(workers=())


# --- redact_url ---------------------------------------------------------------------------

SECRET = "pw-7f3c9e"


class TestRedactUrl:
    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            (f"redis://:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
            (f"redis://user:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
            (f"http://ops:{SECRET}@127.0.0.1:9001", "http://***@127.0.0.1:9001"),
            (f"https://ops:{SECRET}@llm.internal/v1", "https://***@llm.internal/v1"),
        ],
    )
    def test_a_user_and_password_are_hidden_whole(self, url: str, shown: str) -> None:
        assert redact_url(url) == shown

    def test_a_lone_secret_as_userinfo_is_hidden(self) -> None:
        """Redis takes ``redis://secret@host`` as a password without a user name."""
        assert redact_url(f"redis://{SECRET}@h:6379") == "redis://***@h:6379"

    @pytest.mark.parametrize("password", ["p/w@x", "p?w", "p@w/x?y"])
    def test_a_password_with_unencoded_delimiters_is_hidden_whole(self, password: str) -> None:
        shown = redact_url(f"rediss://user:{password}@h:6380/0")

        assert shown == "rediss://***@h:6380/0"

    def test_the_rest_of_the_url_is_kept(self) -> None:
        url = f"rediss://user:{SECRET}@h:6380/0?ssl_ca_certs=/ca.pem"

        assert redact_url(url) == "rediss://***@h:6380/0?ssl_ca_certs=/ca.pem"

    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            (
                f"unix:///run/redis.sock?db=1&password={SECRET}",
                "unix:///run/redis.sock?db=1&password=***",
            ),
            (f"redis://h:6379/0?Password={SECRET}&db=2", "redis://h:6379/0?Password=***&db=2"),
            (f"redis://h:6379/0?password={SECRET}@x", "redis://h:6379/0?password=***"),
        ],
    )
    def test_a_password_query_parameter_is_hidden(self, url: str, shown: str) -> None:
        assert redact_url(url) == shown

    def test_a_password_in_both_places_is_hidden_in_both(self) -> None:
        url = f"redis://:{SECRET}@h:6379/0?password={SECRET}"

        assert redact_url(url) == "redis://***@h:6379/0?password=***"

    @pytest.mark.parametrize(
        "text",
        [
            f"ops:{SECRET}@127.0.0.1:9001",
            f"cannot reach redis://:{SECRET}@h:6379: refused",
            f"ftp://ops:{SECRET}@127.0.0.1:21",
        ],
    )
    def test_a_string_that_is_no_url_or_quotes_one_is_hidden_too(self, text: str) -> None:
        shown = redact_url(text)

        assert SECRET not in shown
        assert "***@" in shown

    @pytest.mark.parametrize(
        "url", ["redis://h:6379/0", "http://127.0.0.1:9001", "unix:///run/redis.sock", "plain"]
    )
    def test_a_url_without_secrets_is_unchanged(self, url: str) -> None:
        assert redact_url(url) == url
