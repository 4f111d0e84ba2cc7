"""The block drafters (dflash, dspark): the serving pass computes what training computes, drafts
trim to a -1 suffix, propose and sync never wait for the device, the loss learns, the default
checkpoints fit the budget, and on the real model greedy output stays lossless."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.kit import RMSNorm
from speckernel.ops.paged_attention import PagedAttention
from speckernel.plugin import DeviceStates, ModelConfig, SpeculatorContext, TargetModel, TrainBatch, drafting_kind
from speckernel.speculators import learned
from speckernel.speculators.dflash import DFlashOptions, DFlashSpeculator, trim
from speckernel.speculators.dspark import DSparkOptions, DSparkSpeculator
from tests.conftest import fit

CLASSES = [DFlashSpeculator, DSparkSpeculator]
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position=256)
BS = 4
"""Cache block size of the crafted steps."""
NUM_BLOCKS = 12
TRASH_BLOCK = NUM_BLOCKS - 1
"""No table uses it: the test backend sends slot -1 there."""
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)


class NoSyncAttention(PagedAttention):
    """The shared paged plan and `attend`, with a write that never waits for the device: slot -1
    indexes the last slot (the trash block), where the kernel's backends skip it."""

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv[0][slot_mapping] = k.to(kv.dtype)
        kv[1][slot_mapping] = v.to(kv.dtype)


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "masked_scatter", "item"}


def tiny_target(seed: int = 0) -> TargetModel:
    torch.manual_seed(seed)
    embed = nn.Embedding(TINY.vocab_size, TINY.hidden_size).requires_grad_(False)
    return TargetModel(TINY, embed, RMSNorm(TINY.hidden_size, 1e-5),
                       lambda h: F.linear(h, embed.weight.to(h.dtype)).float(), None)


def tiny_speculator(cls, folder: Path, options: msgspec.Struct, **overrides):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    module = cls.new_drafter(TINY, 64, intermediate_size=64, **overrides)
    learned.save(folder, module.config, module)
    cfg = module.config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    ctx = SpeculatorContext(
        target=TINY, target_path=folder, device=torch.device("cpu"), dtype=torch.float32, block_size=BS,
        max_model_len=48, num_speculative_tokens=3, options=options, draft_model=str(folder),
        attention=NoSyncAttention(BS, 64, torch.device("cpu")), num_kv_blocks=NUM_BLOCKS,
        draft_kv=torch.zeros(NUM_BLOCKS * BS * per_token, dtype=torch.uint8), num_slots=4)
    return cls(ctx)


def crafted_step(spec, sequences: list[list[int]], ends: list[int], starts: list[int] | None = None,
                 sample: bool = True):  # type: ignore[no-untyped-def]
    """A prefill step: row r's query is positions starts[r]..ends[r] - 1 of sequences[r]; when
    `sample`, the target sampled sequences[r][ends[r]] (seq_len ends[r] + 1), else it is a
    non-final chunk (seq_len ends[r]). Plus a padding row and two padding tokens. Returns
    (states, per-row hidden {layer: [query length, H]}); the same random hidden for the same call."""
    torch.manual_seed(3 + sum(ends))
    starts = starts or [0] * len(ends)
    attention = NoSyncAttention(BS, 64, torch.device("cpu"), max_rows=4, max_blocks=6)
    tables = [[1 + 5 * r + i for i in range(5)] for r in range(len(sequences))]
    lens = [e - s for s, e in zip(starts, ends, strict=True)]
    meta = attention.prepare([(s, n, table) for s, n, table in zip(starts, lens, tables, strict=True)],
                             num_tokens=sum(lens) + 2, num_rows=len(sequences) + 1)
    tokens = torch.full((4, 40), 7, dtype=torch.int64)
    for r, seq in enumerate(sequences):
        tokens[r, : ends[r] + sample] = torch.tensor(seq[: ends[r] + sample])
    layers = spec.cfg.target_layers
    hidden = {layer: torch.randn(sum(lens) + 2, TINY.hidden_size) for layer in layers}
    offsets = [sum(lens[:r]) for r in range(len(lens))]
    per_row = [{layer: hidden[layer][o : o + n] for layer in layers} for o, n in zip(offsets, lens, strict=True)]
    rows = len(sequences) + 1
    states = DeviceStates(
        tokens=tokens, slot_index=torch.tensor([*range(len(sequences)), 3]), positions=meta.positions,
        accepted=torch.zeros(rows, dtype=torch.int64), seq_lens=torch.tensor([e + sample for e in ends] + [0]),
        samples=torch.tensor([sample] * len(sequences) + [False]), hidden=hidden, target=tiny_target(),
        attention=meta)
    return states, per_row


