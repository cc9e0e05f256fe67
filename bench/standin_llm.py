"""A STAND-IN for the LLM: an OpenAI-compatible chat endpoint with no model behind it.

For runs whose subject is not the model: the pipeline-capacity benchmark (so the model's
seconds per prompt do not hide what Kafka, Flink, the operators and Redis cost per event)
and the service tests of the stream (Flink semantics, Kafka and Redis faults, overload,
checkpoints). Whatever touches the model itself (routing on prefix caches, guided
decoding, disaggregation, the end-to-end run) runs on real vLLM workers instead.

Each ``POST /v1/chat/completions`` gets, after a latency (fixed seconds, or drawn from a
seeded distribution: ``0.5``, ``uniform:0.2,1.5``, ``exp:0.8``):

* an answer that is valid against the request's ``response_format`` JSON Schema (the
  job's intent schema when none is sent), derived from a hash of the messages, so the
  same prompt always gets the same answer and an ``enum`` always yields one of its values;
  a schema it cannot satisfy gets a 400 saying which part;
* or a fault, for a seeded share of requests or for the next ``count`` of them: ``5xx``
  (a 503 with an OpenAI-style error), ``invalid_json`` (a 200 whose body is cut-off
  JSON), ``hang`` (no answer until the client gives up).

Control: flags at start (``--latency``, ``--seed``, ``--fail-5xx``, ``--fail-invalid-json``,
``--fail-hang``); at runtime ``POST /admin/config`` with the same settings as JSON
(``latency``, ``seed``, ``fail_5xx``, ``fail_invalid_json``, ``fail_hang``),
``POST /admin/inject`` ``{"fault": "5xx", "count": 3}`` (count 0 clears it) and
``GET /admin/config``. ``GET /stats`` counts requests, prompt characters, answers and each
fault; ``GET /v1/models`` and ``GET /health`` answer as a worker's do.

``python -m bench.standin_llm --port 8911`` runs it (uvicorn, one process, its own core
time, so its cost shows apart from the job's).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from intent_reader.layout import INTENT_LABELS

STAND_IN_MODEL = "stand-in-model"
FAULTS = ("5xx", "invalid_json", "hang")
CUT_OFF_BODY = b'{"id": "stand-in-cut", "choices": [{"ind'
HANG_POLL_S = 0.2
# What the job asks for when it sends no response_format (llm.guided_json off): its intent
# schema, its labels those the read side knows (a unit test keeps them the schema's).
INTENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["intents", "summary"],
    "properties": {
        "intents": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "required": ["label", "confidence"],
                "properties": {
                    "label": {"enum": list(INTENT_LABELS)},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                    "category": {"type": "string", "maxLength": 40},
                },
            },
        },
        "summary": {"type": "string", "minLength": 1, "maxLength": 120},
    },
}
_WORDS = ("stand", "in", "answer", "shopper", "looked", "at", "items", "and", "more")


# --- answers valid against a JSON Schema -----------------------------------------------------


class UnsupportedSchema(ValueError):
    """The stand-in cannot make an instance of this schema (it says which part)."""


def instance(schema: Any, rng: random.Random, path: str = "$") -> Any:
    """A value valid against ``schema``, drawn with ``rng``: enums, consts, objects (every
    listed property), arrays, strings (length, pattern), numbers and integers (bounds),
    booleans, null; ``anyOf``/``oneOf`` take their first branch."""
    if schema is True or schema == {}:
        return "stand-in"
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{path}: not a schema object")
    if "enum" in schema:
        if not schema["enum"]:
            raise UnsupportedSchema(f"{path}: empty enum")
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    for combinator in ("anyOf", "oneOf"):
        if schema.get(combinator):
            return instance(schema[combinator][0], rng, f"{path}.{combinator}[0]")
    for unsupported in ("$ref", "allOf", "not", "if", "uniqueItems", "patternProperties"):
        if schema.get(unsupported):
            raise UnsupportedSchema(f"{path}: {unsupported} is not supported")
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    make = _MAKERS.get(kind)
    if make is None:
        raise UnsupportedSchema(f"{path}: type {kind!r} is not supported")
    return make(schema, rng, path)


def _object(schema: dict, rng: random.Random, path: str) -> dict:
    properties = schema.get("properties", {})
    missing = [name for name in schema.get("required", ()) if name not in properties]
    if missing:
        raise UnsupportedSchema(f"{path}: required {missing} without a schema")
    return {name: instance(sub, rng, f"{path}.{name}") for name, sub in properties.items()}


def _array(schema: dict, rng: random.Random, path: str) -> list:
    low = schema.get("minItems", 1)
    high = max(low, schema.get("maxItems", low + 2))
    items = schema.get("items", {})
    return [instance(items, rng, f"{path}[{i}]") for i in range(rng.randint(low, high))]


def _string(schema: dict, rng: random.Random, path: str) -> str:
    low, high = schema.get("minLength", 0), schema.get("maxLength", 60)
    if low > high:
        raise UnsupportedSchema(f"{path}: minLength above maxLength")
    words = " ".join(
        ["stand-in", *(rng.choice(_WORDS) for _ in range(12)), f"{rng.getrandbits(32):08x}"]
    )
    size = rng.randint(min(max(low, 8), high), high)
    text = ((words + " ") * (1 + size // len(words)))[:size]
    pattern = schema.get("pattern")
    if pattern is not None and re.search(pattern, text) is None:
        raise UnsupportedSchema(f"{path}: no text of letters, digits and spaces fits {pattern}")
    return text


def _bounds(schema: dict, default_span: float) -> tuple[float, float, bool, bool]:
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    open_low = open_high = False
    if isinstance(ex_low, (int, float)) and not isinstance(ex_low, bool):
        low, open_low = ex_low, True
    if isinstance(ex_high, (int, float)) and not isinstance(ex_high, bool):
        high, open_high = ex_high, True
    if low is None:
        low = (high - default_span) if high is not None else 0
    if high is None:
        high = low + default_span
    return low, high, open_low, open_high


def _number(schema: dict, rng: random.Random, path: str) -> float:
    low, high, open_low, open_high = _bounds(schema, 1.0)
    value = round(low + (high - low) * (0.05 + 0.9 * rng.random()), 3)
    if value < low or value > high or (open_low and value == low) or (open_high and value == high):
        raise UnsupportedSchema(f"{path}: no number fits [{low}, {high}]")
    return value


def _integer(schema: dict, rng: random.Random, path: str) -> int:
    low, high, open_low, open_high = _bounds(schema, 100)
    first = int(low) + 1 if open_low or low != int(low) else int(low)
    last = int(high) - 1 if open_high and high == int(high) else int(high)
    if first > last:
        raise UnsupportedSchema(f"{path}: no integer fits [{low}, {high}]")
    return rng.randint(first, last)


_MAKERS = {
    "object": _object,
    "array": _array,
    "string": _string,
    "number": _number,
    "integer": _integer,
    "boolean": lambda schema, rng, path: rng.random() < 0.5,
    "null": lambda schema, rng, path: None,
}


@lru_cache(maxsize=1024)
def answer_text(messages_json: bytes, schema_json: bytes) -> str:
    """The answer to these messages under this schema: the same prompt, the same answer."""
    seed = int.from_bytes(hashlib.sha256(messages_json).digest()[:8], "big")
    schema = orjson.loads(schema_json) if schema_json else INTENT_SCHEMA
    return orjson.dumps(instance(schema, random.Random(seed))).decode()


def requested_schema(doc: dict) -> Any:
    """The JSON Schema of the request's ``response_format``, or ``None``."""
    response_format = doc.get("response_format")
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    return (response_format.get("json_schema") or {}).get("schema")


