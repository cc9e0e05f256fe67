"""Template A/B arms (``prompt.arms``): parsed and validated at start, a shopper's arm a
stable function of its id that follows the weights, each shopper rendered with its arm's
template (and asked of its arm's model), and the figures broken down by arm."""

from __future__ import annotations

import dataclasses
from collections import Counter

import orjson
import pytest

from flink_jobs.config import ConfigError, LlmConfig, PromptConfig, load_config
from flink_jobs.core.arms import Arm, arm_point, assign_arm, parse_arms
from flink_jobs.core.prompting import ArmRenderer, PromptError
from flink_jobs.core.tasks import TaskResult
from flink_jobs.metrics import OutcomeRecorder, arm_stat
from flink_jobs.runtime.llm_client import build_request
from flink_jobs.runtime.outbox import Settled
from tests.support.builders import HEADPHONES, session_of, shopper_event
from tests.support.fake_metrics import FakeGroup, FakeStats

IDS = [f"shopper-{n:05d}" for n in range(10_000)]
HALVES = "shopper_intent_v1.j2:50,shopper_intent_v2.j2:50"


class TestTheSetting:
    def test_empty_is_the_template_for_everyone(self) -> None:
        assert parse_arms("", "shopper_intent_v1.j2") == (Arm("shopper_intent_v1.j2", 1),)

    def test_arms_with_weights_and_a_model(self) -> None:
        arms = parse_arms("shopper_intent_v1.j2:90, shopper_intent_v2.j2@Qwen2.5-0.5B:10", "x")

        assert arms == (
            Arm("shopper_intent_v1.j2", 90),
            Arm("shopper_intent_v2.j2", 10, "Qwen2.5-0.5B"),
        )
        assert [a.name for a in arms] == [
            "shopper_intent_v1.j2",
            "shopper_intent_v2.j2@Qwen2.5-0.5B",
        ]

    @pytest.mark.parametrize(
        ("text", "says"),
        [
            ("shopper_intent_v1.j2", "template\\[@model\\]:weight"),
            ("shopper_intent_v1.j2:half", "template\\[@model\\]:weight"),
            ("shopper_intent_v1.j2:-5", "template\\[@model\\]:weight"),
            ("a.j2:0,b.j2:0", "sum to 0"),
            ("a.j2:50,a.j2:50", "more than once"),
        ],
    )
    def test_a_bad_setting_fails_the_start_naming_the_key(self, text: str, says: str) -> None:
        with pytest.raises(ConfigError, match=f"prompt.arms: .*{says}"):
            load_config(environ={"SI_PROMPT_ARMS": text})

    def test_an_arm_whose_template_is_missing_fails_the_renderer_naming_the_key(self) -> None:
        with pytest.raises(PromptError, match=r"prompt\.arms: .*shopper_intent_v9\.j2"):
            ArmRenderer(PromptConfig(arms="shopper_intent_v1.j2:1,shopper_intent_v9.j2:1"))


class TestAssignment:
    def test_a_shoppers_arm_is_the_same_on_every_run_and_machine(self) -> None:
        # Pinned: a change to the hash would move every shopper to another arm.
        assert arm_point("shopper-00001") == arm_point("shopper-00001") == 0xD66C81749B21AC3F

    def test_equal_weights_split_shoppers_evenly(self) -> None:
        arms = parse_arms(HALVES, "x")
        counts = Counter(assign_arm(i, arms).template for i in IDS)

        assert abs(counts["shopper_intent_v1.j2"] - 5_000) < 250  # within 2.5 %

    def test_unequal_weights_are_respected(self) -> None:
        arms = parse_arms("a.j2:70,b.j2:20,c.j2:10", "x")
        counts = Counter(assign_arm(i, arms).template for i in IDS)

        for template, share in (("a.j2", 0.7), ("b.j2", 0.2), ("c.j2", 0.1)):
            assert abs(counts[template] / len(IDS) - share) < 0.02, counts

    def test_an_arm_of_weight_zero_gets_nobody(self) -> None:
        arms = parse_arms("a.j2:1,off.j2:0,b.j2:1", "x")

        assert {assign_arm(i, arms).template for i in IDS} == {"a.j2", "b.j2"}


