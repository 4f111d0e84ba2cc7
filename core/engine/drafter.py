"""A built-in drafter hosted outside the engine: what `speckernel serve-drafter` runs per request.

`DrafterHost` loads the speculator named by `--method` for one target and keeps, per slot of
the engine it serves, what the kernel would have kept for it: the token buffer, the drafter's
own KV (slot s owns a fixed run of blocks, so no block manager is needed), and whatever the
speculator keeps itself. Each `Ingest`/`Propose` rebuilds the step's `DeviceStates` (and `HostRows`) from the
wire (the target's hidden states arrive with it; the target's embedding and head are this
process's own copy, loaded when the drafter declares it uses them), then calls the speculator's
`sync` or `propose` exactly as the runner does.

Refused: drafters that read the target's KV rows (they would need the target's cache shipped
every step) and drafters whose drafts are sampled from a q that verification must see.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from .. import log, registry
from ..attention import AttentionBackend, AttentionMetadata
from ..errors import InvalidInputError
from ..models.checkpoint import read_config, resolve
from ..models.llama import LlamaModel
from ..models.loader import load_model
from ..platform import parse_dtype
from ..plugin import (
    AfterStepSpeculator,
    DeferredDrafts,
    DeviceStates,
    HostRows,
    Speculator,
    SpeculatorCapabilities,
    SpeculatorContext,
    TargetModel,
    drafts_in_step,
)
from ..runner.host_copy import to_device
from ..runner.step_plan import DRAFTER, Col, HostPlan
from ..wire.drafter import HIDDEN_CARRIERS, Describe, Free, Hello, Ingest, Propose, ServerTiming, fingerprint
from .check import parse_options
from .drafter_steps import Key, PaddedSteps
from .fast_path import pack_weights

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hidden_from_wire(arrays: list[np.ndarray], name: str, device: torch.device, pin: bool) -> list[torch.Tensor]:
    """Hidden states as the engine sent them (`HIDDEN_CARRIERS`), on the device in their wire
    dtype. The frames are read-only, so they are copied once, all into one host buffer (pinned
    where `pin`), which goes to the device in one copy the host does not wait for."""
    if name not in TORCH_DTYPES or any(a.dtype != np.dtype(HIDDEN_CARRIERS[name]) for a in arrays):
        raise InvalidInputError(f"hidden states: {name} cannot travel as {[str(a.dtype) for a in arrays]}")
    if not arrays:
        return []
    host = torch.empty(sum(a.nbytes for a in arrays), dtype=torch.uint8, pin_memory=pin)
    buf, offset = host.numpy(), 0
    for a in arrays:
        buf[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        offset += a.nbytes
    on_device = host.to(device, non_blocking=True)
    out, offset = [], 0
    for a in arrays:
        out.append(on_device[offset : offset + a.nbytes].view(TORCH_DTYPES[name]).view(a.shape))
        offset += a.nbytes
    return out


@dataclass
class Served:
    """The drafter built for one engine's sizes, and the state it keeps per slot."""

    speculator: Speculator
    caps: SpeculatorCapabilities
    key: tuple[int, int, int, int]
    """(num_slots, block_size, max_model_len, K): a Hello with other sizes builds anew."""
    tokens: torch.Tensor
    tables: list[list[int]]
    attention: AttentionBackend
    """The step's plan (the target's view of the step), apart from the speculator's own backend."""
    generations: dict[int, int]
    target: TargetModel | None
    """The target's embedding, final norm and head, where the drafter declares it uses them."""
    padded: PaddedSteps | None
    """Fixed-shape passes (device graphs where the platform captures them), for in-step drafters."""


