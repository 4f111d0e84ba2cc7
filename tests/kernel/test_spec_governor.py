"""The speculation governor: drafting stays on where it pays and turns itself off where it does
not, per batch size, still probing the other way now and then; greedy output never changes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.spec_governor import SpecGovernor, bucket
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest


def drive(gov: SpecGovernor, rows: int, drafted_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """Schedules `steps` steps; each reports the rate of its kind."""
    decisions = []
    for _ in range(steps):
        allowed = gov.allow(rows)
        decisions.append(allowed)
        gov.record(rows, allowed, tokens=int(100 * (drafted_rate if allowed else plain_rate)), seconds=100.0)
    return decisions


def test_buckets_group_batch_sizes_that_cost_alike() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_drafting_stays_on_while_it_pays_and_probes_plain_steps() -> None:
    gov = SpecGovernor(explore_every=8)
    decisions = drive(gov, 1, drafted_rate=3.0, plain_rate=1.0, steps=64)
    assert decisions[0], "drafting is measured first"
    assert not all(decisions[:16]) and any(decisions[:16]), "both kinds are measured first"
    assert sum(decisions[16:]) >= 40 and not all(decisions[16:]), "then mostly drafting, with plain probes"


def test_drafting_turns_off_where_it_does_not_pay_and_probes_back() -> None:
    gov = SpecGovernor(explore_every=8)
    decisions = drive(gov, 64, drafted_rate=0.5, plain_rate=1.0, steps=64)
    assert sum(decisions[16:]) <= 6, "off once both rates are known"
    assert any(decisions[16:]), "but it still drafts now and then, to notice when drafts pay again"
    assert gov.num_vetoed >= 40


def test_batch_sizes_decide_apart() -> None:
    gov = SpecGovernor(explore_every=8)
    for _ in range(64):
        for rows, drafted in ((1, 3.0), (64, 0.5)):
            allowed = gov.allow(rows)
            gov.record(rows, allowed, tokens=int(100 * (drafted if allowed else 1.0)), seconds=100.0)
    assert gov.allow(1) or gov.allow(1), "batch 1 drafts"
    assert sum(gov.allow(64) for _ in range(8)) <= 2, "batch 64 mostly does not"


def test_within_margin_drafting_stays_on() -> None:
    gov = SpecGovernor(margin=0.1, explore_every=1000)
    decisions = drive(gov, 4, drafted_rate=0.93, plain_rate=1.0, steps=40)
    assert all(decisions[16:])


def costed(plain_s: float, drafting_s: float, tokens_per_row: float,
           steps: int = 64) -> tuple[list[bool], SpecGovernor]:
    """A governor with step costs for batch 4 (as timed at start), fed the acceptance of every
    step that drafts."""
    gov = SpecGovernor(explore_every=8, min_samples=4)
    gov.step_costs = {4: (plain_s, drafting_s)}
    decisions = []
    for _ in range(steps):
        allowed = gov.allow(4)
        decisions.append(allowed)
        if allowed:
            gov.record_rows(100, round(100 * tokens_per_row))  # (a step's verifying rows, by the hundred)
    return decisions, gov


def test_with_step_costs_drafting_that_pays_never_spends_a_plain_step() -> None:
    # 2.5 tokens a row for 1.6x the step: 1.56 tokens per plain step's time.
    decisions, gov = costed(1.0, 1.6, 2.5)
    assert all(decisions) and gov.num_vetoed == 0


def test_with_step_costs_drafting_that_does_not_pay_stops_once_acceptance_is_known() -> None:
    # 2 tokens a row for 2.5x the step: 0.8 of a plain step's rate.
    decisions, gov = costed(1.0, 2.5, 2.0)
    assert all(decisions[:1]), "drafts until it has measured acceptance"
    later = decisions[8:]
    assert sum(later) == len(later) // 8, "then only every explore_every-th step drafts"
    assert gov.num_vetoed == len(decisions) - sum(decisions)


def test_with_step_costs_the_margin_keeps_drafting_within_five_percent() -> None:
    assert all(costed(1.0, 2.0, 1.92)[0]), "0.96 of plain: within the margin"
    assert not all(costed(1.0, 2.0, 1.86)[0]), "0.93 of plain: off"


def test_buckets_without_step_costs_measure_online() -> None:
    gov = SpecGovernor(explore_every=8)
    gov.step_costs = {1: (1.0, 1.1)}
    assert [gov.allow(64) for _ in range(4)] == [True, False, True, False], "batch 64 alternates to measure"


def run_engine(tune: Callable[[SpecGovernor], None] | None = None,
               **kw: object) -> tuple[dict[int, list[int]], EngineCore]:
    """Four greedy requests with repetitive prompts (ngram finds drafts) on a random tiny model;
    `tune` adjusts the engine's governor, if it has one, before they run."""
    rng = np.random.default_rng(5)
    prompts = [(rng.integers(0, 40, 6).tolist() * 4)[: 10 + 2 * i] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    core = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=128,
                                   max_num_seqs=4, num_kv_blocks=64, **kw))  # type: ignore[arg-type]
    if core.governor is not None and tune is not None:
        tune(core.governor)
    for key, p in enumerate(prompts):
        assert core.add_request(AddRequest(key, p, params)) is None
    out: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.key] += delta.new_token_ids
    return out, core


