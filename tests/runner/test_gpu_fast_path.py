"""The fast path on a real GPU: graphs and Triton kernels give the eager path's greedy output in
float32, and steady-state decode steps launch without a single host synchronisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 40


def prompts(tokenizer, texts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [tokenizer.encode(t) for t in texts]


def run(core: EngineCore, ids: list[list[int]], params: SamplingParams) -> dict[int, list[int]]:
    for key, p in enumerate(ids):
        core.add_request(AddRequest(key, p, params))
    out: dict[int, list[int]] = {key: [] for key in range(len(ids))}
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.key] += delta.new_token_ids
    return out


def config(eager: bool, **kw: object) -> EngineConfig:
    return EngineConfig(platform="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, num_kv_blocks=512,
                        enforce_eager=eager, in_process=True, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{}, {"speculator": "ngram", "num_speculative_tokens": 4}])
def test_graphs_give_the_eager_greedy_output_in_float32(model_path: Path, tokenizer, spec: dict) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import PROMPTS

    ids = prompts(tokenizer, PROMPTS[:12])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    eager = run(EngineCore(config(True, **spec)), ids, params)
    core = EngineCore(config(False, **spec))
    fast = run(core, ids, params)
    assert core.runner.graphs is not None and core.runner.graphs.num_replays > 0, "graphs ran"
    assert fast == eager
    assert 0 < core.stats()["device_s"] < 60, "the steps' device time, from their events"


@pytest.mark.slow
def test_steady_state_decode_launches_without_host_sync(model_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(config(False))
    for key, p in enumerate(prompts(tokenizer, ["The capital of France is", "def fibonacci(n):"])):
        core.add_request(AddRequest(key, p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    for _ in range(4):  # prefill, then the first decode steps
        core.step()
    assert replayed_without_host_sync(core, 16) == 16


def replayed_without_host_sync(core: EngineCore, steps: int, constrained: bool = False) -> int:
    """Schedules and launches `steps` steps one at a time, each launch under the device's sync
    check (a host synchronisation raises); returns the graph replays among them."""
    assert core.runner.graphs is not None
    before = core.runner.graphs.num_replays
    for _ in range(steps):
        frame = core.scheduler.schedule()
        assert frame is not None and (not constrained or all(r.token_bitmask for r in frame.rows))
        core.ledger.submit(frame)
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = core.runner.launch(frame)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        core.ledger.apply(pending.result())
    return core.runner.graphs.num_replays - before


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{}, {"speculator": "mtp", "num_speculative_tokens": 3}])
def test_prompts_arriving_while_others_decode_never_leave_the_graphs(model_path: Path, tokenizer,  # type: ignore[no-untyped-def]
                                                                     spec: dict) -> None:
    """Requests that arrive while others decode: each prompt runs in a step of its own, so every
    step of the run replays a captured graph (a prompt mixed into decode rows ran eagerly), and
    the output equals the eager engine's, which mixes them."""
    from tests.conftest import PROMPTS

    ids = prompts(tokenizer, PROMPTS[:12])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    core = EngineCore(config(False, **spec))
    assert core.scheduler.prompt_tokens_apart == 512
    if spec:  # the governor's step costs, timed on the graphs at start (an in-step drafter)
        assert core.governor is not None and sorted(core.governor.step_costs) == [1, 2, 4, 8, 16]
        # Measured, not nonsense: a bound loose enough for a GPU shared with other test workers.
        assert all(0 < plain < 1.0 and 0 < drafting < 1.0 for plain, drafting in core.governor.step_costs.values())
    out: dict[int, list[int]] = {key: [] for key in range(len(ids))}
    for key, p in enumerate(ids):
        core.add_request(AddRequest(key, p, params))
        for _ in range(3):  # the next prompt arrives while these decode
            for delta in core.step():
                out[delta.key] += delta.new_token_ids
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.key] += delta.new_token_ids
    stats = core.stats()
    assert stats["num_graph_steps"] == stats["num_steps"], stats
    assert out == run(EngineCore(config(True, **spec)), ids, params)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{}, {"speculator": "mtp", "num_speculative_tokens": 3}])