class DrafterHost:
    def __init__(self, method: str, model: str, *, platform: str | None = None, dtype: str | None = None,
                 draft_model: str | None = None, options: dict[str, str] | None = None,
                 graphs: bool = True) -> None:
        """`graphs`: steady-state steps of an in-step drafter run at fixed shapes (device
        graphs where the platform captures them); False runs every step eagerly at its size."""
        self.method = method
        self.graphs = graphs
        self.num_padded_steps = 0
        """Steps that ran at a padded fixed shape (replayed where graphs were captured)."""
        self.num_eager_steps = 0
        self.log = log.get("drafter_host")
        self.platform = registry.pick_platform(platform)
        self.dtype = parse_dtype(dtype) if dtype else self.platform.default_dtype()
        self.path = resolve(model)
        self.target = read_config(self.path)
        self.identity = fingerprint(self.target)
        found = sorted(registry.discover("speculator"))
        if method not in found or method == "remote":
            raise InvalidInputError(f"serve-drafter --method {method!r}: expected one of "
                                    f"{', '.join(m for m in found if m != 'remote')}")
        self.cls: type[Speculator] = registry.load("speculator", method)
        self.options = parse_options(method, self.cls.Options, options or {})
        self.draft_model = draft_model
        self.session = secrets.randbits(62)
        self.model: LlamaModel | None = None
        self.served: Served | None = None
        self.timing = ServerTiming()
        """The phases of the latest step."""
        self.pin = self.platform.device.type != "cpu"
        """Host buffers that feed the device are pinned, so copies from them do not wait; there a
        proposal's device time is taken with events too (the host's clock sees only its issue)."""

    def _ctx(self, msg: Describe) -> SpeculatorContext:
        if msg.target != self.identity:
            raise InvalidInputError(f"this drafter serves the target {self.path.name} ({self.identity}); "
                                    f"the engine runs another ({msg.target})")
        return SpeculatorContext(
            target=self.target, target_path=self.path, device=self.platform.device, dtype=self.dtype,
            block_size=msg.block_size, max_model_len=msg.max_model_len,
            num_speculative_tokens=msg.num_speculative_tokens, options=self.options, draft_model=self.draft_model)

    def describe(self, msg: Describe) -> SpeculatorCapabilities:
        """The speculator's own check and capabilities for the engine's target and sizes."""
        ctx = self._ctx(msg)
        self.cls.check(ctx)
        caps: SpeculatorCapabilities = self.cls.capabilities_for(ctx)
        if caps.uses_target_kv:
            raise InvalidInputError(f"{self.method} reads the target's KV rows, which do not travel to a "
                                    "served drafter; serve it in the engine")
        if caps.sampled_drafts:
            raise InvalidInputError(f"{self.method} samples its drafts from a distribution verification "
                                    "must see, which does not travel to a served drafter")
        if caps.max_k < msg.num_speculative_tokens:
            raise InvalidInputError(f"{self.method} drafts at most {caps.max_k} tokens; got "
                                    f"K={msg.num_speculative_tokens}")
        return caps

    def hello(self, msg: Hello) -> SpeculatorCapabilities:
        """Describe, and the drafter built for these sizes (kept when a Hello with the same sizes
        comes again: an engine that reconnected finds its slots as it left them)."""
        caps = self.describe(msg)
        key = (msg.num_slots, msg.block_size, msg.max_model_len, msg.num_speculative_tokens)
        if msg.num_slots and (self.served is None or self.served.key != key):
            self.served = self._build(msg, caps, key)
        return caps

    def _build(self, msg: Hello, caps: SpeculatorCapabilities, key: tuple[int, int, int, int]) -> Served:
        ctx = self._ctx(msg)
        k, bs = msg.num_speculative_tokens, msg.block_size
        width = msg.max_model_len + k + 2
        per_slot = math.ceil((width + caps.lookahead_slots(k)) / bs)
        num_blocks = msg.num_slots * per_slot
        draft_bytes = self.cls.draft_kv_bytes_per_token(ctx) * num_blocks * bs
        device = self.platform.device
        draft_kv = torch.zeros(draft_bytes, dtype=torch.uint8, device=device) if draft_bytes else None
        max_tokens = max(8192, msg.num_slots * (k + 1))
        ctx = dataclasses.replace(
            ctx, num_kv_blocks=num_blocks, draft_kv=draft_kv, num_slots=msg.num_slots,
            attention=self.platform.attention_backend(bs, max_tokens),
            fused_kernels=self.platform.capabilities.triton,
            pin_memory=self.pin, packed_weights=self.platform.capabilities.packed_weights)
        if caps.uses_target_weights and self.model is None:
            self.model = load_model(self.path, self.dtype, device, width)
            pack_weights(self.model, self.platform)
        speculator = self.cls(ctx)
        m = self.model
        target = TargetModel(self.target, m.embed, m.norm, m.logits, None) if caps.uses_target_weights and m else None
        tokens = torch.zeros(msg.num_slots, width, dtype=torch.int64, device=device)
        padded = None
        plans = self.platform.attention_backend(bs, max_tokens, max_rows=msg.num_slots, max_blocks=per_slot)
        if drafts_in_step(speculator) and self.graphs and msg.num_slots > 1 and plans.supports_padding:
            padded = PaddedSteps.build(
                speculator, plans, tokens, caps.target_hidden_layers, self.target.hidden_size, self.dtype, target,
                msg.num_slots, k)
            if self.platform.capabilities.supports_graphs and plans.device_planned:
                padded.capture(self.platform, k)
        self.log.info("drafter_built", method=self.method, num_slots=msg.num_slots, k=k,
                      draft_kv_bytes=draft_bytes, max_model_len=msg.max_model_len,
                      graphs=len(padded.graphs) if padded is not None else 0)
        return Served(
            speculator=speculator, caps=caps, key=key, tokens=tokens,
            tables=[list(range(s * per_slot, (s + 1) * per_slot)) for s in range(msg.num_slots)],
            attention=self.platform.attention_backend(bs, max_tokens, max_rows=msg.num_slots,
                                                      max_blocks=per_slot),
            generations={}, target=target, padded=padded)

    def free(self, msg: Free) -> None:
        served = self._require()
        for slot, generation in zip(msg.slots, msg.generations, strict=True):
            if served.generations.get(slot) == generation:
                del served.generations[slot]

    def _require(self) -> Served:
        if self.served is None:
            raise InvalidInputError("no Hello with the engine's sizes came before this request")
        return self.served

    @torch.inference_mode()
    def step(self, msg: Ingest | Propose) -> np.ndarray | None:
        """The runner's speculator pass over one step; [R, K] int64 drafts for a Propose. Its
        phases are left in `timing` (prepare, compute, d2h; device_compute for a proposal on a
        device that runs asynchronously)."""
        started = time.perf_counter()
        served = self._require()
        self._admit(served, msg)
        k = msg.k if isinstance(msg, Propose) else 0
        padded = served.padded
        key = padded.key([r.num_tokens for r in msg.rows], k) if padded is not None else None
        run: Callable[[], torch.Tensor | None]
        if padded is not None and key is not None:
            self.num_padded_steps += 1
            meta = self._padded(served, padded, key, msg)
            run = functools.partial(padded.run, key, meta)
        else:
            self.num_eager_steps += 1
            states, host_rows = self._states(served, msg)
            run = functools.partial(self._eager, served, states, host_rows, k)
        timed = k and self.pin
        events = [torch.Event(self.platform.device, enable_timing=True) for _ in range(2)] if timed else []
        prepared = time.perf_counter()
        for e in events[:1]:
            e.record()
        ids = run()
        for e in events[1:]:
            e.record()
        computed = time.perf_counter()
        out = None if ids is None else ids[: len(msg.rows)].to(torch.int64).cpu().numpy()
        done = time.perf_counter()
        self.timing = ServerTiming(prepare=(prepared - started) * 1e3, compute=(computed - prepared) * 1e3,
                                   d2h=(done - computed) * 1e3,
                                   device_compute=events[0].elapsed_time(events[1]) if events else -1.0)
        return out

    def _admit(self, served: Served, msg: Ingest) -> None:
        """Checks the step against the drafter's buffers and declared layers, and takes its rows'
        generations."""
        rows = msg.rows
        if not rows:
            raise InvalidInputError("a step without rows")
        num_slots, width = served.tokens.shape
        caps = served.caps
        if len(msg.hidden) != len(caps.target_hidden_layers):
            raise InvalidInputError(f"expected hidden states of layers {caps.target_hidden_layers}, "
                                    f"got {len(msg.hidden)} arrays")
        total = sum(r.num_new_tokens for r in rows)
        tokens = np.asarray(msg.tokens)
        if tokens.shape != (total,) or tokens.dtype.kind not in "iu":
            raise InvalidInputError(f"tokens: expected {total} integers, got {tokens.dtype} {tokens.shape}")
        for r in rows:
            if not 0 <= r.slot < num_slots or r.tokens_from < 0 or r.tokens_from + r.num_new_tokens > width \
                    or r.start_pos + r.num_tokens > width:
                raise InvalidInputError(f"row of slot {r.slot} lies outside the drafter's buffers")
        t = sum(r.num_tokens for r in rows)
        for layer, a in zip(caps.target_hidden_layers, msg.hidden, strict=True):
            if a.ndim != 2 or a.shape[0] != t or a.shape[1] != self.target.hidden_size:
                raise InvalidInputError(f"hidden states of layer {layer}: expected [{t}, {self.target.hidden_size}], "
                                        f"got {list(a.shape)}")
        for r in rows:
            served.generations[r.slot] = r.generation

    @staticmethod
    def _token_writes(msg: Ingest) -> np.ndarray:
        """[3 * N]: slots, positions and ids of the token-buffer spans the step brings."""
        n = np.fromiter((r.num_new_tokens for r in msg.rows), np.int64, len(msg.rows))
        slots = np.repeat(np.fromiter((r.slot for r in msg.rows), np.int64, len(msg.rows)), n)
        pos = np.concatenate([np.arange(r.tokens_from, r.tokens_from + r.num_new_tokens) for r in msg.rows])
        return np.concatenate([slots, pos, np.asarray(msg.tokens, np.int64)])

    def _rows(self, msg: Ingest) -> HostPlan:
        """The step's plan (`step_plan.DRAFTER`)."""
        plan = DRAFTER.empty(len(msg.rows))
        for col, values in ((Col.SLOT, [r.slot for r in msg.rows]), (Col.ACCEPTED, [r.accepted for r in msg.rows]),
                            (Col.SEQ_LEN, [r.seq_len for r in msg.rows]), (Col.SAMPLES, [r.samples for r in msg.rows])):
            DRAFTER.put(plan, col, values)
        return plan

    def _padded(self, served: Served, padded: PaddedSteps, key: Key, msg: Ingest) -> AttentionMetadata:
        """The step's plan, tokens and hidden states in the padded pass's buffers."""
        tables = [(r.start_pos, r.num_tokens, served.tables[r.slot]) for r in msg.rows]
        meta = padded.plan(key, tables, self._rows(msg), self._token_writes(msg))
        assert meta.tail is not None
        n = meta.tail.numel() // 3
        served.tokens[meta.tail[:n], meta.tail[n : 2 * n]] = meta.tail[2 * n :]
        t = sum(r.num_tokens for r in msg.rows)
        hidden = hidden_from_wire(msg.hidden, msg.hidden_dtype, self.platform.device, self.pin)
        for layer, h in zip(served.caps.target_hidden_layers, hidden, strict=True):
            padded.hidden[layer][:t].copy_(h)
        return meta

    def _eager(self, served: Served, states: DeviceStates, rows: HostRows, k: int) -> torch.Tensor | None:
        speculator = served.speculator
        if drafts_in_step(speculator):
            if k:
                return speculator.propose(states, k).token_ids
            speculator.sync(states)
            return None
        after = cast(AfterStepSpeculator, speculator)
        if not k:
            after.sync(states, rows)
            return None
        drafts = after.propose(states, rows, k)
        if isinstance(drafts, DeferredDrafts):  # the reply needs them now
            drafts.ready.wait()
        return drafts.token_ids

    def _states(self, served: Served, msg: Ingest) -> tuple[DeviceStates, HostRows]:
        device = self.platform.device
        rows = msg.rows
        caps = served.caps
        writes = to_device(self._token_writes(msg), device)
        n = writes.numel() // 3
        served.tokens[writes[:n], writes[n : 2 * n]] = writes[2 * n :]
        on_device = hidden_from_wire(msg.hidden, msg.hidden_dtype, device, self.pin)
        hidden = {layer: h.to(self.dtype) for layer, h in zip(caps.target_hidden_layers, on_device, strict=True)}
        tables = [served.tables[r.slot] for r in rows]
        meta = served.attention.prepare([(r.start_pos, r.num_tokens, tables[i]) for i, r in enumerate(rows)])
        plan = self._rows(msg).to(device)
        query_start = np.concatenate([[0], np.cumsum([r.num_tokens for r in rows])]).tolist()
        states = DeviceStates(
            tokens=served.tokens, slot_index=DRAFTER.of(plan, Col.SLOT).contiguous(), positions=meta.positions,
            accepted=DRAFTER.of(plan, Col.ACCEPTED).contiguous(), seq_lens=DRAFTER.of(plan, Col.SEQ_LEN).contiguous(),
            samples=DRAFTER.of(plan, Col.SAMPLES) != 0, hidden=hidden, target=served.target, attention=meta)
        host = HostRows(
            slots=[r.slot for r in rows], generations=[r.generation for r in rows],
            start_pos=[r.start_pos for r in rows], query_start=query_start, num_drafts=[r.num_drafts for r in rows],
            seq_lens=[r.seq_len for r in rows], samples=[r.samples for r in rows],
            sampling=[r.sampling for r in rows], block_tables=tables)
        return states, host
