"""Padded, replayed steps (what device graphs run) equal plain eager steps, token for token.

The CPU has no device graphs, so the graph here is a double that replays the captured call on
the metadata it was captured with: exactly what a real graph does with its captured tensor
addresses. What it proves is the part that is the project's: the host refills the plan
buffer at the captured offsets, padding rows and tokens write no KV and no token a request
reads, buckets are picked right, and a step's outputs reach the ledger unchanged. Attention
runs the project's Triton kernels (under the interpreter without a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import torch

from speckernel.attention import AttentionMetadata
from speckernel.kernel.frame import ScheduledRow, StepFrame, StepResult
from speckernel.model_config import ModelConfig
from speckernel.models.llama import LlamaModel
from speckernel.ops.paged_attention import TritonPagedAttention
from speckernel.runner.model_runner import ModelRunner
from speckernel.runner.step_graphs import SAMPLING_KINDS, StepGraphs, row_buckets
from speckernel.runner.step_shape import DeviceOutputs, StepShape
from speckernel.sampling_params import RowSampling

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

# The project's Triton kernels run on the GPU where there is one, in the interpreter elsewhere.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position=96)  # head_dim >= 16: the smallest tl.dot tile on a GPU
SLOTS, MAX_LEN, K = 5, 64, 2


class ReplayGraph:
    """A DeviceGraph double: replay() runs the captured call again and writes its outputs into
    the tensors of its first run, as a real graph writes its static outputs. Recording runs
    nothing: a real capture's run on a padding plan is not what these tests assert, and each
    interpreted step costs seconds."""

    def __init__(self, call: Callable[[], DeviceOutputs]) -> None:
        self.call = call
        self.out: DeviceOutputs | None = None

    def replay(self) -> DeviceOutputs:
        new = self.call()
        if self.out is None:
            self.out = new
        else:
            self.out.packed.copy_(new.packed)
            if self.out.drafts is not None:
                assert new.drafts is not None
                self.out.drafts.copy_(new.drafts)
        return self.out

    def pool(self) -> object:
        return None


class ReplayGraphs(StepGraphs):
    kinds: tuple[tuple[bool, bool], ...] = SAMPLING_KINDS
    """The sampling kinds to capture: a test's steps use few, and each interpreted capture costs."""

    def shapes(self) -> list[StepShape]:
        return [s for s in super().shapes() if (s.all_greedy, s.any_filter) in self.kinds]

    def _record(self, meta: AttentionMetadata, shape: StepShape) -> tuple[ReplayGraph, None]:  # type: ignore[override]
        return ReplayGraph(lambda: self.runner.device_step(meta, shape)), None

    def replay(self, shape: StepShape, between: Callable[[], None] | None = None) -> DeviceOutputs:
        assert between is None, "a double's graph does not split"
        graph, _ = self.graphs[shape]
        self.num_replays += 1
        return graph.replay()  # type: ignore[return-value]


class NoGraphPlatform:
    def graph_capture(self, pool: object | None = None) -> contextlib.AbstractContextManager[object]:
        raise AssertionError("the double records without the platform")

    def synchronize(self) -> None:
        pass