SEQS = [[(5 * i + 3) % 64 for i in range(20)], [(7 * i + 1) % 64 for i in range(20)]]


@pytest.mark.parametrize("cls", CLASSES)
def test_capabilities(cls) -> None:  # type: ignore[no-untyped-def]
    caps = cls.capabilities
    assert (caps.draft_width, caps.supports_k0, drafting_kind(cls), caps.max_k) == ("variable", True, "in_step", 15)
    assert caps.lookahead_slots_per_draft == 2 and caps.uses_target_weights


@pytest.mark.parametrize("cls,expected", [(DFlashSpeculator, 11_618_496), (DSparkSpeculator, 11_692_801)])
def test_default_checkpoint_fits_the_budget(cls, expected: int) -> None:  # type: ignore[no-untyped-def]
    module = cls.new_drafter(SMOLLM2, 16)
    names = set(module.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding",
            "layers.3.self_attn.k_proj.weight", "layers.3.mlp.down_proj.weight"} <= names
    assert module.config.target_layers == (1, 14, 26) and module.config.block_size == 8
    count = sum(t.numel() for t in module.state_dict().values())
    assert count == expected and 2 * count <= 24_000_000
    if cls is DSparkSpeculator:
        assert {"markov_down.weight", "markov_up.weight", "confidence.weight"} <= names
        assert module.config.rank == 64 and module.config.method == "dspark"


