"""Self-distillation data for drafters: the target answers prompts through the engine itself, and
its hidden states, KV rows and greedy predictions over those answers become `TrainBatch`es.

Sequences are stored as token ids only (`Sequences`, one .npz); what the target computes over
them is recomputed per batch by a dense forward (`TargetFeatures`), which on a GPU costs less
than reading it back from disk.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from ...attention import AttentionMetadata
from ...frontend.async_engine import AsyncEngine
from ...models.llama import LlamaModel
from ...plugin import TargetModel, TrainBatch
from ...progress import Progress
from ...sampling_params import SamplingParams
from .follow_ups import second_turn


@dataclass
class Sequences:
    """Token sequences (prompt, then the target's answer) packed flat."""

    tokens: np.ndarray
    """[N] int32, every sequence back to back."""
    offsets: np.ndarray
    """[S + 1] int64."""
    prompt_lens: np.ndarray
    """[S] int64: the leading tokens of each sequence that the target did not write."""
    split_lens: np.ndarray | None = None
    """[S] int64: the leading tokens the held-out split hashes (`split`): the first turn's prompt
    for a follow-up's second answer (`follow_ups`), so it lands on its first answer's side; None:
    every prompt whole."""

    def split_len(self, i: int) -> int:
        return int(self.prompt_lens[i] if self.split_lens is None else self.split_lens[i])

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def get(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]], int(self.prompt_lens[i])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # np.savez would append .npz to a name without it
            np.savez_compressed(f, tokens=self.tokens, offsets=self.offsets, prompt_lens=self.prompt_lens,
                                split_lens=self.prompt_lens if self.split_lens is None else self.split_lens)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        with np.load(path) as z:
            return cls(z["tokens"], z["offsets"], z["prompt_lens"], z["split_lens"] if "split_lens" in z else None)

    @classmethod
    def concat(cls, parts: list[Sequences]) -> Sequences:
        sizes = np.cumsum([0] + [int(p.offsets[-1]) for p in parts])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + base for p, base in zip(parts, sizes, strict=False)])
        split = None if all(p.split_lens is None for p in parts) else np.concatenate(
            [p.prompt_lens if p.split_lens is None else p.split_lens for p in parts])
        return cls(np.concatenate([p.tokens for p in parts]), offsets.astype(np.int64),
                   np.concatenate([p.prompt_lens for p in parts]), split)

    def fingerprint(self) -> dict[str, int | str]:
        """Sequence count, token count and a digest of the tokens: what a resumed run compares
        with the data its state.pt was trained on, to notice a data file that changed."""
        digest = hashlib.blake2b(digest_size=8)
        for part in (self.tokens.astype(np.int32), self.offsets.astype(np.int64), self.prompt_lens.astype(np.int64)):
            digest.update(np.ascontiguousarray(part).tobytes())
        return {"sequences": len(self), "tokens": int(self.offsets[-1]) if len(self.offsets) else 0,
                "digest": digest.hexdigest()}

    def select(self, rows: np.ndarray) -> Sequences:
        parts = [self.get(int(i))[0] for i in rows]
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in parts])]).astype(np.int64)
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return Sequences(tokens.astype(np.int32), offsets, self.prompt_lens[rows],
                         None if self.split_lens is None else self.split_lens[rows])

    def split(self, fraction: float) -> tuple[Sequences, Sequences]:
        """(kept, held out), about `fraction` held out. A hash of the prompt decides, so every
        answer to one prompt (the greedy one, sampled ones) lands on the same side, whatever the
        order of the files: a held-out figure measures prompts training never saw. A follow-up's
        second answer hashes its first turn's prompt (`split_lens`): it goes where its first went."""
        def share(i: int) -> float:
            seq, _ = self.get(i)
            digest = hashlib.blake2b(seq[: self.split_len(i)].astype(np.int32).tobytes(), digest_size=8).digest()
            return int.from_bytes(digest, "little") / 2**64

        held = np.array([share(i) < fraction for i in range(len(self))], bool)
        return self.select(np.flatnonzero(~held)), self.select(np.flatnonzero(held))

    @classmethod
    def pack(cls, pairs: list[tuple[list[int], list[int]]], split_lens: list[int] | None = None) -> Sequences:
        seqs = [p + a for p, a in pairs]
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        tokens = np.fromiter((t for s in seqs for t in s), np.int32, int(offsets[-1]))
        return cls(tokens, offsets, np.array([len(p) for p, _ in pairs], np.int64),
                   None if split_lens is None else np.array(split_lens, np.int64))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while generating data, with the answers made until then (`data`), so the run can
    keep them and save a checkpoint before it stops."""

    def __init__(self, data: Sequences) -> None:
        super().__init__()
        self.data = data


TICK_S = 1.0
"""How often the generation's progress looks at the clock when no token arrives (an engine
starting, a long prefill), so its line every LOG_EVERY_S comes even then."""


def generate(config: Any, conversations: list[list[dict[str, str]]], max_tokens: int,
             concurrency: int = 256, temperature: float = 0.0, seed: int = 0,
             deadline: float = math.inf, follow_ups: list[str | None] | None = None) -> Sequences:
    """The target's answer to every conversation, through the engine (any platform): greedy, or
    sampled at `temperature` (more varied text; the labels stay the target's greedy tokens).
    follow_ups[i] (`follow_ups.choose`): a user turn after conversation i's whole answer, which
    the target answers too (a second sequence, split with the first: `Sequences.split_lens`).
    Everything stops at `deadline` (time.monotonic(), the engine's start-up included):
    conversations not started are left out, and answers being written are cut there and kept as
    far as they got (the start of the target's answer is still its answer), so a time-boxed run
    keeps what it made. On Ctrl-C, raises `Interrupted` holding the same."""
    pairs: list[tuple[list[int], list[int]]] = [([], []) for _ in conversations]
    seconds: list[tuple[list[int], list[int]]] = [([], []) for _ in conversations]
    follow = follow_ups or [None] * len(conversations)

    def made() -> Sequences:
        """The answers made: every first answer, then every second one, split with its first."""
        firsts = [p for p in pairs if p[1]]
        thens = [(p, len(first[0])) for p, first in zip(seconds, pairs, strict=True) if p[1]]
        if not thens:
            return Sequences.pack(firsts)
        return Sequences.pack(firsts + [p for p, _ in thens], [len(p) for p, _ in firsts] + [n for _, n in thens])

    async def run() -> None:
        bar = Progress("train-drafter: generating answers", len(conversations), len(conversations) * max_tokens)

        async def tick() -> None:
            while True:
                await anyio.sleep(TICK_S)
                bar.tokens(0)  # a line when one is due, tokens or not

        with bar, anyio.CancelScope(deadline=deadline):
            async with anyio.create_task_group() as ticking:
                ticking.start_soon(tick)
                async with AsyncEngine(config) as engine:
                    limit = anyio.Semaphore(concurrency)

                    async def one(i: int) -> None:
                        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                seed=seed + i if temperature else None)
                        async with limit:
                            prompt = engine.encode_chat(conversations[i])
                            prompt = prompt[: max(1, engine.info.max_model_len - max_tokens - 1)]
                            answer = None
                            async for out in engine.generate(prompt, params):
                                pairs[i] = (prompt, out.token_ids)  # kept as far as it got, if cut
                                bar.tokens(len(out.delta_token_ids))
                                answer = out
                            then = follow[i]
                            if then is not None and answer is not None and answer.finish_reason == "stop":
                                await second(engine, i, prompt, answer.text, then, params)
                        bar.request_done()

                    async def second(engine: AsyncEngine, i: int, prompt: list[int], answer: str, then: str,
                                     params: SamplingParams) -> None:
                        """Conversation i's second turn, when its chat template keeps the first
                        turn's prompt as it was (the split hashes that prefix)."""
                        turn = engine.encode_chat(second_turn(conversations[i], answer, then))
                        if turn[: len(prompt)] != prompt or len(turn) + max_tokens >= engine.info.max_model_len:
                            return
                        again = msgspec.structs.replace(params, seed=None if params.seed is None else
                                                        params.seed + len(conversations))
                        async for out in engine.generate(turn, again):
                            seconds[i] = (turn, out.token_ids)
                            bar.tokens(len(out.delta_token_ids))

                    async with anyio.create_task_group() as tg:
                        for i in range(len(conversations)):
                            tg.start_soon(one, i)
                ticking.cancel_scope.cancel()

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        raise Interrupted(made()) from None
    return made()


class DenseCausalAttention:
    """An attention backend for whole equal-length sequences in a batch [B, T] (training): causal
    SDPA, no cache; it keeps the (roped) K and V of the layers asked for."""

    def __init__(self, batch: int, length: int, keep: tuple[int, ...]) -> None:
        self.batch, self.length, self.keep = batch, length, keep
        self.layer = 0
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, written: bool = False) -> torch.Tensor:
        b, t = self.batch, self.length
        q4, k4, v4 = (x.view(b, t, x.shape[1], x.shape[2]) for x in (q, k, v))
        if self.layer in self.keep:
            self.kept[self.layer] = (k4, v4)
        self.layer += 1
        out = F.scaled_dot_product_attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


class TargetFeatures:
    """Runs the frozen target densely over a batch of sequences and packs what drafters train on."""

    def __init__(self, model: LlamaModel, hidden_layers: tuple[int, ...], kv_layers: tuple[int, ...]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.hidden_layers, self.kv_layers = hidden_layers, kv_layers
        cfg = model.cfg
        device = model.embed.weight.device
        self.dummy_kv = torch.zeros(cfg.num_layers, 2, 1, cfg.num_kv_heads, cfg.head_dim, device=device)
        self.target = TargetModel(cfg, model.embed, model.norm, model.logits, None)

    @torch.no_grad()
    def batch(self, tokens: torch.Tensor, mask: torch.Tensor, counted: int | None = None,
              label_chunk: int = 8192) -> TrainBatch:
        """The target's forward over tokens [B, T]; `counted` is how many entries of mask are
        True when the host knows it (`TrainBatch.counted`)."""
        b, t = tokens.shape
        device = tokens.device
        backend = DenseCausalAttention(b, t, self.kv_layers)
        positions = torch.arange(t, device=device).repeat(b)
        meta = AttentionMetadata(positions=positions, slot_mapping=positions, token_rows=positions,
                                 query_start=positions, seq_lens=positions, block_tables=positions[None],
                                 max_query_len=t, backend=backend)  # type: ignore[arg-type]
        final, captured = self.model.forward_with_hidden(tokens.reshape(-1), self.dummy_kv, meta, self.hidden_layers)
        labels = torch.cat([self.model.logits(chunk).argmax(-1) for chunk in final.split(label_chunk)])
        return TrainBatch(tokens=tokens, labels=labels.view(b, t), mask=mask,
                          hidden={layer: h.view(b, t, -1) for layer, h in captured.items()},
                          kv=backend.kept, target=self.target, counted=counted)


def batch_of(data: Sequences, batch_size: int, length: int, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray]:
    """One random batch [B, length] on the host (`feed.DeviceFeed` moves it): each row one
    sequence (right-padded); the mask covers the answer's positions whose next token the target
    wrote, not the padding. A sequence longer than `length` keeps its answer: the window starts
    where at most a quarter of it is prompt (a long prompt cut to `length` from its start would
    leave no answer to learn from, as on a CPU's short windows)."""
    pick = rng.integers(len(data), size=batch_size)
    tokens = np.zeros((batch_size, length), np.int64)
    mask = np.zeros((batch_size, length), bool)
    for row, i in enumerate(pick):
        seq, prompt_len = data.get(int(i))
        start = max(0, min(prompt_len - length // 4, len(seq) - length))
        seq, prompt_len = seq[start : start + length], prompt_len - start
        tokens[row, : len(seq)] = seq
        mask[row, max(prompt_len - 1, 0) : len(seq) - 1] = True
    return tokens, mask


def batches(data: Sequences, batch_size: int, length: int, rng: np.random.Generator
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless random batches (`batch_of`) from one generator: the fixed held-out batches."""
    while True:
        yield batch_of(data, batch_size, length, rng)


def step_batches(data: Sequences, batch_size: int, length: int, seed: int, first: int = 0
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless training batches from step `first` on (steps taken before it). The batch of each
    step is a function of (seed, step) alone, its own generator seeded by [seed, 0, step]: a
    resumed run draws exactly the batches the stopped one would have drawn next, however far
    ahead a feed had built batches when it stopped, with nothing to save but the step."""
    for step in itertools.count(first):
        yield batch_of(data, batch_size, length, np.random.default_rng([seed, 0, step]))


def label_counts(data: Sequences, vocab_size: int) -> torch.Tensor:
    """How often each token appears in the target's answers (what a draft vocabulary keeps)."""
    answers = np.concatenate([seq[prompt_len:] for seq, prompt_len in map(data.get, range(len(data)))]
                             or [np.zeros(0, np.int32)])
    return torch.from_numpy(np.bincount(answers, minlength=vocab_size)[:vocab_size].astype(np.int64))
