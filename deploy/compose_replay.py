"""The replay tool with its Kafka credentials from the environment, never the command line.

    SI_REPLAY_CLIENT_PROPERTIES='{"sasl.password": "..."}' \\
        python -m deploy.compose_replay replay data/sample_sessions.jsonl --bootstrap kafka:9092

Takes the arguments of ``python -m flink_jobs.tools.replay`` and adds, as its ``-X`` client
properties, the librdkafka properties of the JSON object in ``SI_REPLAY_CLIENT_PROPERTIES``.
They reach the tool inside this process: a password in ``argv`` would show in ``ps``, in
``docker top`` and in the container's recorded command, while the environment is readable
only by the container's own user and its inspectors.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

PROPERTIES_ENV = "SI_REPLAY_CLIENT_PROPERTIES"


class PropertiesError(ValueError):
    """``SI_REPLAY_CLIENT_PROPERTIES`` is not a JSON object of strings (the message never
    repeats its text: it holds a password)."""


def client_properties(environ: Mapping[str, str]) -> dict[str, str]:
    """The librdkafka properties the environment holds (none when the variable is unset)."""
    text = environ.get(PROPERTIES_ENV, "").strip()
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PropertiesError(
            f"{PROPERTIES_ENV} is not valid JSON (line {exc.lineno}, column {exc.colno}); "
            'expected an object such as {"sasl.username": "app", "sasl.password": "..."}'
        ) from None
    if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
        raise PropertiesError(f"{PROPERTIES_ENV} must be a JSON object of string values")
    return {str(k): v for k, v in parsed.items()}


def with_client_properties(argv: Sequence[str], properties: Mapping[str, str]) -> list[str]:
    """``argv`` with a ``-X KEY=VALUE`` per property right after the subcommand (``replay``
    or ``record``), where the tool's parser takes them."""
    argv = list(argv)
    command = next((i for i, a in enumerate(argv) if a in ("replay", "record")), None)
    if command is None or not properties:
        return argv
    flags = [item for k, v in properties.items() for item in ("-X", f"{k}={v}")]
    return [*argv[: command + 1], *flags, *argv[command + 1 :]]


def main(argv: Sequence[str] | None = None) -> int:
    from flink_jobs.tools import replay

    args = sys.argv[1:] if argv is None else list(argv)
    try:
        properties = client_properties(os.environ)
    except PropertiesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return replay.main(with_client_properties(args, properties))


if __name__ == "__main__":
    sys.exit(main())
