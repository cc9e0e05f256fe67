"""A LoRA adapter trained on hindsight examples, served by the real vLLM.

A few training steps on the bundled sample's train split (``distill train``'s worker, in
the vLLM venv, bounded at two minutes): the validation loss falls; then one vLLM worker
serves the adapter as a LoRA module behind the router, and the job's own call path
(``inference.ask``) gets schema-valid answers to the compact prompts of test-split
shoppers, their categories from the session's, their confidences the model's label
probabilities.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import orjson
import pytest

from flink_jobs.config import load_config
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.core.grounding import category_is_grounded
from flink_jobs.core.trigger import END_OF_TIME_MS
from flink_jobs.runtime.inference import Answered
from flink_jobs.tools.distill.dataset import build_examples, write_examples
from flink_jobs.tools.distill.hindsight import CONFIDENCES
from flink_jobs.tools.embedded_stack import ServedModel, start_llm_tier
from flink_jobs.tools.eval_runner import select_records
from inference_sidecar.workers import find_model_dir, find_vllm_python
from tests.support.builders import prompt_task
from tests.support.llm_call import ask_all

pytestmark = [pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "si-test-lora"
#: The bound the issue sets on a few training steps in the model tier.
TRAIN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    values = select_records(REPO / "data" / "sample_sessions.jsonl", 60)
    decoded = (
        decode_event(v, None, now_ms=END_OF_TIME_MS - 1, max_bytes=len(v) + 1) for v in values
    )
    examples = build_examples("sample", [e for e in decoded if isinstance(e, ShopperEvent)])
    path = tmp_path_factory.mktemp("distill") / "examples.jsonl"
    write_examples(path, examples)
    return path, examples


@pytest.fixture(scope="module")
def adapter(examples_file, tmp_path_factory: pytest.TempPathFactory) -> Path:
    data, _ = examples_file
    out = tmp_path_factory.mktemp("adapter") / ADAPTER
    argv = [
        str(find_vllm_python()),
        "-m",
        "flink_jobs.tools.distill.train_worker",
        "--data",
        str(data),
        "--base-model",
        str(find_model_dir()),
        "--out",
        str(out),
        "--work",
        str(out.parent / "work"),
        "--max-steps",
        "6",
        "--eval-every",
        "2",
        "--batch-size",
        "4",
        "--val-examples",
        "8",
        "--seed",
        "3",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    subprocess.run(argv, env=env, check=True, timeout=TRAIN_TIMEOUT_S)
    return out


def test_a_few_steps_lower_the_validation_loss_and_write_a_bf16_adapter(adapter):
    training = orjson.loads((adapter / "training.json").read_bytes())
    val = [h["val_loss"] for h in training["history"] if "val_loss" in h]

    assert training["steps"] == 6
    assert len(val) == 3 and val[-1] < val[0]
    header_len = int.from_bytes((adapter / "adapter_model.safetensors").read_bytes()[:8], "little")
    header = orjson.loads((adapter / "adapter_model.safetensors").read_bytes()[8 : 8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}


def test_vllm_serves_the_adapter_and_its_answers_are_valid_and_grounded(
    adapter, examples_file, tmp_path
):
    _, examples = examples_file
    test_points = [x for x in examples if x.split == "test"][:6]
    assert test_points
    tier = start_llm_tier(
        tmp_path / "llm",
        workers=1,
        model=ServedModel(lora=((ADAPTER, adapter),), max_lora_rank=8),
    )
    try:
        config = load_config(
            {"llm": {**tier.job_settings(), "model": ADAPTER, "max_tokens": 160}}, environ={}
        )
        tasks = []
        for x in test_points:
            task = prompt_task(x.shopper_id)
            prompt = dataclasses.replace(
                task.prompt,
                messages=x.messages,
                template="shopper_intent_compact.j2",
                estimated_tokens=x.estimated_tokens,
                model=ADAPTER,
            )
            tasks.append(dataclasses.replace(task, prompt=prompt, categories=x.categories))

        answers = ask_all(tasks, config.llm)
    finally:
        tier.stop()

    assert all(isinstance(a, Answered) for a in answers), answers
    for task, answered in zip(tasks, answers, strict=True):
        assert answered.model == ADAPTER
        assert category_is_grounded(answered.intent, task.categories)
        confidences = [i["confidence"] for i in answered.intent.body["intents"]]
        assert confidences == sorted(confidences, reverse=True)
    # The model's label probabilities, not the digits the targets taught it to write.
    written = {c for a in answers for c in (i["confidence"] for i in a.intent.body["intents"])}
    assert written - set(CONFIDENCES)