def completion_body(model: str, request_number: int, prompt_chars: int, content: str) -> bytes:
    """The chat completion the stand-in returns (usage counts ~4 characters a token)."""
    return orjson.dumps(
        {
            "id": f"stand-in-{request_number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "stand-in",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": max(1, prompt_chars // 4),
                "completion_tokens": max(1, len(content) // 4),
                "total_tokens": max(1, prompt_chars // 4) + max(1, len(content) // 4),
            },
        }
    )


# --- latency and faults --------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """``"0.5"`` (fixed seconds), ``"uniform:LOW,HIGH"`` or ``"exp:MEAN"``."""

    kind: str
    low: float
    high: float = 0.0

    @classmethod
    def parse(cls, text: str | float) -> Latency:
        text = str(text).strip()
        kind, _, args = text.partition(":")
        try:
            if not args:
                seconds = float(kind)
                latency = cls("fixed", seconds, seconds)
            elif kind == "uniform":
                low, high = (float(x) for x in args.split(","))
                latency = cls("uniform", low, high)
            elif kind == "exp":
                latency = cls("exp", float(args))
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(
                f"latency must be SECONDS, uniform:LOW,HIGH or exp:MEAN (got {text!r})"
            ) from None
        if (
            latency.low < 0
            or latency.high < 0
            or (kind == "uniform" and latency.high < latency.low)
        ):
            raise ValueError(f"latency must not be negative (got {text!r})")
        return latency

    def draw(self, rng: random.Random) -> float:
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        if self.kind == "exp":
            return rng.expovariate(1 / self.low) if self.low > 0 else 0.0
        return self.low

    def __str__(self) -> str:
        if self.kind == "uniform":
            return f"uniform:{self.low},{self.high}"
        if self.kind == "exp":
            return f"exp:{self.low}"
        return f"{self.low}"


@dataclass
class Settings:
    """What the stand-in does; changed at start (flags) or at runtime (``/admin``)."""

    latency: Latency = field(default_factory=lambda: Latency.parse(0))
    seed: int = 0
    fail_5xx: float = 0.0
    fail_invalid_json: float = 0.0
    fail_hang: float = 0.0
    injected: dict[str, int] = field(default_factory=dict)  # fault -> next requests it takes
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        self.check()
        self.rng.seed(self.seed)

    def _shares(self) -> tuple[float, float, float]:
        return (self.fail_5xx, self.fail_invalid_json, self.fail_hang)

    def check(self) -> None:
        shares = self._shares()
        if any(not 0 <= s <= 1 for s in shares) or sum(shares) > 1:
            raise ValueError(f"failure shares must be in [0, 1] and sum to at most 1: {shares}")

    def update(self, changes: dict[str, Any]) -> None:
        unknown = set(changes) - {"latency", "seed", "fail_5xx", "fail_invalid_json", "fail_hang"}
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}")
        before = (self.latency, self.fail_5xx, self.fail_invalid_json, self.fail_hang)
        try:
            if "latency" in changes:
                self.latency = Latency.parse(changes["latency"])
            for name in ("fail_5xx", "fail_invalid_json", "fail_hang"):
                if name in changes:
                    setattr(self, name, float(changes[name]))
            self.check()
        except (TypeError, ValueError):
            self.latency, self.fail_5xx, self.fail_invalid_json, self.fail_hang = before
            raise
        if "seed" in changes:
            self.seed = int(changes["seed"])
            self.rng.seed(self.seed)

    def inject(self, fault: str, count: int) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS} (got {fault!r})")
        if count < 0:
            raise ValueError("count must not be negative")
        self.injected[fault] = count

    def next_fault(self) -> str | None:
        """The fault this request gets: an injected one first, then by the shares."""
        for fault in FAULTS:
            if self.injected.get(fault, 0) > 0:
                self.injected[fault] -= 1
                return fault
        draw = self.rng.random()
        for fault, share in zip(FAULTS, self._shares(), strict=True):
            if draw < share:
                return fault
            draw -= share
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "latency": str(self.latency),
            "seed": self.seed,
            "fail_5xx": self.fail_5xx,
            "fail_invalid_json": self.fail_invalid_json,
            "fail_hang": self.fail_hang,
            "injected": {k: v for k, v in self.injected.items() if v},
        }