def runner(graphs: bool, prefill: tuple[int, ...] = (), fused: bool = False,
           batches: tuple[tuple[int, int], ...] = (), verify: tuple[int, ...] = (0, K),
           kinds: tuple[tuple[bool, bool], ...] = SAMPLING_KINDS, constrained: tuple[int, ...] = (),
           full_sampling: tuple[int, ...] = ()) -> ModelRunner:
    """fused: the model's Triton kernels, so decode and verification steps (at most 16 tokens) run
    on the small-batch kernels, padding tokens included. batches: (rows, tokens) of several-prompt
    steps. verify and kinds: the verify widths and sampling kinds captured (the steps a test runs);
    constrained and full_sampling: the verify widths captured with masks, and with penalties and logprobs."""
    torch.manual_seed(0)
    model = LlamaModel(TINY, MAX_LEN + K + 2).eval().to(DEV).use_triton_ops(fused)
    attention = TritonPagedAttention(BLOCK, 64, DEV, max_rows=SLOTS + 1, max_blocks=MAX_LEN // BLOCK + 1)
    r = ModelRunner(model, DEV, num_blocks=SLOTS * (MAX_LEN // BLOCK), block_size=BLOCK, attention=attention,
                    num_slots=SLOTS, max_model_len=MAX_LEN, num_speculative_tokens=K, max_num_tokens=64)
    if graphs:
        g = ReplayGraphs(r, NoGraphPlatform(), max_rows=SLOTS, verify_widths=verify,  # type: ignore[arg-type]
                         prefill_tokens=prefill, prompt_batches=batches, constrained=constrained,
                         full_sampling=full_sampling)
        g.kinds = kinds
        g.capture()
        r.graphs = g
    return r


def prompts_on_the_torch_path(r: ModelRunner, frame: StepFrame, fused: bool) -> StepResult:
    """Runs a step of prompts on the torch path, then sets the model's Triton kernels as `fused`
    says. With fused, what is compared is the steps after it, on the small-batch kernels; prompts
    of more than 16 tokens would take the fused path's kernels, a program per token, interpreted."""
    r.model.use_triton_ops(False)
    result = r.execute(frame)
    r.model.use_triton_ops(fused)
    return result


def same_kv(eager: ModelRunner, replayed: ModelRunner) -> None:
    """The same cache slots written (the cache starts at zero), with the same values up to the
    last bits (a padded batch runs its matmuls with another shape)."""
    written = eager.kv_cache.abs().sum(-1) != 0
    assert torch.equal(written, replayed.kv_cache.abs().sum(-1) != 0), "padding wrote no KV slot"
    torch.testing.assert_close(eager.kv_cache, replayed.kv_cache, rtol=1e-5, atol=1e-5)


def blocks(slot: int) -> list[int]:
    per = MAX_LEN // BLOCK
    return list(range(slot * per, (slot + 1) * per))


def sampling(slot: int, position: int) -> RowSampling:
    if slot % 2:
        return RowSampling(temperature=0.9, top_k=0 if slot == 1 else 5, top_p=1.0 if slot == 1 else 0.9,
                           seed=1000 + slot, position=position)
    return RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, position=position)


def test_row_buckets_cover_every_batch_with_little_padding() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(64)[:5] == [1, 2, 4, 8, 16] and row_buckets(64)[-1] == 64
    assert row_buckets(100)[-1] == 100 and all(b <= 100 for b in row_buckets(100))


@pytest.mark.parametrize(("greedy_only", "fused"), [(True, False), (False, False), (True, True)])
def test_replayed_padded_steps_equal_eager_steps(greedy_only: bool, fused: bool) -> None:
    kinds = ((True, False),) if greedy_only else SAMPLING_KINDS
    eager, replayed = runner(False, fused=fused), runner(True, fused=fused, verify=(0,), kinds=kinds)
    rng = np.random.default_rng(1)
    lens = {0: 5, 1: 9, 2: 3, 3: 17}
    prompts = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in lens.items()}

    def samp(slot: int, pos: int) -> RowSampling:
        return sampling(0 if greedy_only else slot, pos)

    frames = [StepFrame(0, [ScheduledRow(s, 0, s, 0, p, blocks(s), samp(s, 0)) for s, p in prompts.items()])]
    produced = {s: 0 for s in prompts}
    step = 1
    # Decode steps with 4, 3, 1 and 2 rows (padded to buckets 4, 4, 1, 2), each reading the
    # token the previous step sampled from the token buffer.
    for active in ([0, 1, 2, 3], [0, 2, 3], [1], [2, 3]):
        rows = []
        for s in active:
            produced[s] += 1
            start = lens[s] + produced[s] - 1
            rows.append(ScheduledRow(s, 0, s, start, [], blocks(s), samp(s, produced[s]), num_placeholder_inputs=1))
        frames.append(StepFrame(step, rows))
        step += 1
    results = {}
    for name, r in (("eager", eager), ("replayed", replayed)):
        out = [prompts_on_the_torch_path(r, frames[0], fused)]
        for frame in frames[1:]:
            out.append(r.execute(frame))
        results[name] = out
    for a, b in zip(results["eager"], results["replayed"], strict=True):
        assert [(x.key, x.sampled, x.num_accepted, x.error) for x in a.rows] == \
               [(x.key, x.sampled, x.num_accepted, x.error) for x in b.rows]
        assert all(x.sampled for x in a.rows)
    assert replayed.graphs is not None and replayed.graphs.num_replays == 4, "every decode step replayed"
    same_kv(eager, replayed)
    assert torch.equal(eager.pool.tokens[:SLOTS, :-1], replayed.pool.tokens[:SLOTS, :-1]), \
        "padding wrote no token a request reads"


