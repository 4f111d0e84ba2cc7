"""Prompts apart (`EngineConfig.prompts_apart`, `Scheduler.prompt_tokens_apart`): prompts that
arrive while others decode run in steps of their own, one at a time, and the engine's output is
the mixed schedule's, token for token (greedy, float32), with and without a speculator.

Where no device graph is captured (the CPU) the engine mixes prompts into decode steps; the
tests set the scheduler's bound by hand to run the apart schedule through the real engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

PROMPT_LENS = (3, 40, 7, 25, 12, 60)


def staggered(core: EngineCore, apart: int, gap: int = 3) -> tuple[dict[int, list[int]], list[str]]:
    """Each request arrives after the one before it has run `gap` steps (0: all at once). Returns
    the outputs and each step's kind: P (one prompt row), D (decode rows only), M (mixed)."""
    core.scheduler.prompt_tokens_apart = apart
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out: dict[int, list[int]] = {}
    kinds: list[str] = []
    schedule = core.scheduler.schedule

    def spy() -> Any:
        frame = schedule()
        if frame is not None:
            prompt = [r for r in frame.rows if r.num_tokens - r.num_drafts > 1]
            kinds.append("D" if not prompt else "P" if len(frame.rows) == 1 else "M")
        return frame

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    for key, n in enumerate(PROMPT_LENS):
        out[key] = []
        assert core.add_request(AddRequest(key, rng.integers(0, 500, n), params)) is None
        for _ in range(gap):
            for delta in core.step():
                out[delta.key] += delta.new_token_ids
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.key] += delta.new_token_ids
    return out, kinds


@pytest.mark.parametrize("spec", [{}, {"speculator": "ngram", "num_speculative_tokens": 3}])
def test_prompts_apart_give_the_mixed_schedules_output(spec: dict[str, Any]) -> None:
    config = EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=256,
                          max_num_seqs=8, max_num_batched_tokens=64, in_process=True, **spec)
    core = EngineCore(config)
    assert core.scheduler.prompt_tokens_apart == 0, "no graphs on the CPU: prompts share steps"
    mixed, mixed_kinds = staggered(core, 0)
    apart, kinds = staggered(EngineCore(config), 16)
    assert "M" in mixed_kinds and "M" not in kinds, (mixed_kinds, kinds)
    # 3 + 40 + 7 + 25 + 12 + 60 prompt tokens in chunks of at most 16: 1+3+1+2+1+4 prompt steps.
    assert kinds.count("P") == 12
    assert apart == mixed


def test_a_burst_of_prompts_runs_several_prompt_steps_per_decode_step() -> None:
    """All six arrive at once: while several wait, up to `prompt_steps_per_decode` prompt steps
    run between decode steps, and the output is still the mixed schedule's."""
    config = EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=256,
                          max_num_seqs=8, max_num_batched_tokens=64, in_process=True, prompt_steps_per_decode=3)
    mixed, _ = staggered(EngineCore(config), 0, gap=0)
    apart, kinds = staggered(EngineCore(config), 16, gap=0)
    steps = "".join(kinds)
    assert "M" not in steps and "PPP" in steps and "PPPP" not in steps, steps
    assert apart == mixed