@pytest.mark.parametrize("cls", CLASSES)
def test_serving_block_pass_equals_training(cls, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The paged serving pass (context written by two prefill chunks, the block written past
    the anchor) gives the block hidden that the dense training pass gives for the same anchor."""
    spec = tiny_speculator(cls, tmp_path / "ckpt", cls.Options())
    anchors = [6, 9]
    first, first_hidden = crafted_step(spec, SEQS, [3, 5], sample=False)
    spec.sync(first)  # the K=0 pass of a non-final chunk
    states, last_hidden = crafted_step(spec, SEQS, anchors, starts=[3, 5])
    spec.sync(states)  # propose's context write, alone
    k = spec.cfg.block_size - 1
    served, anchor = spec._block(states, k)
    assert anchor[:2].tolist() == [SEQS[0][6], SEQS[1][9]]
    for r, a0 in enumerate(anchors):
        t = a0 + spec.cfg.block_size + 1
        hidden = {layer: torch.cat([first_hidden[r][layer], last_hidden[r][layer],
                                    torch.randn(t - a0, TINY.hidden_size)])[None] for layer in spec.cfg.target_layers}
        tokens = torch.tensor(SEQS[r][:t])[None]
        batch = TrainBatch(tokens=tokens, labels=tokens, mask=torch.ones_like(tokens, dtype=torch.bool),
                           hidden=hidden, kv={}, target=states.target)
        blocks = spec.module.train_blocks(batch, block_lens=torch.full((1, t), spec.cfg.block_size))
        assert blocks.anchors[0].tolist() == list(range(t))
        torch.testing.assert_close(served[r], blocks.hidden[0, a0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls", CLASSES)
def test_rows_that_do_not_sample_write_only_the_steps_tokens(cls, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_speculator(cls, tmp_path / "ckpt", cls.Options())
    states, _ = crafted_step(spec, SEQS, [6, 9])
    quiet = dataclasses.replace(states, samples=torch.zeros(3, dtype=torch.bool))
    spec.propose(quiet, 3)
    kv = spec.kv.view(spec.kv.shape[0], 2, NUM_BLOCKS, BS, -1)
    written = kv.abs().sum(dim=(0, 1, 4)) > 0  # [block, offset]
    expected = torch.zeros(NUM_BLOCKS, BS, dtype=torch.bool)
    for r, a0 in enumerate([6, 9]):  # only positions < a0 (the step's tokens), at the row's blocks
        for p in range(a0):
            expected[1 + 5 * r + p // BS, p % BS] = True
    assert torch.equal(written[:TRASH_BLOCK], expected[:TRASH_BLOCK])


def test_trim_ends_rows_at_the_first_dropped_draft() -> None:
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    keep = torch.tensor([[True, False, True], [True, True, True], [False, True, True]])
    assert trim(drafts, keep).tolist() == [[1, -1, -1], [4, 5, 6], [-1, -1, -1]]


@pytest.mark.parametrize("cls,cut,none_cut,trimmed", [
    (DFlashSpeculator, DFlashOptions(min_prob=1.0), DFlashOptions(min_prob=0.0), [-1, -1, -1]),
    (DSparkSpeculator, DSparkOptions(threshold=1.0), DSparkOptions(threshold=0.0), None),
])
def test_options_trim_to_a_minus_one_suffix_without_host_syncs(cls, cut, none_cut, trimmed, tmp_path: Path
                                                                ) -> None:  # type: ignore[no-untyped-def]
    full = tiny_speculator(cls, tmp_path / "a", none_cut)
    states, _ = crafted_step(full, SEQS, [6, 9])
    with Ops() as ops:
        full.sync(states)
        drafts = full.propose(states, 3).token_ids
    assert ops.names and not ops.names & SYNCS, ops.names & SYNCS
    assert drafts.shape == (3, 3) and drafts.dtype == torch.int64
    assert bool((drafts[:2] >= 0).all())
    spec = tiny_speculator(cls, tmp_path / "b", cut)
    states, _ = crafted_step(spec, SEQS, [6, 9])
    got = spec.propose(states, 3).token_ids[:2]
    for row, want in zip(got.tolist(), drafts[:2].tolist(), strict=True):
        # dflash: no probability reaches 1, so nothing is left; dspark keeps its first draft.
        assert row == (trimmed if trimmed is not None else [want[0], -1, -1])


def test_dspark_drafts_through_the_lifted_head_what_the_whole_head_drafts(tmp_path: Path) -> None:
    """dspark adds the Markov term's logits (its directions through the head, made once) to each
    position's head output: the drafts and confidences of one pass over the whole head per
    position, with a Markov term large enough to change the drafts."""
    spec = tiny_speculator(DSparkSpeculator, tmp_path / "ckpt", DSparkOptions(threshold=0.0))
    module, target = spec.module, tiny_target()
    assert target.head is not None
    torch.manual_seed(4)
    with torch.no_grad():
        module.markov_up.weight.normal_(0, 0.5)
    hidden, anchor = torch.randn(5, 7, TINY.hidden_size), torch.randint(0, TINY.vocab_size, (5,))
    for _ in range(2):  # the second draft uses the kept lift
        drafts, conf = module.draft(hidden, anchor, target)
        prev, want, want_conf = anchor, [], []
        for j in range(7):
            h = module.markov(hidden[:, j], prev, target)
            prev = target.head(h).argmax(dim=-1)
            want.append(prev)
            want_conf.append(torch.sigmoid(module.confidence(h).float()[:, 0]))
        assert torch.equal(drafts, torch.stack(want, dim=1))
        torch.testing.assert_close(conf, torch.stack(want_conf, dim=1))
    no_markov = target.head(hidden.reshape(35, -1)).view(5, 7, -1).argmax(dim=-1)
    assert not torch.equal(drafts[:, 1:], no_markov[:, 1:]), "the Markov term changed no draft"


def synthetic_batch(target: TargetModel, layers: tuple[int, ...]) -> TrainBatch:
    """Sequences where each token determines the next (t -> 3t + 1 mod V): every block position
    is predictable from its anchor. Random hidden states, masked first positions."""
    torch.manual_seed(2)
    b, t, v = 4, 40, TINY.vocab_size
    tokens = torch.empty(b, t, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, v, (b,))
    for p in range(1, t):
        tokens[:, p] = (3 * tokens[:, p - 1] + 1) % v
    labels = (3 * tokens + 1) % v
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, :3] = False
    hidden = {layer: torch.randn(b, t, TINY.hidden_size) for layer in layers}
    return TrainBatch(tokens=tokens, labels=labels, mask=mask, hidden=hidden, kv={}, target=target)


@pytest.mark.parametrize("cls", CLASSES)
def test_loss_decreases(cls) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    module = cls.new_drafter(TINY, 64, intermediate_size=64, **({"rank": 8} if cls is DSparkSpeculator else {}))
    batch = synthetic_batch(tiny_target(), module.config.target_layers)
    losses, figures = fit(module, batch)
    assert {"acc", "acc_1"} <= set(figures)
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


# --- on the real default model ---------------------------------------------------------------------


def core_for(speculator: str | None = None, **kw) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(EngineConfig(platform="cpu", max_model_len=512, speculator=speculator, **kw))


# Greedy losslessness with the shipped checkpoints: tests/test_speculative.py (every built-in).


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_k_past_the_block_is_rejected_at_start(name: str) -> None:
    with pytest.raises(InvalidInputError, match="at most 7"):
        core_for(name, num_speculative_tokens=8)
