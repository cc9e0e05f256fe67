"""A STAND-IN for the LLM: an OpenAI-compatible chat endpoint that answers at once.

Only for the pipeline-capacity benchmark, which measures the pipeline's own cost: it
replaces vLLM so that the model's seconds per prompt do not hide what Kafka, Flink,
the operators and Redis cost per event. It answers every ``POST /v1/chat/completions``
with the same valid intent (the bounded schema of ``flink_jobs/core/intents.py``) and counts
requests and prompt characters (``GET /stats``). Nothing else in the project may use it.

``python -m bench.standin_llm --port 8911`` runs it (uvicorn, one process, its own
core time, so its cost is visible apart from the job's).
"""

from __future__ import annotations

import argparse

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

STAND_IN_MODEL = "stand-in-model"
STAND_IN_ANSWER = {
    "intents": [{"label": "ready_to_buy", "confidence": 0.9, "category": "Running Shoes"}],
    "summary": "Compared running shoes, then added a pair to the cart",
}
_ANSWER_TEXT = orjson.dumps(STAND_IN_ANSWER).decode()


def completion_body(model: str, request_number: int, prompt_chars: int) -> bytes:
    """The chat completion the stand-in returns (usage counts ~4 characters a token)."""
    return orjson.dumps(
        {
            "id": f"stand-in-{request_number}",
            "object": "chat.completion",
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": _ANSWER_TEXT},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": max(1, prompt_chars // 4), "completion_tokens": 30},
        }
    )


class StandInCounters:
    def __init__(self) -> None:
        self.requests = 0
        self.prompt_chars = 0


def create_app() -> Starlette:
    counters = StandInCounters()

    async def chat(request: Request) -> Response:
        doc = orjson.loads(await request.body())
        chars = sum(len(m.get("content") or "") for m in doc.get("messages") or ())
        counters.requests += 1
        counters.prompt_chars += chars
        body = completion_body(doc.get("model", STAND_IN_MODEL), counters.requests, chars)
        return Response(body, media_type="application/json")

    async def stats(request: Request) -> Response:
        return Response(
            orjson.dumps({"requests": counters.requests, "prompt_chars": counters.prompt_chars}),
            media_type="application/json",
        )

    async def health(request: Request) -> Response:
        return Response(b"ok")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/stats", stats),
            Route("/health", health),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m bench.standin_llm", description=__doc__.split("\n")[0]
    )
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(
        create_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
