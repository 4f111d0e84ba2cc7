"""causal_cascade: serving reads the target's KV exactly as training does, rows that cannot run
draft nothing, the loss learns, the default checkpoint fits its budget, and greedy output on
the real default model is lossless."""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F

from speckernel.ops.paged_attention import TorchPagedAttention
from speckernel.plugin import (
    DeviceStates,
    InvalidInputError,
    ModelConfig,
    SpeculatorContext,
    TargetModel,
    TrainBatch,
    drafting_kind,
)
from speckernel.speculators import learned
from speckernel.speculators.causal_cascade import (
    CausalCascadeOptions,
    CausalCascadeSpeculator,
    pick_drafts,
    runnable,
)
from tests.conftest import fit

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

C = CausalCascadeSpeculator
TINY = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8)
BS = 4
MAX_MODEL_LEN = 40
TABLE_BLOCKS = 16


def tiny_ctx(folder: Path, k: int = 3, min_prob: float = 0.0) -> SpeculatorContext:
    return SpeculatorContext(
        target=TINY, target_path=Path("."), device=torch.device("cpu"), dtype=torch.float32, block_size=BS,
        max_model_len=MAX_MODEL_LEN, num_speculative_tokens=k, options=CausalCascadeOptions(min_prob=min_prob),
        draft_model=str(folder), attention=TorchPagedAttention(BS, 64, torch.device("cpu")))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    module = C.new_drafter(TINY, MAX_MODEL_LEN)
    learned.save(folder, module.config, module)
    return folder


class FakeTarget:
    """A target's KV cache (random rows), embedding and head, laid out as the kernel keeps them."""

    def __init__(self, rows: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = rows
        slots = rows * TABLE_BLOCKS * BS
        self.kv_cache = torch.randn(TINY.num_layers, 2, slots, TINY.num_kv_heads, TINY.head_dim, generator=g)
        self.embed = torch.nn.Embedding(TINY.vocab_size, TINY.hidden_size)
        self.head_weight = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=g)
        # Row r owns blocks in reverse order, so a wrong table lookup reads someone else's rows.
        self.tables = [list(range((r + 1) * TABLE_BLOCKS - 1, r * TABLE_BLOCKS - 1, -1)) for r in range(rows)]
        self.tokens = torch.randint(0, TINY.vocab_size, (rows + 1, 64), generator=g)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight).float()

    def handles(self) -> TargetModel:
        return TargetModel(TINY, self.embed, None, self.head, self.kv_cache)

    def states(self, slot_index: list[int], seq_lens: list[int], samples: list[bool]) -> DeviceStates:
        tables = [self.tables[s] if s < self.rows else [0] for s in slot_index]  # slot `rows`: padding
        meta = TorchPagedAttention(BS, 64, torch.device("cpu")).prepare([(0, 1, t) for t in tables])
        return DeviceStates(
            tokens=self.tokens, slot_index=torch.tensor(slot_index), positions=meta.positions,
            accepted=torch.zeros(len(slot_index), dtype=torch.int64), seq_lens=torch.tensor(seq_lens),
            samples=torch.tensor(samples), hidden={}, target=self.handles(), attention=meta)

    def kv_rows(self, slot: int, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's cache at positions 0..length-1, [length, kv_heads, hd] each."""
        pos = torch.arange(length)
        table = torch.tensor(self.tables[slot])
        slots = table[pos // BS] * BS + pos % BS
        return self.kv_cache[layer, 0, slots], self.kv_cache[layer, 1, slots]


def test_capabilities_and_no_draft_kv(tiny_ckpt: Path) -> None:
    caps = C.capabilities
    assert caps.draft_width == "variable" and caps.supports_k0 and drafting_kind(CausalCascadeSpeculator) == "in_step"
    assert caps.uses_target_kv and caps.uses_target_weights and caps.max_k == 15
    assert caps.lookahead_slots(15) == 0
    ctx = tiny_ctx(tiny_ckpt)
    C.check(ctx)
    assert C.draft_kv_bytes_per_token(ctx) == 0
    assert C.capabilities_for(ctx).target_hidden_layers == ()
    cfg = learned.read_config(tiny_ckpt)
    assert cfg.kv_layers == (2, 3) and cfg.block_size == 8 and cfg.num_layers == 2


def test_k_past_the_block_is_rejected(tiny_ckpt: Path) -> None:
    C.check(tiny_ctx(tiny_ckpt, k=7))
    with pytest.raises(InvalidInputError, match="blocks of 8"):
        C.check(tiny_ctx(tiny_ckpt, k=8))


def test_serving_reads_the_target_kv_as_training_does(tiny_ckpt: Path) -> None:
    """propose's block (paged cross-attention over the live cache, positions < a0) equals the
    training forward (one masked attention over the gathered rows) at anchor a0 = seq_len - 1."""
    k = 3
    target = FakeTarget(rows=4)
    spec = C(tiny_ctx(tiny_ckpt, k=k))
    slot_index, seq_lens = [2, 0, 3, 1], [5, 17, 30, 2]
    with torch.inference_mode():
        served = spec.block_logits(target.states(slot_index, seq_lens, [True] * 4), k)
        length = max(seq_lens)
        kv = {}
        for layer in spec.cfg.kv_layers:
            pairs = [target.kv_rows(s, layer, length) for s in slot_index]
            kv[layer] = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
        tokens = target.tokens[slot_index, :length]
        batch = TrainBatch(tokens=tokens, labels=tokens, mask=torch.ones_like(tokens, dtype=torch.bool),
                           hidden={}, kv=kv, target=target.handles())
        anchors = torch.tensor(seq_lens)[:, None] - 1
        hidden = spec.module.train_hidden(batch, anchors)[:, 0, 1 : k + 1]
        trained = target.head(hidden.reshape(-1, TINY.hidden_size)).view(len(slot_index), k, -1)
    torch.testing.assert_close(served, trained, atol=1e-4, rtol=1e-4)
    drafts = spec.propose(target.states(slot_index, seq_lens, [True] * 4), k).token_ids
    assert drafts.shape == (4, k) and drafts.dtype == torch.int64
    assert torch.equal(drafts, served.argmax(-1))


def test_rows_that_cannot_run_draft_nothing(tiny_ckpt: Path) -> None:
    k = 3
    spec = C(tiny_ctx(tiny_ckpt, k=k))
    max_len = spec.module.max_len
    target = FakeTarget(rows=4)
    # ok; does not sample; padding (seq_len 0); block would pass the rope table.
    seq_lens, samples = [10, 10, 0, max_len - k + 1], [True, False, False, True]
    assert runnable(torch.tensor(seq_lens), torch.tensor(samples), k, max_len).tolist() == [True, False, False, False]
    assert runnable(torch.tensor([max_len - k + 1]), torch.tensor([True]), k - 1, max_len).tolist() == [True]
    with torch.inference_mode():
        drafts = spec.propose(target.states([0, 1, 4, 2], seq_lens, samples), k).token_ids
    assert (drafts[0] >= 0).all()
    assert (drafts[1:] == -1).all()


def test_min_prob_ends_the_drafts() -> None:
    sure, unsure = torch.tensor([0.0, 5.0, 0.0]), torch.tensor([0.0, 0.1, 0.0])
    logits = torch.stack([torch.stack([sure, unsure, sure]), torch.stack([sure, sure, sure])])
    ok = torch.tensor([True, True])
    assert pick_drafts(logits, ok, 0.0).tolist() == [[1, 1, 1], [1, 1, 1]]
    assert pick_drafts(logits, ok, 0.9).tolist() == [[1, -1, -1], [1, 1, 1]]
    assert pick_drafts(logits, torch.tensor([True, False]), 0.9).tolist() == [[1, -1, -1], [-1, -1, -1]]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"min_prob": 1.5}, CausalCascadeOptions)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"min_prb": 0.5}, CausalCascadeOptions)


