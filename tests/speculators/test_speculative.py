"""Speculative decoding on the real default model: lossless greedy output for every built-in
speculator, the host-draft policy, K=0 steps, and the sampled distribution."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from speckernel import registry
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS, run_to_completion

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
# remote drafts through a served drafter process: tests/speculators/test_remote.py starts one and checks it.
BUILTIN = sorted(n for n, ep in registry.discover("speculator").items()
                 if ep.value.startswith("speckernel.") and n != "remote")
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def core_for(speculator: str | None = None, **kw) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(EngineConfig(platform="cpu", max_model_len=512, speculator=speculator, **kw))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS[:20]]


@pytest.fixture(scope="module")
def plain_greedy(prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return run_to_completion(core_for(), prompts, GREEDY)


def test_builtins_are_discovered_through_entry_points() -> None:
    assert {"ngram", "draft_model"} <= set(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
def test_greedy_output_is_lossless(name: str, prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    core = core_for(name, num_speculative_tokens=3)
    got = run_to_completion(core, prompts, GREEDY)
    assert got == plain_greedy
    spec = core.stats()["spec"]
    assert spec["num_draft_tokens"] > 0, "the speculator never drafted: the test proves nothing"
    caps = registry.load("speculator", name).capabilities
    steps_with_drafting = core.num_steps - spec["num_k0_steps"]
    if caps.draft_width == "fixed":
        assert spec["num_host_draft_copies"] == 0
    else:
        assert spec["num_host_draft_copies"] == steps_with_drafting


def test_target_as_its_own_draft_model_accepts_every_draft(prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    core = core_for("draft_model", num_speculative_tokens=4)
    assert run_to_completion(core, prompts[:6], GREEDY) == plain_greedy[:6]
    spec = core.stats()["spec"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
    assert spec["acceptance_per_position"] == [1.0] * 4
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_draft_tokens"] / spec["num_drafts"])
    assert core.num_steps < 24  # 24 tokens in fewer steps than tokens


def test_structured_output_forces_the_host_copy_for_fixed_width(prompts) -> None:  # type: ignore[no-untyped-def]
    core = core_for("draft_model", num_speculative_tokens=2)
    structured = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, structured_output=True)
    run_to_completion(core, prompts[:2], structured)
    assert core.stats()["spec"]["num_host_draft_copies"] > 0


def test_k0_steps_and_the_switch_to_turn_them_off(prompts) -> None:  # type: ignore[no-untyped-def]
    # A non-final prefill chunk, then the first token (drafts follow), then a last step whose
    # token surely ends the request: two K=0 steps, whatever the drafter accepts.
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    core = core_for("draft_model", num_speculative_tokens=2, max_num_batched_tokens=4)
    run_to_completion(core, prompts[:1], params)
    k0 = core.stats()["spec"]["num_k0_steps"]
    assert k0 >= 2
    off = core_for("draft_model", num_speculative_tokens=2, max_num_batched_tokens=4, skip_drafts=False)
    assert run_to_completion(off, prompts[:1], params) == run_to_completion(core, prompts[:1], params, "again")
    assert off.stats()["spec"]["num_k0_steps"] == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"speculator": "ngram", "num_speculative_tokens": 17}, "at most 16"),
     ({"speculator": "draft_model", "num_speculative_tokens": 0}, "num_speculative_tokens"),
     ({"speculator": "no-such-drafter"}, "available: .*draft_model.*ngram")],
)
def test_bad_speculator_settings_fail_at_start(overrides, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInputError, match=message):
        EngineCore(EngineConfig(platform="cpu", max_model_len=256, **overrides))


@pytest.mark.parametrize("name", ["draft_model", "ngram"])
def test_sampled_distribution_with_speculation_equals_the_targets(name: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """At temperature 1 the second token (the first one decided by verification) follows the
    target's distribution: chi-square against p(. | prompt, first token) from the model itself.
    The draft model is the target's first 8 layers (q differs from p), so the emitted tokens go
    through both acceptance and rejection; the whole target would draft with q = p and never be
    rejected. Most drafts are rejected here, so this end-to-end check has little power against a
    wrong residual; `test_verify` checks the residual's law exactly."""
    prompt = tokenizer.encode("one two three one two three one two three one two")
    n = 512
    options = {"num_layers": "8"} if name == "draft_model" else {}
    core = core_for(name, num_speculative_tokens=2, max_num_seqs=128, speculator_options=options)
    for s in range(n):
        core.add_request(AddRequest(s, np.asarray(prompt), SamplingParams(
            max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)))
    outs: dict[int, list[int]] = {s: [] for s in range(n)}
    while core.scheduler.requests:
        for d in core.step():
            outs[d.key].extend(d.new_token_ids)
    spec = core.stats()["spec"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    first, _ = Counter(o[0] for o in outs.values()).most_common(1)[0]
    seconds = np.array([o[1] for o in outs.values() if o[0] == first])
    assert len(seconds) >= 150
    from speckernel.kernel.frame import ScheduledRow, StepFrame

    ids = [*prompt, first]
    blocks = [core.scheduler.blocks.free_blocks[i] for i in range(core.scheduler.blocks.blocks_needed(len(ids)))]
    logits = core.runner.prompt_logits(StepFrame(0, [ScheduledRow(0, 0, 0, 0, ids, blocks, None)]))[-1]
    p = torch.softmax(logits, -1).numpy()
    expected = p * len(seconds)
    big = expected >= 5
    observed = np.array([np.sum(seconds == t) for t in np.flatnonzero(big)] + [np.sum(~big[seconds])])
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float(((observed[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_layer_truncated_draft_model_is_rejected_often_and_stays_lossless(prompts, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    """A weak drafter (the target's first 8 layers) makes verification reject most drafts from
    the device-side store: output must not change."""
    core = core_for("draft_model", num_speculative_tokens=3, speculator_options={"num_layers": "8"})
    assert run_to_completion(core, prompts, GREEDY) == plain_greedy
    spec = core.stats()["spec"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert spec["num_host_draft_copies"] == 0


def test_unknown_draft_model_option_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="num_layers"):
        core_for("draft_model", speculator_options={"num_layer": "8"})
    with pytest.raises(InvalidInputError, match=r"integer in \[1, 30\]"):
        core_for("draft_model", speculator_options={"num_layers": "31"})