@dataclass
class StandInCounters:
    requests: int = 0
    prompt_chars: int = 0
    answered: int = 0
    unsupported_schema: int = 0
    in_flight: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_chars": self.prompt_chars,
            "answered": self.answered,
            "unsupported_schema": self.unsupported_schema,
            "in_flight": self.in_flight,
            "faults": dict(self.faults),
        }


# --- the app -------------------------------------------------------------------------------


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status, media_type="application/json")


def _error(message: str, status: int, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind, "code": status}}, status)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    counters = StandInCounters()

    async def chat(request: Request) -> Response:
        try:
            doc = orjson.loads(await request.body())
            messages = doc["messages"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return _error("the body must be JSON with messages", 400, "invalid_request_error")
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict))
        counters.requests += 1
        counters.prompt_chars += chars
        number = counters.requests
        fault = settings.next_fault()
        delay = settings.latency.draw(settings.rng)
        counters.in_flight += 1
        try:
            if fault == "hang":
                counters.faults["hang"] += 1
                while not await request.is_disconnected():
                    await asyncio.sleep(HANG_POLL_S)
                return Response(b"", 499)
            if delay > 0:
                await asyncio.sleep(delay)
            if fault == "5xx":
                counters.faults["5xx"] += 1
                return _error("stand-in: injected fault", 503, "server_error")
            if fault == "invalid_json":
                counters.faults["invalid_json"] += 1
                return Response(CUT_OFF_BODY, 200, media_type="application/json")
            schema = requested_schema(doc)
            try:
                content = answer_text(
                    orjson.dumps(messages), orjson.dumps(schema) if schema is not None else b""
                )
            except UnsupportedSchema as exc:
                counters.unsupported_schema += 1
                return _error(f"stand-in: {exc}", 400, "invalid_request_error")
            counters.answered += 1
            model = doc.get("model") or STAND_IN_MODEL
            return Response(
                completion_body(model, number, chars, content), media_type="application/json"
            )
        finally:
            counters.in_flight -= 1

    async def stats(request: Request) -> Response:
        return _json(counters.as_dict())

    async def admin_config(request: Request) -> Response:
        if request.method == "POST":
            try:
                settings.update(orjson.loads(await request.body()))
            except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
                return _error(str(exc), 400, "invalid_request_error")
        return _json(settings.describe())

    async def admin_inject(request: Request) -> Response:
        try:
            doc = orjson.loads(await request.body())
            settings.inject(str(doc["fault"]), int(doc.get("count", 1)))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return _error(f"expected {{'fault': one of {FAULTS}, 'count': N}}: {exc}", 400,
                          "invalid_request_error")  # fmt: skip
        return _json(settings.describe())

    async def models(request: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [{"id": STAND_IN_MODEL, "object": "model", "owned_by": "stand-in"}],
            }
        )

    async def health(request: Request) -> Response:
        return Response(b"ok")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/stats", stats),
            Route("/health", health),
            Route("/admin/config", admin_config, methods=["GET", "POST"]),
            Route("/admin/inject", admin_inject, methods=["POST"]),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.standin_llm", description=__doc__.split("\n")[0]
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--latency", default="0", help="SECONDS, uniform:LOW,HIGH or exp:MEAN")
    p.add_argument("--seed", type=int, default=0, help="seeds the latency and failure draws")
    p.add_argument("--fail-5xx", type=float, default=0.0, help="share of requests answered 503")
    p.add_argument(
        "--fail-invalid-json", type=float, default=0.0, help="share answered with cut-off JSON"
    )
    p.add_argument("--fail-hang", type=float, default=0.0, help="share never answered")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        latency=Latency.parse(args.latency),
        seed=args.seed,
        fail_5xx=args.fail_5xx,
        fail_invalid_json=args.fail_invalid_json,
        fail_hang=args.fail_hang,
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(
        create_app(settings_from(args)),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
