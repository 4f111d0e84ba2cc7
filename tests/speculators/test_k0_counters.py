"""K=0 steps change nothing but the work: on the real default model with the shipped mtp, eagle3
and dflash drafters, a mix of prefill-only requests (max_tokens=1), requests that finish after a
token or two, and decoding ones, with prompts chunked so that most prefill steps sample nothing,
gives the same outputs and the very same speculation counters with K=0 steps as without them."""

from __future__ import annotations

import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "acceptance_per_position", "num_invalid_drafts")
"""The speculation counters. Host draft copies are work, not speculation: a K=0 step of a
variable-width drafter has no drafts to copy."""
MAX_TOKENS = [1, 12, 2, 1, 16, 1]
"""Per prompt: prefill-only requests (every step of theirs can skip), ones sure to finish after a
step or two, and decoding ones beside them."""


def counted(name: str, skip_drafts: bool, prompts: list[list[int]]) -> tuple[list[list[int]], dict, int]:  # type: ignore[type-arg]
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=256, speculator=name, num_speculative_tokens=3,
                                   max_num_batched_tokens=8, skip_drafts=skip_drafts, adaptive_speculation=False))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    out = run_loop(core, prompts, params)
    return out, core.stats()["spec"], core.num_steps


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash"])
def test_counters_are_identical_with_and_without_k0_steps(name: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [tokenizer.encode(p) for p in PROMPTS[:len(MAX_TOKENS)]]
    with_k0, spec_k0, steps_k0 = counted(name, True, prompts)
    without, spec, steps = counted(name, False, prompts)
    assert spec_k0["num_k0_steps"] > 0, "no step was K=0: the test proves nothing"
    assert spec["num_k0_steps"] == 0
    assert spec["num_draft_tokens"] > 0, "the speculator never drafted: the test proves nothing"
    assert with_k0 == without
    assert {c: spec_k0[c] for c in COUNTERS} == {c: spec[c] for c in COUNTERS}
    assert steps_k0 == steps  # K=0 leaves the schedule alone: the same steps, some without drafting
    assert spec_k0["num_host_draft_copies"] <= spec["num_host_draft_copies"]