class TestRendering:
    def state(self, shopper_id: str):
        return session_of(shopper_event("view", 0, HEADPHONES, shopper_id=shopper_id))

    def test_each_shopper_gets_its_arms_template(self) -> None:
        renderer = ArmRenderer(PromptConfig(arms=HALVES))

        for shopper in IDS[:40]:
            prompt = renderer.render(self.state(shopper))
            assert prompt.template == assign_arm(shopper, renderer.arms).template
        assert {renderer.render(self.state(s)).template for s in IDS[:40]} == {
            "shopper_intent_v1.j2",
            "shopper_intent_v2.j2",
        }

    def test_an_arms_model_is_the_one_asked(self) -> None:
        renderer = ArmRenderer(PromptConfig(arms="shopper_intent_v2.j2@Qwen2.5-0.5B:1"))
        prompt = renderer.render(self.state("shopper-00146"))

        _, body = build_request(prompt, "shopper-00146", LlmConfig())
        assert (prompt.arm, orjson.loads(body)["model"]) == (
            "shopper_intent_v2.j2@Qwen2.5-0.5B",
            "Qwen2.5-0.5B",
        )

    def test_without_arms_the_configured_template_and_model(self) -> None:
        prompt = ArmRenderer(PromptConfig()).render(self.state("shopper-00146"))

        _, body = build_request(prompt, "shopper-00146", LlmConfig())
        assert (prompt.template, prompt.model) == (PromptConfig().template, "")
        assert orjson.loads(body)["model"] == LlmConfig().model


class ArmGroups(FakeGroup):
    """A metric group with labelled subgroups, as PyFlink's ``add_group(key, value)``."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[tuple[str, str], FakeGroup] = {}

    def add_group(self, name: str, extra: str | None = None) -> FakeGroup:
        return self.groups.setdefault((name, extra), FakeGroup())


class TestFiguresByArm:
    def test_prompts_and_outcomes_are_counted_for_their_arm(self) -> None:
        renderer = ArmRenderer(PromptConfig(arms=HALVES))
        stats, group = FakeStats(), ArmGroups()
        recorder = OutcomeRecorder(stats, arms=renderer.arm_names)
        recorder.register(group)
        state = session_of(shopper_event("view", 0, HEADPHONES, shopper_id="shopper-00001"))
        from flink_jobs.core.tasks import PromptTask

        prompt = renderer.render(state)
        task = PromptTask("shopper-00001", 1, 0, 0, prompt)
        recorder.sent(5, 1, task)
        recorder.settled(Settled(task, TaskResult("written", attempts=1, llm_latency_s=0.5), 10))
        recorder.settled(Settled(task, TaskResult("written", source="rules"), 1))

        mine = group.groups[("arm", prompt.arm)].read()
        other = next(g for k, g in group.groups.items() if k != ("arm", prompt.arm)).read()
        assert (mine["prompts_sent"], mine["intents_written"], mine["intents_written_rules"]) == (
            1,
            1,
            1,
        )
        assert mine["llm_latency_ms_count"] == 1
        assert other["prompts_sent"] == other["intents_written"] == 0
        assert stats.counts[arm_stat(prompt.arm, "intents_written")] == 1
        assert set(group.groups) == {
            ("arm", "shopper_intent_v1.j2"),
            ("arm", "shopper_intent_v2.j2"),
        }

    def test_a_recorder_without_arms_keeps_the_job_wide_figures_only(self) -> None:
        stats = FakeStats()
        renderer = ArmRenderer(PromptConfig())
        state = session_of(shopper_event("view", 0, HEADPHONES))
        from flink_jobs.core.tasks import PromptTask

        task = PromptTask(state.shopper_id, 1, 0, 0, renderer.render(state))
        OutcomeRecorder(stats).settled(Settled(task, TaskResult("written"), 0))

        assert not [k for k in stats.counts if k.startswith("arm:")]
        assert dataclasses.replace(task.prompt).arm == PromptConfig().template
