"""A speculator that raises costs its drafts, never a request: the step's target tokens stand, the
failure is counted, and a speculator whose pass raises on every step is switched off for the
engine (with a warning) while requests go on without drafts. Greedy output equals the target's
alone throughout. The faulty speculators are registered the way any plugin is, through the
speculator entry points; the engine knows them only by what they declare."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from speckernel import AsyncEngine, EngineConfig, SamplingParams
from speckernel.engine.core import EngineCore
from speckernel.plugin import (
    DeviceStates,
    Drafts,
    HostRows,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
)
from speckernel.speculators.ngram import NgramSpeculator
from tests.conftest import install_speculators, run_to_completion

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

BASE = EngineConfig(model="random:tiny", platform="cpu", max_model_len=256, num_kv_blocks=64, seed=0,
                    async_scheduling=False)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 3, 3, 3, 3, 3]]


class RepeatLast(SpeculatorBase):
    """Host-side, fixed width: the newest confirmed token K times."""

    name = "t_repeat_last"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=8)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.device = ctx.device
        self.calls = itertools.count()

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        last = torch.tensor([max(n - 1, 0) for n in rows.seq_lens], device=self.device)
        return Drafts(states.tokens[states.slot_index, last].clamp(min=0)[:, None].repeat(1, k))

    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        pass


class RaisesInPropose(RepeatLast):
    name = "t_raises_in_propose"

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        raise RuntimeError("drafter exploded")


class RaisesEveryOtherStep(RepeatLast):
    name = "t_raises_every_other_step"

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        if next(self.calls) % 2:
            raise RuntimeError("drafter hiccup")
        return super().propose(states, rows, k)


class DeviceRaisesInPropose(NgramSpeculator):
    """Drafts inside the step (an InStepSpeculator), variable width."""

    name = "t_device_raises"

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        raise IndexError("index 70000 is out of bounds for dimension 0 with size 49152")


class OutOfVocab(RepeatLast):
    """Host-side: every draft an id past the vocabulary (a corrupt index table would do this)."""

    name = "t_out_of_vocab"

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        return Drafts(super().propose(states, rows, k).token_ids + 100_000)


class DeviceOutOfVocab(NgramSpeculator):
    name = "t_device_out_of_vocab"

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        ids = super().propose(states, k).token_ids
        return Drafts(torch.where(ids >= 0, ids + 100_000, ids))


FAULTY = {cls.name: cls for cls in (RepeatLast, RaisesInPropose, RaisesEveryOtherStep, DeviceRaisesInPropose,
                                    OutOfVocab, DeviceOutOfVocab)}


@pytest.fixture(autouse=True)
def faulty_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test speculators as installed plugins."""
    install_speculators(monkeypatch, __name__, FAULTY)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run_to_completion(EngineCore(BASE), PROMPTS, GREEDY)


def spec_core(name: str, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(**{**{f: getattr(BASE, f) for f in BASE.__struct_fields__},
                                      "speculator": name, "num_speculative_tokens": 3, **kw}))


@pytest.mark.parametrize("name", ["t_raises_in_propose", "t_device_raises"])
def test_a_speculator_that_raises_on_every_step_is_switched_off_and_output_is_plain_greedy(
        name: str, plain: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    core = spec_core(name)
    with caplog.at_level(logging.WARNING, logger="speckernel"):
        got = run_to_completion(core, PROMPTS, GREEDY)
    assert got == plain  # no request failed, none lost a token
    spec = core.stats()["spec"]
    assert spec["speculator_off"] and spec["speculator_off_error"] in (
        "RuntimeError: drafter exploded", "IndexError: index 70000 is out of bounds for dimension 0 with size 49152")
    assert spec["num_speculator_failures"] == core.speculator_failure_limit
    warnings = [r for r in caplog.records if "speculator_switched_off" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert f"failed_steps={core.speculator_failure_limit}" in warnings[0].getMessage()
    assert core.scheduler.spec is None and core.runner.speculator is None  # type: ignore[union-attr]
    # Later requests run without it, and are the target's own.
    assert run_to_completion(core, PROMPTS[:1], GREEDY) == plain[:1]
    assert core.stats()["spec"]["num_speculator_failures"] == core.speculator_failure_limit


def test_a_speculator_that_fails_now_and_then_is_kept_and_costs_only_those_drafts(plain: list[list[int]]) -> None:
    core = spec_core("t_raises_every_other_step")
    got = run_to_completion(core, PROMPTS, GREEDY)
    assert got == plain
    spec = core.stats()["spec"]
    assert not spec["speculator_off"] and spec["num_speculator_failures"] > 0
    assert spec["num_draft_tokens"] > 0  # the passes that worked still drafted


def test_a_healthy_speculator_counts_no_failure(plain: list[list[int]]) -> None:
    core = spec_core("t_repeat_last")
    assert run_to_completion(core, PROMPTS, GREEDY) == plain
    spec = core.stats()["spec"]
    assert spec["num_speculator_failures"] == 0 and not spec["speculator_off"] and spec["num_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["t_raises_in_propose", "t_device_raises"])
async def test_through_the_engine_loop_with_async_scheduling(name: str, plain: list[list[int]]) -> None:
    """The run loop with two frames in flight: a successor planned on drafts that never came."""
    config = EngineConfig(**{**{f: getattr(BASE, f) for f in BASE.__struct_fields__}, "speculator": name,
                             "num_speculative_tokens": 3, "async_scheduling": True, "in_process": True})
    async with AsyncEngine(config) as engine:
        outs = []
        for ids in PROMPTS:
            got = [out async for out in engine.generate(ids, GREEDY)]
            assert got[-1].finish_reason == "length"
            outs.append(list(got[-1].token_ids))
        stats = await engine.stats()
    assert outs == plain
    assert stats["spec"]["speculator_off"]


def test_nothing_fails_when_the_limit_is_never_reached(plain: list[list[int]]) -> None:
    core = spec_core("t_raises_in_propose")
    core.speculator_failure_limit = 10**9
    assert run_to_completion(core, PROMPTS, GREEDY) == plain
    spec = core.stats()["spec"]
    assert not spec["speculator_off"] and spec["num_speculator_failures"] > 0 and spec["num_draft_tokens"] == 0


@pytest.mark.parametrize("name", ["t_out_of_vocab", "t_device_out_of_vocab"])
def test_drafts_outside_the_vocabulary_are_never_verified_and_fail_nothing(name: str, plain: list[list[int]]) -> None:
    core = spec_core(name)
    assert run_to_completion(core, PROMPTS, GREEDY) == plain
    spec = core.stats()["spec"]
    assert spec["num_accepted_tokens"] == 0 and spec["num_speculator_failures"] == 0