def test_serving_passes_never_wait_for_the_device() -> None:
    """Inside a captured step nothing may copy to the host or size a tensor by its data."""
    from speckernel.speculators import causal_cascade as cc

    for fn in (C.propose, C.sync, C.block_logits, cc.CascadeModule.forward, cc.CascadeModule.block_input,
               cc.CascadeLayer.forward, cc.CrossAttention.forward, pick_drafts, runnable):
        src = inspect.getsource(fn)
        for bad in (".tolist(", ".item(", "nonzero", ".cpu(", "int(", "float(", "bool("):
            assert bad not in src, f"{fn.__qualname__} uses {bad}"


@pytest.mark.parametrize("shape", [(32, 4, 2, 8, 6), (48, 3, 1, 16, 5)])
def test_loss_decreases(shape: tuple[int, int, int, int, int]) -> None:
    hidden, heads, kv_heads, head_dim, layers = shape
    torch.manual_seed(0)
    vocab, b, t = 40, 4, 48
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    module = C.new_drafter(cfg, 64, intermediate_size=64)
    embed = torch.nn.Embedding(vocab, hidden).requires_grad_(False)
    head_w = torch.randn(vocab, hidden) * hidden**-0.5

    def head(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, head_w).float()

    # Counting sequences: every label (the next token) follows from the tokens before it.
    start = torch.randint(0, vocab, (b, 1))
    tokens = (start + torch.arange(t)) % vocab
    labels = (tokens + 1) % vocab
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, :3] = False
    mask[0, 40:] = False
    proj = torch.randn(2, vocab, kv_heads * head_dim)
    kv = {layer: (proj[0][tokens].view(b, t, kv_heads, head_dim), proj[1][tokens].view(b, t, kv_heads, head_dim))
          for layer in module.config.kv_layers}
    batch = TrainBatch(tokens=tokens, labels=labels, mask=mask, hidden={}, kv=kv,
                       target=TargetModel(cfg, embed, None, head, None))
    losses, figures = fit(module, batch)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert set(figures) == {"acc", "acc_pos1"} and figures["acc_pos1"] > 0.5


def test_default_checkpoint_fits_the_budget(tmp_path: Path) -> None:
    """SmolLM2-135M's shape, without loading it: at most 12 MB in bf16."""
    smollm = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64)
    module = C.new_drafter(smollm, 512)
    assert module.config.kv_layers == (15, 29)
    assert sum(p.numel() for p in module.parameters()) == 5_755_392
    learned.save(tmp_path / "ckpt", module.config, module)
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_size <= 12_000_000


# --- the real default model ------------------------------------------------------------------

# Greedy losslessness with the shipped checkpoint: tests/test_speculative.py (every built-in).


@pytest.mark.slow
def test_k_past_the_block_is_rejected_at_start() -> None:
    from speckernel.config import EngineConfig
    from speckernel.engine.core import EngineCore

    with pytest.raises(InvalidInputError, match="blocks of 8"):
        EngineCore(EngineConfig(platform="cpu", max_model_len=512, speculator="causal_cascade",
                                num_speculative_tokens=8))
