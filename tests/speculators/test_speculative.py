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


@pytest.fixture(scope="module")
def own_draft(prompts) -> tuple[list[list[int]], dict, int]:  # type: ignore[no-untyped-def]
    """The target as its own draft model (all its layers: q = p) at K=4, run once: its output is
    draft_model's lossless check and its counters the every-draft-accepted check. draft_model at
    K=3 stays checked by the layer-truncated test, which also goes through rejections. Output,
    spec counters and step count, not the engine: that is freed."""
    core = core_for("draft_model", num_speculative_tokens=4)
    got = run_to_completion(core, prompts, GREEDY)
    return got, core.stats()["spec"], core.num_steps


def test_builtins_are_discovered_through_entry_points() -> None:
    assert {"ngram", "draft_model"} <= set(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
def test_greedy_output_is_lossless(name: str, prompts, plain_greedy, request) -> None:  # type: ignore[no-untyped-def]
    if name == "draft_model":
        got, spec, num_steps = request.getfixturevalue("own_draft")
    else:
        core = core_for(name, num_speculative_tokens=3)
        got = run_to_completion(core, prompts, GREEDY)
        spec, num_steps = core.stats()["spec"], core.num_steps
    assert got == plain_greedy
    assert spec["num_draft_tokens"] > 0, "the speculator never drafted: the test proves nothing"
    caps = registry.load("speculator", name).capabilities
    steps_with_drafting = num_steps - spec["num_k0_steps"]
    if caps.draft_width == "fixed":
        assert spec["num_host_draft_copies"] == 0
    else:
        assert spec["num_host_draft_copies"] == steps_with_drafting


def test_target_as_its_own_draft_model_accepts_every_draft(own_draft, plain_greedy) -> None:  # type: ignore[no-untyped-def]
    got, spec, num_steps = own_draft
    assert got == plain_greedy
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
    assert spec["acceptance_per_position"] == [1.0] * 4
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_draft_tokens"] / spec["num_drafts"])
    assert num_steps < 24  # 24 tokens in fewer steps than tokens


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
    on = run_to_completion(core, prompts[:1], params)
    k0 = core.stats()["spec"]["num_k0_steps"]
    assert k0 >= 2
    off = core_for("draft_model", num_speculative_tokens=2, max_num_batched_tokens=4, skip_drafts=False)
    assert run_to_completion(off, prompts[:1], params) == on
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


# Prompts whose first sampled token is nearly sure at T=1 while the second stays spread (see
# below); the leading space makes the prompt hold the very token sampled first, which ngram finds.
SAMPLED_PROMPTS = {"draft_model": " Einstein. Albert", "ngram": " Janeiro. Rio de"}


@pytest.mark.parametrize("name", ["draft_model", "ngram"])
def test_sampled_distribution_with_speculation_equals_the_targets(name: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """At temperature 1 the second token (the first one decided by verification) follows the
    target's distribution: chi-square against p(. | prompt, first token) from the model itself.
    The first token is nearly sure (p(" Einstein") = 0.94, p(" Janeiro") = 0.99) and the second
    spread, so nearly every request gives a sample: 176 requests of 3-4 tokens give the 150 that
    512 of 12 tokens gave when a third of the requests shared the first token. The draft model is
    the target's first 8 layers: its q puts 0.77 on "," where p has 0.12, so wrongly accepted
    drafts show (the whole target would draft with q = p and never be rejected); ngram drafts the
    "." that followed " Janeiro" (p = 0.09). Either way the emitted tokens go through both
    acceptance and rejection. `test_verify` checks the residual's law exactly."""
    prompt = tokenizer.encode(SAMPLED_PROMPTS[name])
    n = 176  # fewer than 150 of them sharing the first token: odds below 1e-5
    options = {"num_layers": "8"} if name == "draft_model" else {}
    core = core_for(name, num_speculative_tokens=2, max_num_seqs=n, speculator_options=options)
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
