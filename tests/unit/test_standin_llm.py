"""The LLM stand-in (``bench/standin_llm.py``) that the service tests run in place of vLLM:
its answers follow the request's schema and its prompt, its faults come when asked."""

from __future__ import annotations

import asyncio
import random

import fastjsonschema
import httpx
import orjson
import pytest

from bench.standin_llm import Latency, Settings, UnsupportedSchema, create_app, instance
from flink_jobs.core.intents import Intent, intent_response_format, parse_intent

CATEGORY_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["Headphones", "Earbuds", "Speakers"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "note": {"type": "string", "minLength": 3, "maxLength": 12, "pattern": "^[a-z0-9 -]+$"},
    },
    "required": ["category", "score"],
    "additionalProperties": False,
}


class StandIn:
    """The stand-in's app, called in process (``httpx.ASGITransport``)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.app = create_app(settings or Settings())

    def post(self, path: str, json: dict) -> httpx.Response:
        return asyncio.run(self._call("POST", path, json))

    def get(self, path: str) -> httpx.Response:
        return asyncio.run(self._call("GET", path))

    async def _call(self, method: str, path: str, json: dict | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://standin") as c:
            return await c.request(method, path, json=json)


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Name the intent."}, {"role": "user", "content": text}]


def chat(client: StandIn, text: str, response_format: dict | None = None):
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages(text)}
    if response_format is not None:
        body["response_format"] = response_format
    return client.post("/v1/chat/completions", json=body)


def content(reply) -> object:
    assert reply.status_code == 200, reply.text
    return orjson.loads(reply.json()["choices"][0]["message"]["content"])


@pytest.fixture
def client() -> StandIn:
    return StandIn()


def test_the_answer_is_a_valid_intent_under_the_jobs_response_format(client):
    reply = chat(client, "viewed over-ear headphones twice", intent_response_format())

    assert isinstance(parse_intent(reply.json()["choices"][0]["message"]["content"]), Intent)


def test_an_enum_in_the_schema_is_answered_with_one_of_its_values(client):
    validate = fastjsonschema.compile(CATEGORY_SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": CATEGORY_SCHEMA}}
    answers = [content(chat(client, f"shopper {i} looked at audio", fmt)) for i in range(30)]

    for answer in answers:
        validate(answer)
    assert {a["category"] for a in answers} == {"Headphones", "Earbuds", "Speakers"}


def test_the_same_prompt_gets_the_same_answer_and_another_prompt_another(client):
    fmt = intent_response_format()
    first = content(chat(client, "added trail shoes to the cart", fmt))
    again = content(chat(client, "added trail shoes to the cart", fmt))
    others = [content(chat(client, f"searched for gift {i}", fmt)) for i in range(5)]

    assert first == again
    assert any(other != first for other in others)


def test_without_a_response_format_it_answers_the_jobs_intent(client):
    reply = chat(client, "compared two blenders")

    assert isinstance(parse_intent(reply.json()["choices"][0]["message"]["content"]), Intent)


def test_a_schema_it_cannot_satisfy_gets_a_400_naming_the_part(client):
    fmt = {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/x"}}}
    reply = chat(client, "anything", fmt)

    assert reply.status_code == 400 and "$ref" in reply.json()["error"]["message"]


def test_injected_faults_take_exactly_the_next_requests(client):
    assert client.post("/admin/inject", json={"fault": "5xx", "count": 2}).status_code == 200
    client.post("/admin/inject", json={"fault": "invalid_json", "count": 1})

    statuses = [chat(client, f"prompt {i}") for i in range(4)]

    assert [r.status_code for r in statuses] == [503, 503, 200, 200]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(statuses[2].content)
    content(statuses[3])
    assert client.get("/stats").json()["faults"] == {"5xx": 2, "invalid_json": 1, "hang": 0}


def test_failure_shares_are_drawn_from_the_seed():
    def faults(seed: int) -> list[int]:
        client = StandIn(Settings(seed=seed, fail_5xx=0.3))
        return [chat(client, f"prompt {i}").status_code for i in range(40)]

    assert faults(7) == faults(7)
    assert 3 <= faults(7).count(503) <= 20


def test_runtime_settings_are_checked_and_reported(client):
    assert client.post("/admin/config", json={"fail_5xx": 1.5}).status_code == 400
    assert client.post("/admin/config", json={"latency": "soon"}).status_code == 400
    reply = client.post("/admin/config", json={"latency": "uniform:0.1,0.2", "fail_hang": 0.1})

    assert reply.json()["latency"] == "uniform:0.1,0.2" and reply.json()["fail_hang"] == 0.1


@pytest.mark.parametrize(
    ("text", "low", "high"),
    [("0.25", 0.25, 0.25), ("uniform:0.1,0.3", 0.1, 0.3), ("exp:0.2", 0.0, 5.0)],
)
def test_latencies_stay_in_their_distribution(text, low, high):
    latency, rng = Latency.parse(text), random.Random(3)
    draws = [latency.draw(rng) for _ in range(200)]

    assert all(low <= d <= high for d in draws)


def test_an_unsupported_schema_part_is_named():
    with pytest.raises(UnsupportedSchema, match=r"\$\.a: type 'tuple'"):
        instance({"type": "object", "properties": {"a": {"type": "tuple"}}}, random.Random(0))
