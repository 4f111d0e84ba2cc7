"""The project's Llama implementation against HF transformers' LlamaForCausalLM on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speckernel.kernel.frame import ScheduledRow, StepFrame
from speckernel.sampling_params import SamplingParams
from tests.conftest import PROMPTS, run_to_completion

pytestmark = pytest.mark.slow


def our_logits(core, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Full-prompt logits through the paged-KV runner (blocks borrowed and returned)."""
    blocks = core.scheduler.blocks
    n_blocks = blocks.blocks_needed(len(ids))
    block_ids = [blocks.free_blocks.popleft() for _ in range(n_blocks)]
    try:
        frame = StepFrame(0, [ScheduledRow(0, 0, 0, 0, ids, block_ids, None)])
        return core.runner.prompt_logits(frame)
    finally:
        blocks.free_blocks.extend(block_ids)


def test_logits_match_hf_fp32(core, hf_model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for prompt in PROMPTS[:6]:
        ids = tokenizer.encode(prompt)
        ours = our_logits(core, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_continuations_match_hf(core, hf_model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [tokenizer.encode(p) for p in PROMPTS[:6]]
    ours = run_to_completion(core, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(ids):].tolist()


def test_chunked_prefill_equals_one_shot(core, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(" ".join(PROMPTS[:8]))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    whole = run_to_completion(core, [ids], params, prefix="whole")
    saved = core.scheduler.max_num_batched_tokens
    core.scheduler.max_num_batched_tokens = 7  # forces many prefill chunks
    try:
        chunked = run_to_completion(core, [ids], params, prefix="chunk")
    finally:
        core.scheduler.max_num_batched_tokens = saved
    assert chunked == whole
    assert np.all(core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks)