@pytest.mark.parametrize(("drafts", "fused"), [((2, 1), False), ((1, 1), False), ((2, 1), True)])
def test_replayed_verification_equals_eager_verification(drafts: tuple[int, int], fused: bool) -> None:
    # Its verifying step holds greedy rows (slots 0 and 2) only.
    eager, replayed = runner(False, fused=fused), runner(True, fused=fused, verify=(K,), kinds=((True, False),))
    rng = np.random.default_rng(2)
    prompts = {0: rng.integers(0, 64, 6).tolist(), 2: rng.integers(0, 64, 11).tolist()}
    first = StepFrame(0, [ScheduledRow(s, 0, s, 0, p, blocks(s), sampling(s, 0)) for s, p in prompts.items()])
    outs = {}
    for name, r in (("eager", eager), ("replayed", replayed)):
        prompts_on_the_torch_path(r, first, fused)
        # Drafts sit right after each row's sampled token, as a speculator leaves them (they need
        # not be right: rejections are the point). With (1, 1) the step verifies fewer drafts
        # than the captured K: the replay pads its columns, the results must not move.
        r.pool.tokens[0, 7:9] = torch.tensor([3, 4])
        r.pool.tokens[2, 12] = 9
        frame = StepFrame(1, [
            ScheduledRow(0, 0, 0, 6, [], blocks(0), sampling(0, 1), num_draft_slots=drafts[0],
                         num_placeholder_inputs=1),
            ScheduledRow(2, 0, 2, 11, [], blocks(2), sampling(2, 1), draft_token_ids=[9][: drafts[1]],
                         num_placeholder_inputs=1)])
        outs[name] = r.execute(frame)
    assert outs["eager"] == outs["replayed"]
    assert all(0 <= row.num_accepted <= row.num_drafts for row in outs["replayed"].rows)
    assert replayed.graphs is not None and replayed.graphs.num_replays == 1
    same_kv(eager, replayed)


def bitmask(*allowed: set[int]) -> bytes:
    """ScheduledRow.token_bitmask allowing `allowed[j]` at sampled position j."""
    words = np.zeros((len(allowed), (TINY.vocab_size + 31) // 32), np.uint32)
    for j, tokens in enumerate(allowed):
        for t in tokens:
            words[j, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32).tobytes()


def test_replayed_constrained_steps_equal_eager_steps() -> None:
    """Steps with a grammar replay graphs of their own that read the runner's mask buffer: rows
    with and without a mask side by side, greedy and sampled, a decode step and a verification
    step whose positions allow different tokens, and fewer rows than the bucket (padding rows
    allow everything). Each constrained token is one its mask allows, and the replayed tokens
    are the eager ones."""
    eager, replayed = runner(False), runner(True, kinds=((True, False), (False, False)), constrained=(0, K))
    assert replayed.graphs is not None
    assert any(shape.constrained for shape in replayed.graphs.graphs)
    rng = np.random.default_rng(8)
    prompts = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in ((0, 6), (1, 9), (2, 11))}
    first = StepFrame(0, [ScheduledRow(s, 0, s, 0, p, blocks(s), sampling(s, 0)) for s, p in prompts.items()])
    a0, a1, a2 = {5, 17, 40}, {3, 60}, {7, 8, 9, 10}
    decode = StepFrame(1, [  # slot 1 samples (temperature 0.9) under its mask; slot 2 is free
        ScheduledRow(0, 0, 0, 6, [], blocks(0), sampling(0, 1), num_placeholder_inputs=1, token_bitmask=bitmask(a0)),
        ScheduledRow(1, 0, 1, 9, [], blocks(1), sampling(1, 1), num_placeholder_inputs=1, token_bitmask=bitmask(a2)),
        ScheduledRow(2, 0, 2, 11, [], blocks(2), sampling(2, 1), num_placeholder_inputs=1)])
    outs = {}
    for name, r in (("eager", eager), ("replayed", replayed)):
        first_out = r.execute(first)
        got = r.execute(decode)
        # Verification: slot 0 verifies one draft that its first position allows, its second
        # position allowing other tokens; slot 2 verifies a draft without a mask.
        draft0 = min(a1)
        r.pool.tokens[0, 8] = draft0
        r.pool.tokens[2, 13] = 9
        verify = StepFrame(2, [
            ScheduledRow(0, 0, 0, 7, [], blocks(0), sampling(0, 2), draft_token_ids=[draft0], num_placeholder_inputs=1,
                         token_bitmask=bitmask(a1, a0)),
            ScheduledRow(2, 0, 2, 12, [], blocks(2), sampling(2, 2), draft_token_ids=[9], num_placeholder_inputs=1)])
        outs[name] = (first_out, got, r.execute(verify))
    assert outs["eager"] == outs["replayed"]
    _, got, verified = outs["replayed"]
    assert got.rows[0].sampled[0] in a0 and got.rows[1].sampled[0] in a2
    row0 = verified.rows[0]
    assert row0.sampled[0] in a1 and (row0.num_accepted == 0 or row0.sampled[1] in a0)
    assert replayed.graphs.num_replays == 2, "both constrained steps replayed"
    same_kv(eager, replayed)


def test_replayed_constrained_prompt_steps_equal_eager_steps() -> None:
    """A prompt under a grammar samples its first token under the mask too: one-row prompt steps
    and a step of several prompts replay the graphs captured with the masks."""
    eager, replayed = runner(False), runner(True, prefill=(8, 16), batches=((2, 24),), verify=(0,),
                                            kinds=((True, False),), constrained=(0,))
    assert replayed.graphs is not None
    rng = np.random.default_rng(9)
    p = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in ((0, 5), (1, 12), (2, 9))}
    allowed = {0: {4, 33}, 1: {50}, 2: {6, 7, 61}}
    row = {s: ScheduledRow(s, 0, s, 0, p[s], blocks(s), sampling(0, 0), token_bitmask=bitmask(allowed[s])) for s in p}
    frames = [StepFrame(0, [row[0]]), StepFrame(1, [row[1]]),  # buckets 8 and 16
              StepFrame(2, [row[2], ScheduledRow(3, 0, 3, 0, [9, 8, 7], blocks(3), sampling(0, 0))])]  # (2, 24)
    outs = {name: [r.execute(f) for f in frames] for name, r in (("eager", eager), ("replayed", replayed))}
    assert outs["eager"] == outs["replayed"]
    got = [res.rows[0].sampled[0] for res in outs["replayed"]]
    assert [t in allowed[s] for s, t in zip((0, 1, 2), got, strict=True)] == [True, True, True], got
    assert replayed.graphs.num_replays == 3, "every prompt step replayed, masks and all"
    same_kv(eager, replayed)