def test_engine_output_is_the_same_whatever_the_governor_decides() -> None:
    """A governor told that drafting pays (or never does) changes how many drafts run, never
    the greedy tokens."""

    def told(pays: bool) -> Callable[[SpecGovernor], None]:
        def tune(gov: SpecGovernor) -> None:
            gov.min_samples, gov.explore_every = 2, 64  # a short run: decide early
            gov.record = lambda rows, verified, tokens, seconds: SpecGovernor.record(  # type: ignore[method-assign]
                gov, rows, verified, 3 if verified == pays else 1, 1.0)
        return tune

    plain, _ = run_engine()
    spec = {"speculator": "ngram", "num_speculative_tokens": 3, "adaptive_speculation": True}
    paying, on = run_engine(told(True), **spec)
    losing, off = run_engine(told(False), **spec)
    assert paying == plain and losing == plain
    drafted_on, drafted_off = (c.stats()["spec"]["num_draft_tokens"] for c in (on, off))
    assert drafted_on > 0 and drafted_off < drafted_on / 2, (drafted_on, drafted_off)
    assert off.stats()["spec"]["num_governor_vetoes"] > 0 and off.stats()["spec"]["num_k0_steps"] > 0


def test_engine_with_step_costs_that_say_drafting_loses_runs_k0_steps_and_keeps_the_output() -> None:
    """Costs as the start-up timing would give them for every batch size: drafting at 10x the
    plain step's cost never pays, so once acceptance is measured the steps run K=0; the greedy
    tokens are the plain run's."""

    def losing(gov: SpecGovernor) -> None:
        gov.step_costs = {b: (1.0, 10.0) for b in (1, 2, 4)}
        gov.min_samples = 2

    plain, _ = run_engine()
    spec = {"speculator": "ngram", "num_speculative_tokens": 3}
    assert run_engine(**spec)[1].governor is None, "no step graphs on the CPU: no governor unless asked for"
    governed, core = run_engine(losing, adaptive_speculation=True, **spec)
    assert governed == plain
    stats = core.stats()["spec"]
    assert stats["num_governor_vetoes"] > 10 and stats["num_k0_steps"] > 10, stats
    assert core.governor is not None and core.governor.num_verified_rows > 0


def test_with_step_costs_a_drafter_that_pays_on_average_is_not_switched_off_by_a_dry_run() -> None:
    """Batch 1, one row a step: runs of 20 steps that find no draft (1 token) alternate with 20
    that find them all (4 tokens), 2.5 a row on average for 1.3x a plain step. A per-step
    moving average dips below the line in every dry run and waits for an exploration step."""
    gov = SpecGovernor(explore_every=32)
    gov.step_costs = {1: (1.0, 1.3)}
    decisions = []
    for step in range(640):
        allowed = gov.allow(1)
        decisions.append(allowed)
        if allowed:
            gov.record_rows(1, 1 if (step // 20) % 2 == 0 else 4)
    assert gov.num_vetoed <= len(decisions) // 20, f"{gov.num_vetoed} of {len(decisions)} steps vetoed"