def test_a_burst_of_prompts_shares_graph_steps(model_path: Path, tokenizer, spec: dict) -> None:  # type: ignore[no-untyped-def]
    """Twelve requests at once: their prompts share several-prompt graph steps (fewer prompt
    steps than prompts), every step of the run replays a graph, and the output equals the
    eager engine's."""
    from tests.conftest import PROMPTS

    ids = prompts(tokenizer, PROMPTS[:12])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    core = EngineCore(config(False, **spec))
    assert core.scheduler.prompt_batch == (16, 2048)
    steps: list[int] = []
    schedule = core.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        frame = schedule()
        if frame is not None:
            steps.append(sum(r.num_tokens - r.num_drafts > 1 for r in frame.rows))
        return frame

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    out = run(core, ids, params)
    stats = core.stats()
    assert stats["num_graph_steps"] == stats["num_steps"], stats
    assert max(steps) > 1 and sum(n > 0 for n in steps) < len(ids), steps
    assert out == run(EngineCore(config(True, **spec)), ids, params)


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("ngram", 4), ("mtp", 3), ("dflash", 7)])
def test_speculative_requests_run_ahead_without_host_sync(model_path: Path, tokenizer, name: str, k: int) -> None:  # type: ignore[no-untyped-def]
    """An in-step speculator drafts inside the step (ngram without a model, mtp fixed width,
    dflash variable width): the next step of each request is launched while the current one
    runs, planned as if every draft is accepted, and no launch of a decode or verification step
    waits for the device. Greedy output equals the eager engine's."""
    from collections import deque

    from tests.conftest import PROMPTS

    spec = {"speculator": name, "num_speculative_tokens": k}
    ids = prompts(tokenizer, PROMPTS[:4])
    params = SamplingParams(max_tokens=64, temperature=0.0)
    core = EngineCore(config(False, **spec))
    assert core.scheduler.spec is not None and core.scheduler.spec.run_ahead
    for key, p in enumerate(ids):
        core.add_request(AddRequest(key, p, params))
    out: dict[int, list[int]] = {key: [] for key in range(len(ids))}
    in_flight: deque = deque()
    checked = shifted = 0
    while core.scheduler.requests or in_flight:
        while len(in_flight) < 2 and (frame := core.scheduler.schedule()) is not None:
            core.ledger.submit(frame)
            decode = all(r.sampling is not None and r.num_tokens == 1 + r.num_drafts for r in frame.rows)
            if decode:
                torch.cuda.set_sync_debug_mode("error")
            try:
                in_flight.append((frame, core.runner.launch(frame)))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked += decode
            shifted += sum(r.shifted for r in frame.rows)
        frame, pending = in_flight.popleft()
        for delta in core._apply(pending.result(), frame):
            out[delta.key] += delta.new_token_ids
    assert checked > 20 and shifted > 10
    assert core.stats()["spec"]["num_host_draft_copies"] == 0
    assert out == run(EngineCore(config(True, **spec)), ids, params)


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("mtp", 3), ("eagle3", 5), ("dflash", 7), ("dspark", 7), ("causal_cascade", 7)])
def test_learned_drafters_accept_as_much_alone_as_in_a_batch(name: str, k: int, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A drafter's passes see one row at batch 1 and many in a batch; they must draft the same.
    (Batch 1 once read a row's context length past a stride-0 view: block drafters accepted
    next to nothing there, and only there.)"""
    from tests.conftest import PROMPTS, run_to_completion

    ids = prompts(tokenizer, PROMPTS[:8])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    batched = EngineCore(config(False, speculator=name, num_speculative_tokens=k))
    together = run_to_completion(batched, ids, params)
    alone_core = EngineCore(config(False, speculator=name, num_speculative_tokens=k))
    alone = [run_to_completion(alone_core, [p], params)[0] for p in ids]
    assert alone == together
    a, b = alone_core.stats()["spec"], batched.stats()["spec"]
    assert a["num_accepted_tokens"] > 0
    assert abs(a["mean_acceptance_length"] - b["mean_acceptance_length"]) < 0.1 * b["mean_acceptance_length"], (a, b)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{}, {"speculator": "mtp", "num_speculative_tokens": 3}])
def test_structured_steps_replay_graphs_and_equal_the_eager_engine(model_path: Path, tokenizer,  # type: ignore[no-untyped-def]
                                                                   spec: dict) -> None:
    """Prompt, decode and verification steps with a grammar replay the graphs captured with the
    token masks, the output equals the eager engine's in float32, and a constrained decode step
    launches without a host synchronisation."""
    from speckernel.sampling_params import StructuredOutput

    structured = StructuredOutput.of_schema(SCHEMA)
    ids = prompts(tokenizer, ["Describe a person as JSON:", "A user record in JSON:", "JSON for a cat:"])
    params = SamplingParams(max_tokens=48, temperature=0.0, structured=structured)
    eager = run(EngineCore(config(True, **spec)), ids, params)
    core = EngineCore(config(False, **spec))
    assert core.runner.graphs is not None and any(s.constrained for s in core.runner.graphs.graphs)
    fast = run(core, ids, params)
    assert fast == eager
    steps = core.stats()
    assert steps["num_steps"] - steps["num_graph_steps"] <= len(ids), "the constrained steps replayed"
    core.add_request(AddRequest(9, ids[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True,
                                                          structured=StructuredOutput(regex="[a-z ]{150,190}"))))
    for _ in range(3):
        core.step()
    assert replayed_without_host_sync(core, 8, constrained=True) == 8


@pytest.mark.slow
def test_constrained_rows_run_ahead_on_split_graphs_and_equal_rows_that_wait(model_path: Path,  # type: ignore[no-untyped-def]
                                                                             tokenizer) -> None:
    """Through the core's loop (two frames in flight): constrained rows run ahead, their steps
    replay the graphs split between forward and sampling, the masks go in behind the stream's
    gate, and the output equals the engine whose constrained rows wait for their frames (float32)."""
    from speckernel.sampling_params import StructuredOutput
    from tests.engine.pipeline_util import run_loop

    ids = prompts(tokenizer, ["Describe a person as JSON:", "A user record in JSON:", "JSON for a cat:"])
    params = SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredOutput.of_schema(SCHEMA))
    outs, stats = [], []
    for late in (False, True):
        core = EngineCore(config(False, late_masks=late))
        try:
            outs.append(run_loop(core, ids, params))
            stats.append(core.stats())
        finally:
            core.close()
    assert outs[1] == outs[0]
    waited, ahead = stats
    assert ahead["num_late_mask_steps"] > 0 and waited["num_late_mask_steps"] == 0
    assert ahead["num_steps"] - ahead["num_graph_steps"] <= len(ids), "the run-ahead constrained steps replayed"
    assert 0 <= ahead["late_mask_wait_s"] < ahead["uptime_s"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{}, {"speculator": "mtp", "num_speculative_tokens": 3}])
def test_steps_with_penalties_and_logprobs_replay_graphs_and_equal_the_eager_engine(  # type: ignore[no-untyped-def]
        model_path: Path, tokenizer, spec: dict) -> None:
    """Decode and verification steps where rows have penalties or ask for logprobs replay the
    graphs captured for them: tokens equal the eager engine's in float32, logprobs up to the
    last bits, and such a step launches without a host synchronisation."""
    from speckernel.engine.core import EngineCore as Core

    ids = prompts(tokenizer, ["Write a story about a dog:", "List ten fruits:", "Count from one to twenty:"])
    params = [SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, logprobs=3),
              SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.8),
              SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)]

    def outputs(core: Core) -> dict[int, tuple[list[int], list[list[float]]]]:
        for key, (p, sp) in enumerate(zip(ids, params, strict=True)):
            core.add_request(AddRequest(key, p, sp))
        out: dict[int, tuple[list[int], list[list[float]]]] = {key: ([], []) for key in range(len(ids))}
        while core.scheduler.requests:
            for delta in core.step():
                out[delta.key][0].extend(delta.new_token_ids)
                out[delta.key][1].extend([lp.logprob, *lp.top_logprobs] for lp in delta.logprobs or [])
        return out

    eager = outputs(Core(config(True, **spec)))
    core = Core(config(False, **spec))
    assert core.runner.graphs is not None and any(s.any_penalty for s in core.runner.graphs.graphs)
    fast = outputs(core)
    assert {k: v[0] for k, v in fast.items()} == {k: v[0] for k, v in eager.items()}
    for key in fast:
        assert len(fast[key][1]) == len(eager[key][1])
        for a, b in zip(fast[key][1], eager[key][1], strict=True):
            assert a == pytest.approx(b, abs=1e-3)
    steps = core.stats()
    assert steps["num_steps"] - steps["num_graph_steps"] <= len(ids), "the decode steps replayed"
    core.add_request(AddRequest(9, ids[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True,
                                                          presence_penalty=0.5, logprobs=2)))
    for _ in range(3):
        core.step()
    assert replayed_without_host_sync(core, 8) == 8