def test_replayed_steps_with_penalties_and_logprobs_equal_eager_steps() -> None:
    """Steps where some row has a penalty or asks for logprobs replay graphs of their own that
    count tokens and compute every row's logprobs: a decode step and a verification step, rows
    with a penalty, with logprobs, with both and with neither side by side, greedy and sampled,
    fewer rows than the bucket. Tokens and logprobs are the eager ones (which count and compute
    only for the rows that need it)."""
    eager, replayed = runner(False), runner(True, kinds=((True, False), (False, False)), full_sampling=(0, K))
    assert replayed.graphs is not None
    assert any(shape.any_penalty and shape.logprobs >= 0 for shape in replayed.graphs.graphs)
    rng = np.random.default_rng(10)
    prompts = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in ((0, 7), (1, 10), (2, 5))}

    def row_sampling(slot: int, position: int, logprobs: int, penalties: bool = True) -> RowSampling:
        return msgspec.structs.replace(sampling(slot, position), logprobs=logprobs, **({
            # Negative: the tokens said so far pull ahead, so the penalties surely change the output.
            0: {"repetition_penalty": 1.8, "frequency_penalty": -100.0}, 1: {"presence_penalty": -100.0}, 2: {}
        }[slot] if penalties else {}))

    first = StepFrame(0, [ScheduledRow(s, 0, s, 0, p, blocks(s), sampling(s, 0)) for s, p in prompts.items()])
    decode = StepFrame(1, [  # slot 0: repetition penalty and logprobs; 1: frequency, sampled; 2: logprobs only
        ScheduledRow(0, 0, 0, 7, [], blocks(0), row_sampling(0, 1, 3), num_placeholder_inputs=1),
        ScheduledRow(1, 0, 1, 10, [], blocks(1), row_sampling(1, 1, -1), num_placeholder_inputs=1),
        ScheduledRow(2, 0, 2, 5, [], blocks(2), row_sampling(2, 1, 2), num_placeholder_inputs=1)])
    unpenalized = StepFrame(1, [msgspec.structs.replace(r, sampling=row_sampling(r.slot, 1, -1, penalties=False))
                                for r in decode.rows])
    plain = runner(False)
    plain.execute(first)
    eager.execute(first)
    assert [x.sampled for x in plain.execute(unpenalized).rows] != [x.sampled for x in eager.execute(decode).rows], \
        "the penalties change the tokens here (so equal tokens mean the graphs counted)"
    eager = runner(False)
    outs = {}
    for name, r in (("eager", eager), ("replayed", replayed)):
        first_out = r.execute(first)
        got = r.execute(decode)
        r.pool.tokens[0, 9] = 4
        r.pool.tokens[1, 12] = 8
        verify = StepFrame(2, [  # slot 0 verifies a draft under its penalty and logprobs; slot 1 one without
            ScheduledRow(0, 0, 0, 8, [], blocks(0), row_sampling(0, 2, 1), draft_token_ids=[4],
                         num_placeholder_inputs=1),
            ScheduledRow(1, 0, 1, 11, [], blocks(1), sampling(1, 2), draft_token_ids=[8], num_placeholder_inputs=1)])
        outs[name] = (first_out, got, r.execute(verify))
    for a, b in zip(outs["eager"], outs["replayed"], strict=True):  # logprobs up to the last bits (padded matmuls)
        assert [(x.key, x.sampled, x.num_accepted, x.error) for x in a.rows] == \
               [(x.key, x.sampled, x.num_accepted, x.error) for x in b.rows]
        for x, y in zip(a.rows, b.rows, strict=True):
            assert [lp.top_ids for lp in x.logprobs or []] == [lp.top_ids for lp in y.logprobs or []]
            assert [v for lp in x.logprobs or [] for v in (lp.logprob, *lp.top_logprobs)] == pytest.approx(
                [v for lp in y.logprobs or [] for v in (lp.logprob, *lp.top_logprobs)], abs=1e-5)
    _, got, verified = outs["replayed"]
    assert [len(x.logprobs or []) for x in got.rows] == [1, 0, 1]
    assert [len(lp.top_ids) for x in got.rows for lp in x.logprobs or []] == [3, 2]
    assert verified.rows[0].logprobs and verified.rows[1].logprobs is None
    assert replayed.graphs.num_replays == 2, "both steps replayed"
    same_kv(eager, replayed)


