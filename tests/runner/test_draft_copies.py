"""Draft IDs cross to the host only where the host must see them, counted at the copy itself:
every device-to-host copy the runner makes goes through `host_copy.to_host`, draft IDs always
as its `drafts` argument, and this test wraps that function (not the runner's own counter).

Fixed width needs only the count on the host: no draft-ID copy, whichever kind drafts (inside
the step or after it). Variable width on the host path (the CPU backend plans on the host) must
copy the IDs: the scheduler trims them at the first -1. `force_host_drafts` copies fixed-width
drafts all the same (what `bench hostsync` measures), so the counter sees copies that happen.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from speckernel import EngineConfig, SamplingParams
from speckernel.engine.core import EngineCore
from speckernel.plugin import DeviceStates, Drafts, HostRows, SpeculatorBase, SpeculatorCapabilities
from speckernel.runner import host_copy
from tests.conftest import install_speculators, run_to_completion

K = 3
BASE = EngineConfig(model="random:tiny", platform="cpu", max_model_len=256, num_kv_blocks=64, seed=0,
                    async_scheduling=False, num_speculative_tokens=K)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [3, 3, 3, 3, 3, 3]]


def repeat_last(states: DeviceStates, k: int) -> torch.Tensor:
    last = (states.seq_lens - 1).clamp(min=0)
    return states.tokens[states.slot_index, last].clamp(min=0)[:, None].repeat(1, k)


class FixedInStep(SpeculatorBase):
    name = "t_fixed_in_step"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=8)

    def __init__(self, ctx: Any) -> None:
        pass

    def propose(self, states: DeviceStates, k: int) -> Drafts:
        return Drafts(repeat_last(states, k))

    def sync(self, states: DeviceStates) -> None:
        return None


class FixedAfterStep(SpeculatorBase):
    name = "t_fixed_after_step"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=8)

    def __init__(self, ctx: Any) -> None:
        pass

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        return Drafts(repeat_last(states, k))

    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        return None


class VariableAfterStep(FixedAfterStep):
    """Its last draft is always -1: the row ends early."""

    name = "t_variable_after_step"
    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=8)

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts:
        ids = repeat_last(states, k)
        ids[:, -1] = -1
        return Drafts(ids)


TEST_SPECULATORS = {cls.name: cls for cls in (FixedInStep, FixedAfterStep, VariableAfterStep)}


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test speculators as installed plugins."""
    install_speculators(monkeypatch, __name__, TEST_SPECULATORS)


def copies(speculator: str, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[int, int, int, list[list[int]]]:
    """(steps, copies of step tokens, copies of draft IDs, greedy output) of a run."""
    core = EngineCore(EngineConfig(**{**{f: getattr(BASE, f) for f in BASE.__struct_fields__},
                                      "speculator": speculator, **kw}))
    real = host_copy.to_host
    seen: list[tuple[bool, bool]] = []

    def counting(tokens: torch.Tensor | None, drafts: torch.Tensor | None = None,
                 extra: Any = ()) -> host_copy.HostTensors:
        seen.append((tokens is not None, drafts is not None))
        if drafts is not None:
            assert drafts.dtype == torch.int64 and drafts.shape[1] == K
        return real(tokens, drafts, extra)

    monkeypatch.setattr(host_copy, "to_host", counting)
    out = run_to_completion(core, PROMPTS, GREEDY)
    monkeypatch.setattr(host_copy, "to_host", real)
    assert core.stats()["spec"]["num_draft_tokens"] > 0, "the speculator drafted"
    return core.num_steps, sum(t for t, _ in seen), sum(d for _, d in seen), out


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run_to_completion(EngineCore(BASE), PROMPTS, GREEDY)


@pytest.mark.parametrize("name", ["t_fixed_in_step", "t_fixed_after_step"])
def test_fixed_width_drafts_never_copy_their_ids(name: str, monkeypatch: pytest.MonkeyPatch,
                                                 plain: list[list[int]]) -> None:
    steps, token_copies, draft_copies, out = copies(name, monkeypatch)
    assert out == plain
    assert token_copies == steps  # one copy of each step's tokens, and nothing else
    assert draft_copies == 0


@pytest.mark.parametrize("name", ["ngram", "t_variable_after_step"])
def test_variable_width_drafts_copy_their_ids(name: str, monkeypatch: pytest.MonkeyPatch,
                                              plain: list[list[int]]) -> None:
    steps, token_copies, draft_copies, out = copies(name, monkeypatch)
    assert out == plain
    assert token_copies == steps
    assert 0 < draft_copies <= steps


@pytest.mark.parametrize("name", ["t_fixed_in_step", "t_fixed_after_step"])
def test_forced_host_drafts_are_copied(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    steps, _, draft_copies, _ = copies(name, monkeypatch, force_host_drafts=True)
    assert 0 < draft_copies <= steps
