"""Logprobs on the real default model (CPU float32): each output token's logprob is the model's raw
log_softmax at its position (HF transformers' forward pass as the reference), whatever the
sampling; a speculator changes neither the tokens nor their logprobs; bad values are refused
naming the field; pipeline stages refuse them."""

from __future__ import annotations

import anyio
import pytest
import torch
from msgspec.structs import replace

from speckernel import AsyncEngine, EngineConfig, SamplingParams
from speckernel.errors import InvalidSamplingParamsError
from speckernel.outputs import RequestOutput, TokenLogprobs
from speckernel.sampling_params import MAX_LOGPROBS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures

REAL = EngineConfig(platform="cpu", in_process=True, max_model_len=512)
REPEATS = "one two three four five, one two three four five, one two three four five, one two"
"""A prompt ngram drafts well for: most of its continuation repeats it."""
PROMPTS = ["The capital of France is", REPEATS]
TOP = 5


async def run(engine: AsyncEngine, prompt: str, params: SamplingParams) -> tuple[list[int], list[TokenLogprobs]]:
    """The request's tokens and logprobs, checking that every output carries one per delta token."""
    outs: list[RequestOutput] = []
    with anyio.fail_after(300):
        async for out in engine.generate(prompt, params):
            outs.append(out)
    logprobs = []
    for out in outs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.delta_token_ids)
        logprobs.extend(out.logprobs)
    return outs[-1].token_ids, logprobs


def reference(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[len(output_ids), V] log_softmax of a plain forward pass over prompt + output, at the
    positions that predict each output token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def check_against(ref: torch.Tensor, tokens: list[int], logprobs: list[TokenLogprobs], top: int) -> None:
    assert len(logprobs) == len(tokens) == ref.shape[0]
    for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.logprob == pytest.approx(ref[j, token].item(), abs=5e-4), (j, token)
        assert len(lp.top_ids) == len(lp.top_logprobs) == top
        values, ids = ref[j].topk(top)
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), values, rtol=0, atol=5e-4)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        # Ties within the tolerance may swap; any id reported has the reported value.
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            assert ref[j, t].item() == pytest.approx(v, abs=5e-4)
        assert set(lp.top_ids) == set(ids.tolist()) or abs(values[-1] - values[-2]) < 1e-3


async def test_logprobs_equal_a_plain_forward_pass(hf_model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP)
    # Sampled, penalized and filtered: the logprobs are still the model's raw ones.
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True, logprobs=2,
                             repetition_penalty=1.3)
    async with AsyncEngine(REAL) as engine:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            tokens, logprobs = await run(engine, prompt, greedy)
            check_against(reference(hf_model, ids, tokens), tokens, logprobs, TOP)
            assert all(lp.top_ids[0] == t for t, lp in zip(tokens, logprobs, strict=True))  # greedy: the top token
            tokens, logprobs = await run(engine, prompt, sampled)
            check_against(reference(hf_model, ids, tokens), tokens, logprobs, 2)
        # A stop string cuts tokens off: the logprobs go with the tokens that remain, delta by delta.
        tokens, logprobs = await run(engine, REPEATS, greedy)
        cut, cut_logprobs = await run(engine, REPEATS, replace(greedy, stop=("five",)))
        assert 0 < len(cut) < len(tokens) and cut == tokens[: len(cut)] and cut_logprobs == logprobs[: len(cut)]
        tokens, logprobs = await run(engine, PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, logprobs=0))
        assert all(lp.top_ids == [] and lp.top_logprobs == [] for lp in logprobs)
        outs = [out async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))]
        assert all(out.logprobs is None for out in outs)  # not asked: none computed, none sent
        assert outs[-1].token_ids == tokens


async def test_speculation_leaves_logprobs_unchanged() -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=TOP)
    seeded = SamplingParams(max_tokens=24, temperature=0.7, seed=3, ignore_eos=True, logprobs=TOP)
    results = {}
    for speculator in (None, "ngram"):
        config = EngineConfig(platform="cpu", in_process=True, max_model_len=512, speculator=speculator,
                              num_speculative_tokens=4)
        async with AsyncEngine(config) as engine:
            results[speculator] = [await run(engine, REPEATS, p) for p in (params, seeded)]
            if speculator is not None:
                await batched_like_solo(engine)
            stats = await engine.stats()
        if speculator is not None:
            assert stats["spec"]["num_accepted_tokens"] > 8, stats  # drafts were verified and kept: a real test
    for (tokens, plain), (spec_tokens, spec) in zip(results[None], results["ngram"], strict=True):
        assert spec_tokens == tokens
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in spec]),
                                   torch.tensor([lp.logprob for lp in plain]), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor([lp.top_logprobs for lp in spec]),
                                   torch.tensor([lp.top_logprobs for lp in plain]), rtol=0, atol=1e-4)


async def batched_like_solo(engine: AsyncEngine) -> None:
    """Rows that ask for logprobs share steps with rows that do not (and with rows that ask for
    fewer alternatives): each gets what it gets alone, and only the rows that asked get logprobs."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = [(REPEATS, replace(params, logprobs=TOP)), (PROMPTS[0], replace(params, logprobs=1)), (REPEATS, params)]
    solo = [await run(engine, prompt, p) for prompt, p in runs[:2]]
    got: dict[int, tuple[list[int], list[TokenLogprobs] | None]] = {}

    async def one(i: int, prompt: str, p: SamplingParams) -> None:
        outs = [out async for out in engine.generate(prompt, p)]
        got[i] = outs[-1].token_ids, None if p.logprobs is None else [lp for o in outs for lp in o.logprobs or ()]
        assert p.logprobs is not None or all(o.logprobs is None for o in outs)

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            for i, (prompt, p) in enumerate(runs):
                tg.start_soon(one, i, prompt, p)
    assert got[2] == (solo[0][0], None)
    for i, (tokens, logprobs) in enumerate(solo):
        assert got[i][0] == tokens
        batched = got[i][1]
        assert batched is not None and [len(lp.top_ids) for lp in batched] == [runs[i][1].logprobs] * len(tokens)
        torch.testing.assert_close(torch.tensor([[lp.logprob, *lp.top_logprobs] for lp in batched]),
                                   torch.tensor([[lp.logprob, *lp.top_logprobs] for lp in logprobs]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.0, "3"])
def test_bad_logprobs_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=r"^logprobs: expected an integer in \[0, 20\] or None"):
        SamplingParams(logprobs=value).validate()  # type: ignore[arg-type]