def test_constrained_steps_run_eagerly_without_their_graphs() -> None:
    """Graphs captured without masks never serve a step with a grammar (they would drop it)."""
    r = runner(True, verify=(0,), kinds=((True, False),))
    prompt = StepFrame(0, [ScheduledRow(0, 0, 0, 0, [1, 2, 3], blocks(0), sampling(0, 0))])
    r.execute(prompt)
    allowed = {11, 12}
    step = r.execute(StepFrame(1, [ScheduledRow(0, 0, 0, 3, [], blocks(0), sampling(0, 1), num_placeholder_inputs=1,
                                                token_bitmask=bitmask(allowed))]))
    assert step.rows[0].sampled[0] in allowed
    assert r.graphs is not None and r.graphs.num_replays == 0


def test_prefill_and_mixed_steps_run_eagerly_without_prompt_buckets() -> None:
    r = runner(True)
    frame = StepFrame(0, [ScheduledRow(0, 0, 0, 0, [1, 2, 3], blocks(0), sampling(0, 0))])
    r.execute(frame)
    assert r.graphs is not None and r.graphs.num_replays == 0, "a prefill step is not a captured shape"


def test_replayed_prompt_steps_equal_eager_steps() -> None:
    """One row's prompt pads to the next token bucket: whole prompts, a prompt in two chunks
    (the first samples nothing, the second starts past position 0), sampled rows; a prompt
    longer than every bucket and a step of two prompts run eagerly."""
    eager, replayed = runner(False), runner(True, prefill=(8, 16))
    rng = np.random.default_rng(4)
    p = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in ((0, 5), (1, 16), (2, 11), (3, 21), (4, 3))}
    frames = [
        StepFrame(0, [ScheduledRow(0, 0, 0, 0, p[0], blocks(0), sampling(0, 0))]),  # bucket 8
        StepFrame(1, [ScheduledRow(1, 0, 1, 0, p[1], blocks(1), sampling(1, 0))]),  # bucket 16, sampled
        StepFrame(2, [ScheduledRow(2, 0, 2, 0, p[2][:6], blocks(2), None)]),  # a first chunk: no sampling
        StepFrame(3, [ScheduledRow(2, 0, 2, 6, p[2][6:], blocks(2), sampling(2, 0))]),  # the rest, from 6
        StepFrame(4, [ScheduledRow(3, 0, 3, 0, p[3], blocks(3), sampling(3, 0))]),  # 21 > 16: eager
        StepFrame(5, [ScheduledRow(4, 0, 4, 0, p[4], blocks(4), sampling(4, 0)),  # two rows: eager
                      ScheduledRow(0, 0, 0, 5, [], blocks(0), sampling(0, 1), num_placeholder_inputs=1)]),
    ]
    outs = {name: [r.execute(f) for f in frames] for name, r in (("eager", eager), ("replayed", replayed))}
    assert outs["eager"] == outs["replayed"]
    assert [len(row.sampled) for res in outs["replayed"] for row in res.rows] == [1, 1, 0, 1, 1, 1, 1]
    assert replayed.graphs is not None and replayed.graphs.num_replays == 4, "four one-row prompt steps replayed"
    same_kv(eager, replayed)
    assert torch.equal(eager.pool.tokens[:SLOTS, :-1], replayed.pool.tokens[:SLOTS, :-1]), \
        "padding wrote no token a request reads"


