"""The secrets the security tests configure, and the check that none of them leaked: into
an exception (with its whole cause and context chain), a dead letter or a log record."""

from __future__ import annotations

REDIS_PASSWORD = "Rp-7f3c9e-s3cret"
WRONG_PASSWORD = "Wp-41d0aa-notit"
API_KEY = "sk-si-test-9b2e77c1"
JAAS_PASSWORD = "jaas-pw-5e81d2"
SECRETS = (REDIS_PASSWORD, WRONG_PASSWORD, API_KEY, JAAS_PASSWORD)


def assert_no_secret(*texts: object) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in str(text), f"a secret leaked into: {text!r}"


def exception_chain(exc: BaseException) -> list[str]:
    """Every message in the exception's cause/context chain (what a traceback would show)."""
    out: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        out += [repr(current), str(current), *map(str, current.args)]
        current = current.__cause__ or current.__context__
    return out
