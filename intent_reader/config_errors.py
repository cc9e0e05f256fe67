"""What every package says about a setting it cannot use, and how it shows a URL there.

One module for the job (``flink_jobs.config``), the router (``inference_sidecar``, whose
``ConfigError`` is this one as one of its own errors) and the reader: it ships wherever
any of them does (the wheel, the app image, the Managed Flink zip), and it needs nothing
but the standard library. ``docs/decisions.md#shared-config-errors`` says why it lives here.
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A setting is missing, unknown, malformed or out of range; ``key`` names it (a
    setting's name, or the file or variable the settings came from), and the message is
    ``key: what is wrong``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` as it may be shown (errors, logs, ``/health``, metric labels): all of its
    userinfo (``user:password@``, or a lone ``secret@``, which Redis takes as a password)
    and every ``password=`` query parameter (redis-py reads one) become ``***``.

    The userinfo ends at the last ``@``, so a password with an unencoded ``/``, ``?`` or
    ``@`` is hidden whole (an ``@`` in a later part of the URL hides more than needed,
    never less). Strings that are no URL go through the same way: error messages that
    quote one pass through here too."""
    masked = _PASSWORD_PARAM.sub(r"\1***", url)
    scheme, sep, rest = masked.partition("://")
    if not sep:
        scheme, rest = "", masked
    if "@" not in rest:
        return masked
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"