def test_replayed_steps_of_several_prompts_equal_eager_steps() -> None:
    """Several prompts in one step pad to the next (rows, tokens) bucket: whole prompts, first
    chunks that sample nothing, and later chunks that start past position 0, side by side; a
    step with a row longer than the largest one-row bucket runs eagerly."""
    eager, replayed = runner(False), runner(True, prefill=(8, 16), batches=((2, 24), (4, 40)))
    rng = np.random.default_rng(6)
    p = {s: rng.integers(0, TINY.vocab_size, n).tolist() for s, n in ((0, 5), (1, 16), (2, 11), (3, 21), (4, 3))}
    frames = [
        StepFrame(0, [ScheduledRow(0, 0, 0, 0, p[0], blocks(0), sampling(0, 0)),  # 21 tokens, 2 rows: (2, 24)
                      ScheduledRow(1, 0, 1, 0, p[1], blocks(1), sampling(1, 0))]),
        StepFrame(1, [ScheduledRow(2, 0, 2, 0, p[2][:6], blocks(2), None),  # 25 tokens, 3 rows: (4, 40)
                      ScheduledRow(3, 0, 3, 0, p[3][:16], blocks(3), None),
                      ScheduledRow(4, 0, 4, 0, p[4], blocks(4), sampling(4, 0))]),
        StepFrame(2, [ScheduledRow(2, 0, 2, 6, p[2][6:], blocks(2), sampling(2, 0)),  # 10 tokens, 2 rows
                      ScheduledRow(3, 0, 3, 16, p[3][16:], blocks(3), sampling(3, 0))]),
        StepFrame(3, [ScheduledRow(0, 0, 0, 5, [], blocks(0), sampling(0, 1), num_placeholder_inputs=1),
                      ScheduledRow(1, 0, 1, 16, [], blocks(1), sampling(1, 1), num_placeholder_inputs=1)]),
    ]
    outs = {name: [r.execute(f) for f in frames] for name, r in (("eager", eager), ("replayed", replayed))}
    assert outs["eager"] == outs["replayed"]
    assert [len(row.sampled) for res in outs["replayed"] for row in res.rows] == [1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert replayed.graphs is not None and replayed.graphs.num_replays == 4, "every step replayed"
    same_kv(eager, replayed)
    assert torch.equal(eager.pool.tokens[:SLOTS, :-1], replayed.pool.tokens[:SLOTS, :-1]), \
        "padding wrote no token a request reads"
    eager_only = runner(True, prefill=(8,), batches=((2, 24),))  # a 16-token row is past the one-row bucket
    eager_only.execute(frames[0])
    assert eager_only.graphs is not None and eager_only.graphs.num_replays == 0


def graphs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU platform as a graph platform: Triton kernels (interpreted) and replayed doubles.
    Greedy graphs only: padding rows of a sampling graph race over garbage, which the
    interpreter refuses."""
    import msgspec

    from speckernel.platforms.cpu import CpuPlatform

    if DEV.type != "cpu":
        pytest.skip("the GPU runs real graphs (tests/test_gpu_fast_path.py)")
    monkeypatch.setattr(CpuPlatform, "capabilities",
                        msgspec.structs.replace(CpuPlatform.capabilities, triton=True, supports_graphs=True))
    monkeypatch.setattr(StepGraphs, "_record", ReplayGraphs._record)
    monkeypatch.setattr(StepGraphs, "replay", ReplayGraphs.replay)
    monkeypatch.setattr("speckernel.runner.step_graphs.SAMPLING_KINDS", ((True, False),))
    monkeypatch.setattr("speckernel.runner.step_graphs.PREFILL_BUCKETS", (32,))  # the prompts fit; interpreting is slow
    monkeypatch.setattr("speckernel.runner.step_graphs.PROMPT_BATCH_BUCKETS", ((4, 64),))
    # The kernel warm-up changes no token (tests/runner/test_kernel_warmup.py checks what it
    # builds); interpreted, it would only add a dozen steps to every engine's start.
    monkeypatch.setattr("speckernel.engine.core.EngineCore._warm_kernels", lambda self, runner, k: None)


NGRAM: dict[str, object] = {"speculator": "ngram", "num_speculative_tokens": 3}
MAX_TOKENS = (4, 6, 8, 10, 5)
"""The tokens each request asks for: rows finish at different steps, so decode steps of several
sizes replay, some padded to their bucket, the fifth prompt starts while the others decode, and
rows run ahead and move back on enough steps for a wrong move to show in the tokens."""


def engine_prompts() -> list[list[int]]:
    """Repetitive prompts, so that ngram finds matches of every length up to K; four of them
    (54 tokens) make a several-prompt step, the fifth (21) a one-row prompt step. With this seed
    the model's greedy tokens repeat too: ngram's drafts are accepted and rejected."""
    rng = np.random.default_rng(7)
    return [(rng.integers(0, 40, 5).tolist() * 4)[: 9 + 3 * i] for i in range(5)]


class EngineRun(NamedTuple):
    tokens: dict[int, list[int]]
    shifted: int
    """Rows planned ahead of their predecessor's result."""
    stats: dict[str, Any]
    replayed: list[tuple[StepShape, list[int]]]
    """Each replayed step's padded shape and its rows' draft counts."""
    runner: ModelRunner
    """Its KV cache and token buffer, compared after the run."""


def drive(core, depth: int) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    """Runs the core like its loop does, with up to `depth` frames in flight (1: the engine's own
    synchronous step); returns each request's tokens."""
    from collections import deque

    out: dict[int, list[int]] = {key: [] for key in core.scheduler.requests}
    if depth == 1:
        while core.scheduler.requests:
            for delta in core.step():
                assert delta.error is None, delta.error
                out[delta.key] += delta.new_token_ids
        return out
    in_flight: deque = deque()
    while core.scheduler.requests or in_flight:
        while len(in_flight) < depth and (frame := core.scheduler.schedule()) is not None:
            core.ledger.submit(frame)
            in_flight.append((frame, core.runner.launch(frame)))
        frame, pending = in_flight.popleft()
        for delta in core._apply(pending.result(), frame):
            assert delta.error is None, delta.error
            out[delta.key] += delta.new_token_ids
    return out


class EngineRuns:
    """Each engine configuration runs once per module, on the same requests (each run interprets
    every kernel of every step, seconds each): the plain eager engine is the reference of the
    plain replayed one and of greedy run-ahead, the eager ngram engine that of the replayed ngram
    engine, which is also the engine that waits for every step that greedy run-ahead must equal."""

    def __init__(self) -> None:
        self.runs: dict[tuple, EngineRun] = {}

    def __call__(self, config: dict[str, object], depth: int = 1, temperature: float = 0.0,
                 requests: int = len(MAX_TOKENS)) -> EngineRun:
        """The run of an engine of this config (EngineConfig fields) with up to `depth` steps in
        flight, on the first `requests` requests."""
        key = (depth, temperature, requests, tuple(sorted(config.items())))
        if key not in self.runs:
            with pytest.MonkeyPatch.context() as mp:
                graphs_on_the_cpu(mp)
                self.runs[key] = self._run(mp, depth, temperature, requests, config)
        return self.runs[key]

    @staticmethod
    def _run(mp: pytest.MonkeyPatch, depth: int, temperature: float, requests: int,
             config: dict[str, object]) -> EngineRun:
        from speckernel.config import EngineConfig
        from speckernel.engine.core import EngineCore
        from speckernel.sampling_params import SamplingParams
        from speckernel.wire.messages import AddRequest

        # No governor: it would time the interpreted graphs at start, and its verdicts on such
        # timings would decide which steps draft. One layer: graphs, padding and speculation act
        # on the step, each layer alike, and each interpreted layer costs as much again.
        core = EngineCore(EngineConfig(model="random:tiny,num_layers=1", platform="cpu", dtype="float32",
                                       max_model_len=96, max_num_seqs=4, num_kv_blocks=48,
                                       adaptive_speculation=False, **config))  # type: ignore[arg-type]
        for key, p in enumerate(engine_prompts()[:requests]):
            params = SamplingParams(max_tokens=MAX_TOKENS[key], temperature=temperature, seed=key, ignore_eos=True)
            assert core.add_request(AddRequest(key, p, params)) is None
        frames: list[StepFrame] = []
        replayed: list[tuple[StepShape, list[int]]] = []
        schedule, replay = core.scheduler.schedule, StepGraphs.replay

        def scheduled() -> StepFrame | None:
            frame = schedule()
            if frame is not None:
                frames.append(frame)
            return frame

        def recorded(self: StepGraphs, shape: StepShape) -> DeviceOutputs:
            # A frame is launched as soon as it is scheduled, in either loop.
            replayed.append((shape, [row.num_drafts for row in frames[-1].rows]))
            return replay(self, shape)

        core.scheduler.schedule = scheduled  # type: ignore[method-assign]
        mp.setattr(StepGraphs, "replay", recorded)
        tokens = drive(core, depth)
        shifted = sum(row.shifted for frame in frames for row in frame.rows)
        return EngineRun(tokens, shifted, core.stats(), replayed, core.runner)


@pytest.fixture(scope="module")
def engine_runs() -> EngineRuns:
    return EngineRuns()


@pytest.mark.parametrize("spec", [{}, NGRAM])
def test_engine_with_replayed_graphs_equals_the_eager_engine(spec: dict[str, object], engine_runs: EngineRuns) -> None:
    """The whole engine (scheduler, ledger, runner, graphs) on a small random model: replayed
    prompt, decode and verification steps, padding rows and variable-width drafts included, give
    the eager tokens."""
    eager, replayed = engine_runs({"enforce_eager": True, **spec}), engine_runs(spec)
    assert replayed.stats["num_graph_steps"] > 0
    assert replayed.tokens == eager.tokens
    same_kv(eager.runner, replayed.runner)
    slots = replayed.runner.num_slots  # the spare row and column take what padding writes
    assert torch.equal(eager.runner.pool.tokens[:slots, :-1], replayed.runner.pool.tokens[:slots, :-1]), \
        "padding wrote no token a request reads"
    # What the requests are for: every kind of step, and rows of padding, replayed.
    assert any(not shape.decode_like for shape, _ in replayed.replayed), "a prompt step replayed"
    decode = [(shape.rows, len(drafts)) for shape, drafts in replayed.replayed if shape.decode_like]
    assert len({rows for rows, _ in decode}) > 1 and any(rows > n for rows, n in decode), decode
    if spec:
        widths = {n for shape, drafts in replayed.replayed if shape.verify_width for n in drafts}
        assert {0, 1, 2, 3} <= widths, f"rows verifying every number of draft slots: {widths}"
        counts = replayed.stats["spec"]
        assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"], "drafts accepted and rejected"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_run_ahead_speculation_equals_waiting_for_each_step(temperature: float, engine_runs: EngineRuns) -> None:
    """With a device-only speculator the next step of a speculative request is launched before
    the accepted counts of the one in flight reach the host: planned as if every draft was
    accepted, moved back on the device by what was rejected. Its tokens equal those of an
    engine that waits for every step (seeded sampling included: the sampling index moves back
    too), greedy ones equal plain decoding, and no draft ID ever reaches the host. Greedy graphs
    only: sampled steps run eagerly, shifted rows and all."""
    # Sampled, three requests suffice: ngram's slots hold only padding there (below), so every
    # row that runs ahead moves back, sampling index and all.
    requests = 3 if temperature else len(MAX_TOKENS)
    ahead = engine_runs(NGRAM, depth=2, temperature=temperature, requests=requests)
    assert ahead.shifted > 0, "no row ran ahead"
    stats = ahead.stats
    assert stats["spec"]["num_host_draft_copies"] == 0
    # Greedy drafts and accepts (repetitive prompts). Sampled tokens of this random model repeat no
    # n-gram, so ngram's slots hold only padding, which the counters do not count as drafts: there
    # every shifted row moves back by all K slots, and its sampling index with it.
    assert stats["spec"]["num_draft_tokens"] > 0 or temperature > 0
    assert stats["spec"]["num_accepted_tokens"] > 0 or temperature > 0
    assert stats["num_graph_steps"] > 0 or temperature > 0
    waiting = engine_runs(NGRAM, temperature=temperature, requests=requests)
    assert waiting.shifted == 0
    assert ahead.tokens == waiting.tokens
    if temperature == 0.0:
        assert ahead.tokens == engine_runs({"enforce_eager": True}).tokens
