"""Repetition, frequency and presence penalties on the real default model (float32, CPU): they
change what it says, speculation under them changes nothing (greedy and seeded), and requests
without them never pay for the counting."""

from __future__ import annotations

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.runner import model_runner
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
TOKENS = 16
G = dict(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
S = dict(max_tokens=TOKENS, ignore_eos=True, temperature=0.8)
CASES = {
    "greedy_repetition": SamplingParams(**G, repetition_penalty=1.4),
    "greedy_frequency": SamplingParams(**G, frequency_penalty=0.8),
    "greedy_presence": SamplingParams(**G, presence_penalty=1.2),
    "greedy_repeat_more": SamplingParams(**G, presence_penalty=-2.0, frequency_penalty=-1.0),
    "seeded_repetition": SamplingParams(**S, seed=1, repetition_penalty=1.3),
    "seeded_frequency": SamplingParams(**S, seed=2, frequency_penalty=1.0),
    "seeded_presence": SamplingParams(**S, seed=3, presence_penalty=1.5, top_k=20),
}
"""Each on a prompt of its own, next to its greedy cases' twins without penalties (one batch)."""
SPECULATORS = ["ngram", "draft_model", "mtp", "dflash"]
"""Variable width on the host (ngram), fixed width on the host (draft_model: the target drafting
for itself, so most drafts are accepted), fixed width on the device (mtp), variable
width on the device (dflash). eagle3 drafts like mtp as far as verification can tell."""


def requests() -> list[tuple[str, int, SamplingParams]]:
    """(case, prompt index, params): every case, and each greedy case without its penalties."""
    cases = [(name, i, params) for i, (name, params) in enumerate(CASES.items())]
    return cases + [(f"{name}_off", i, SamplingParams(**G)) for name, i, _ in cases if name.startswith("greedy_")]


def run(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Every request in one batch; outputs by case."""
    cases = requests()
    out: dict[str, list[int]] = {name: [] for name, _, _ in cases}
    for key, (name, i, params) in enumerate(cases):
        assert core.add_request(AddRequest(key, np.asarray(prompts[i]), params, name)) is None
    while core.scheduler.requests:
        for delta in core.step():
            out[cases[delta.key][0]].extend(delta.new_token_ids)
    return out


def core_for(speculator: str | None = None) -> EngineCore:
    return EngineCore(EngineConfig(platform="cpu", dtype="float32", max_model_len=256, speculator=speculator,
                                   num_speculative_tokens=3 if speculator else 4))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(p) for p in PROMPTS[: len(CASES)]]


@pytest.fixture(scope="module")
def plain(prompts) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    return run(core_for(), prompts)


def test_each_penalty_changes_what_the_model_says(plain) -> None:  # type: ignore[no-untyped-def]
    for name in CASES:
        if name.startswith("greedy_"):
            assert plain[name] != plain[f"{name}_off"], f"{name} changed nothing: the tests would prove nothing"
    # Negative penalties make it repeat itself.
    assert len(set(plain["greedy_repeat_more"])) < len(set(plain["greedy_repeat_more_off"]))


@pytest.mark.parametrize("name", SPECULATORS)
def test_speculation_under_penalties_is_lossless(name: str, prompts, plain) -> None:  # type: ignore[no-untyped-def]
    core = core_for(name)
    got = run(core, prompts)
    for case in got:
        assert got[case] == plain[case], case
    spec = core.stats()["spec"]
    assert spec["num_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"


def test_requests_without_penalties_never_count(prompts, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = []
    real = model_runner.count_history

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(model_runner, "count_history", counting)
    core = core_for("ngram")
    for key, (params, seen) in enumerate(((SamplingParams(**G), False), (CASES["seeded_frequency"], True))):
        calls.clear()
        assert core.add_request(AddRequest(key, np.asarray(prompts[0]), params, f"r{key}")) is None
        while core.scheduler.requests:
            core.step()
        assert bool(calls) == seen, key
