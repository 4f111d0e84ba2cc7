"""The speculator contract (v3): the one module a speculator plugin must import.

A speculator is a class registered under the `speckernel.speculators` entry point. It declares
a frozen `SpeculatorCapabilities` and an `Options` struct; the kernel derives everything else
from them (host copy of draft IDs or not, K=0 steps, KV slots and draft-KV memory to reserve).

It is one of two kinds, and the methods it has say which (`drafting_kind` reads them once, when
the class is loaded):
- `InStepSpeculator`: `propose(states, k)` and `sync(states)` over `DeviceStates`, tensors only.
  Its pass runs inside the step (and the step's captured graph), and the next step may be
  launched before this one's accepted counts reach the host (run-ahead).
- `AfterStepSpeculator`: `propose(states, rows, k)` and `sync(states, rows)`, with the step's
  `HostRows` too. Its pass runs once the step's tokens reached the host; it is the only kind
  that may return `DeferredDrafts` (drafts the host writes later, behind a gate).

The runner calls the speculator for every row of every step, non-final prefill chunks
included: `propose` when at least one row samples and the step may draft, `sync` otherwise
(the K=0 pass). Everything a speculator knows about a request's tokens it reads from the
kernel's token buffer; it keeps no copy of its own.

A speculator whose capabilities say `trainable` also has the training protocol
(`TrainableSpeculator`), which `speckernel train-drafter` drives.

This module holds only the contract and the values its fields name (`ModelConfig`,
`RowSampling`, the attention types, `InvalidInputError`). The building blocks learned drafters
share with the target (its layers, rope, checkpoint access) are in `speckernel.kit`, which is
versioned with the kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, Self, TypeGuard, TypeVar, runtime_checkable

import msgspec

from .attention import AttentionBackend, AttentionMetadata
from .errors import InvalidInputError
from .model_config import ModelConfig
from .sampling_params import RowSampling

if TYPE_CHECKING:  # annotations only: the contract itself runs no torch
    import torch

    from .platform import HostGate

__all__ = [
    "AfterStepSpeculator",
    "AttentionBackend",
    "AttentionMetadata",
    "DeferredDrafts",
    "DeviceStates",
    "DrafterArchitecture",
    "DraftingKind",
    "Drafts",
    "FitsVocabulary",
    "HostRows",
    "InStepSpeculator",
    "InvalidInputError",
    "ModelConfig",
    "NoOptions",
    "RowSampling",
    "Speculator",
    "SpeculatorBase",
    "SpeculatorCapabilities",
    "SpeculatorContext",
    "TargetModel",
    "TrainBatch",
    "TrainableDrafter",
    "TrainableSpeculator",
    "drafting_kind",
    "drafts_in_step",
]


class SpeculatorCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    draft_width: Literal["fixed", "variable"]
    """fixed: always K drafts, the host needs only the count; variable: a -1 suffix ends the
    drafts and the real IDs must reach the host."""
    supports_k0: bool
    """Can run a sync-only pass (keep its state in step) without drafting."""
    k0_pass: str = ""
    """What that sync pass does, in words (`speckernel plugins` shows it)."""
    max_k: int
    lookahead_slots_per_draft: int = 0
    """KV slots written beyond the verified query, per draft token."""
    target_hidden_layers: tuple[int, ...] = ()
    """Target layers whose output (the residual stream after the layer) it reads; captured
    only for these."""
    uses_target_kv: bool = False
    """Reads the target's KV rows (handed over in `DeviceStates.target`)."""
    uses_target_weights: bool = False
    """Reads the target's embedding, final norm and head (`DeviceStates.target`)."""
    placement: Literal["local_last_stage", "remote"] = "local_last_stage"
    sampled_drafts: bool = False
    """Drafts are sampled from a distribution q that verification must see (draft_probs)."""
    trainable: bool = False
    """`speckernel train-drafter --method NAME` trains it: the class has the training protocol
    (`TrainableSpeculator`), and the checkpoint it writes is what `--draft-model` loads."""
    deferred: bool = False
    """An `AfterStepSpeculator` whose `propose` returns `DeferredDrafts` (said for `speckernel
    plugins` and the stats; the kernel reads the type of what `propose` returns)."""

    def lookahead_slots(self, k: int) -> int:
        return self.lookahead_slots_per_draft * k


class NoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options struct of a speculator that takes none."""


OptionsT = TypeVar("OptionsT", bound=msgspec.Struct, covariant=True)
"""A speculator's own `Options` struct."""


@dataclass(frozen=True)
class SpeculatorContext(Generic[OptionsT]):
    """What the kernel hands a speculator at start: `check` and `draft_kv_bytes_per_token`
    see it before the KV cache exists (num_kv_blocks 0, draft_kv None). A speculator annotates
    it with its options (`SpeculatorContext[MyOptions]`); unparametrised, it is the kernel's
    view, which knows only that `options` is some speculator's struct."""

    target: ModelConfig
    target_path: Path
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    num_speculative_tokens: int
    """K as configured (the frame carries the K of each step)."""
    options: OptionsT
    """An instance of the speculator's `Options` struct, validated by the kernel."""
    draft_model: str | None = None
    """A checkpoint for speculators that run their own model."""
    attention: AttentionBackend | None = None
    """A backend of the speculator's own (its metadata never clobbers the target's)."""
    num_kv_blocks: int = 0
    draft_kv: torch.Tensor | None = None
    """Flat uint8 buffer of num_kv_blocks * block_size * draft_kv_bytes_per_token bytes, carved
    from the same budget as the target's KV cache and indexed by the target's block tables."""
    num_slots: int = 0
    """Rows of the token buffer (`DeviceStates.tokens`): per-slot state is indexed by slot."""
    fused_kernels: bool = False
    """The platform runs the kernel's fused Triton ops (`speckernel.kit.fused_ops`) on this device: a speculator's
    layers may call them instead of their torch definitions."""
    host_gate: Callable[[float], HostGate] | None = None
    """The platform's gate (timeout in seconds) for `DeferredDrafts.ready`: the
    stream itself waits where it can (CUDA), the issuing thread elsewhere."""
    pin_memory: bool = False
    """Host staging memory should be pinned (the device copies from it asynchronously)."""
    packed_weights: bool = False
    """The platform runs the target's linears on weights packed once for its library
    (`LlamaModel.use_packed_weights`): a speculator that loads a model of its own may pack it too,
    at the cost of its linear weights' bytes once more."""


@dataclass(frozen=True)
class TargetModel:
    """Handles to the target, for speculators that declare they use them."""

    config: ModelConfig
    embed: torch.nn.Module | None
    norm: torch.nn.Module | None
    head: Callable[[torch.Tensor], torch.Tensor] | None
    """hidden [N, H] -> float32 logits [N, V]: linear and without a bias, so a speculator may
    apply it to the terms of a sum one by one (dspark does)."""
    kv_cache: torch.Tensor | None
    """[layers, 2, slots, kv_heads, head_dim]; slot = block_id * block_size + offset."""


@dataclass(frozen=True)
class DeviceStates:
    """One step as the target saw it, on the device: every row, in frame order. Tensors only, of
    shapes fixed by the step, so a pass that reads nothing else can be captured in its graph."""

    tokens: torch.Tensor
    """The token buffer [slots, width] (read only). Row i's confirmed tokens are
    tokens[slot_index[i], :seq_lens[i]]; after `propose` the kernel writes the drafts right after."""
    slot_index: torch.Tensor
    """[R] int64: each row's slot. A slot whose generation changed belongs to a new request
    (`HostRows.generations`; an in-step speculator keeps per-slot state that a prefill row
    starting at position 0 resets)."""
    positions: torch.Tensor
    """[T] position of each query token."""
    accepted: torch.Tensor
    """[R] int64: drafts accepted per row (0 for rows without drafts)."""
    seq_lens: torch.Tensor
    """[R] int64: confirmed tokens per row after this step, computed on the device from the
    accepted counts (with run-ahead the host does not know them yet: a row planned before its
    predecessor's accepted counts were known has its positions moved back on the device). For a
    row that sampled, the newest token sits at seq_lens[i] - 1 and its target KV is not written
    yet; for a prefill chunk, seq_lens[i] is the end of the chunk."""
    samples: torch.Tensor
    """[R] bool: rows that sampled a token (only their drafts can be verified later)."""
    hidden: dict[int, torch.Tensor]
    """Layer -> [T, H] output of the declared target layers, for the step's query tokens."""
    target: TargetModel | None = None
    attention: AttentionMetadata | None = None
    """The step's attention plan on the device (positions, cache slots, query offsets, context
    lengths, block tables; moved back where run-ahead shifted a row). A drafter whose KV is
    indexed like the target's runs a layer over the step's tokens with
    `attention.backend.forward(q, k, v, its_kv_layer, attention, scale)`."""

    @property
    def num_rows(self) -> int:
        return self.slot_index.shape[0]


@dataclass(frozen=True)
class HostRows:
    """The same step's rows on the host, for an `AfterStepSpeculator` (its pass runs once the
    step's accepted counts reached the host)."""

    slots: list[int]
    generations: list[int]
    """A slot whose generation changed belongs to a new request: drop what was kept for it."""
    start_pos: list[int]
    """Position of each row's first query token."""
    query_start: list[int]
    """[R + 1] offsets of each row's query in the step's flattened tokens."""
    num_drafts: list[int]
    """Drafts the step verified per row (they sit at the end of the row's query)."""
    seq_lens: list[int]
    """`DeviceStates.seq_lens`, on the host."""
    samples: list[bool]
    """`DeviceStates.samples`, on the host."""
    sampling: list[RowSampling | None]
    block_tables: list[list[int]]


@dataclass
class Drafts:
    token_ids: torch.Tensor
    """[rows, K] int64 on the device, one row per `DeviceStates` row (rows that did not sample
    are ignored); -1 ends a variable-width row."""
    probs: torch.Tensor | None = None
    """[rows, K, vocab] draft distribution q, when capabilities.sampled_drafts."""


@dataclass
class DeferredDrafts:
    """What an `AfterStepSpeculator`'s `propose` may return before its drafts exist. The kernel
    issues the device work that reads them (their copy, their storage in the token buffer, the
    next step's inputs) behind `ready`, after the next step's host work, and waits at once only
    where the host needs the IDs. No draft distribution: sampled drafts cannot be deferred."""

    token_ids: torch.Tensor
    """[rows, K] int64 host memory that the host fills later (-1 ends a row, or all of it when
    the proposal failed)."""
    ready: HostGate
    """Opens once the host has written token_ids. The kernel calls `enqueue()` and `wait()`
    before the work that reads them, and never reads them earlier."""


class Speculator(Protocol):
    """What every speculator has, whichever kind it is (`InStepSpeculator`, `AfterStepSpeculator`)."""

    name: ClassVar[str]
    capabilities: ClassVar[SpeculatorCapabilities]
    Options: ClassVar[type[msgspec.Struct]]
    """Its options, built by the kernel from `--speculator-option KEY=VALUE` strings."""

    def __init__(self, ctx: SpeculatorContext) -> None: ...

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        """Raises InvalidInputError when this target, platform or these options cannot be
        served. The kernel calls it before any weight is read."""
        ...

    @classmethod
    def draft_kv_bytes_per_token(cls, ctx: SpeculatorContext) -> int:
        """Bytes of draft KV per token position (0: none); the kernel allocates them."""
        ...

    @classmethod
    def capabilities_for(cls, ctx: SpeculatorContext) -> SpeculatorCapabilities:
        """The capabilities for this target and these options (`SpeculatorBase` returns
        `capabilities`). The kernel calls it after `check`."""
        ...


@runtime_checkable
class InStepSpeculator(Speculator, Protocol):
    """Drafts inside the step, from device tensors only: its passes keep fixed shapes and never
    wait for the device, so the kernel captures them in the step's graph and runs ahead."""

    def propose(self, states: DeviceStates, k: int) -> Drafts: ...

    def sync(self, states: DeviceStates) -> None:
        """The K=0 pass: keep internal state in step without drafting."""
        ...


@runtime_checkable
class AfterStepSpeculator(Speculator, Protocol):
    """Drafts after the step, once its tokens and accepted counts reached the host."""

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts | DeferredDrafts: ...

    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        """The K=0 pass: keep internal state in step without drafting."""
        ...


DraftingKind = Literal["in_step", "after_step"]

_KINDS: dict[tuple[int, int], DraftingKind] = {(2, 1): "in_step", (3, 2): "after_step"}
"""(propose's, sync's parameters after self) -> the kind they declare."""


def _arity(method: Callable[..., object], unbound: bool) -> int:
    """Parameters after self (a class's function has self, an instance's bound method has not)."""
    return len(inspect.signature(method).parameters) - unbound


def drafting_kind(speculator: object) -> DraftingKind:
    """The kind a speculator class (or instance) declares by its `propose` and `sync`; raises
    InvalidInputError for methods that are neither kind's."""
    propose, sync = getattr(speculator, "propose", None), getattr(speculator, "sync", None)
    name = getattr(speculator, "__name__", type(speculator).__name__)
    if not callable(propose) or not callable(sync):
        raise InvalidInputError(f"speculator {name} has no propose() or no sync()")
    unbound = inspect.isclass(speculator)
    kind = _KINDS.get((_arity(propose, unbound), _arity(sync, unbound)))
    if kind is None:
        raise InvalidInputError(
            f"speculator {name}: propose(states, k) with sync(states) drafts inside the step; "
            f"propose(states, rows, k) with sync(states, rows) after it; got propose{inspect.signature(propose)} "
            f"and sync{inspect.signature(sync)}")
    return kind


def drafts_in_step(speculator: Speculator) -> TypeGuard[InStepSpeculator]:
    """The speculator drafts inside the step (else after it: an `AfterStepSpeculator`)."""
    return drafting_kind(speculator) == "in_step"


@dataclass(frozen=True)
class TrainBatch:
    """What `speckernel train-drafter` hands a learned drafter's loss: token sequences that the
    target itself wrote, and what the target computed over them."""

    tokens: torch.Tensor
    """[B, T] int64."""
    labels: torch.Tensor
    """[B, T] int64: the target's greedy prediction of the token after each position."""
    mask: torch.Tensor
    """[B, T] bool: positions whose label counts (the responses, not padding)."""
    hidden: dict[int, torch.Tensor]
    """Layer -> [B, T, H]: the residual stream after each requested target layer."""
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """Layer -> (K, V), each [B, T, kv_heads, head_dim], K roped: the target's KV rows at each
    requested layer."""
    target: TargetModel
    """The target's embedding, final norm and head (frozen)."""
    counted: int | None = None
    """How many entries of `mask` are True, counted on the host when the batch was made (None:
    not known). A loss that gathers the positions whose label counts sizes its gather by this
    bound: a gather sized by the mask itself (`x[mask]`) reads the device back, a host sync in
    every training step."""


class SpeculatorBase:
    """Defaults for the optional parts of the contract: no options, the class's capabilities
    for every target, nothing to refuse, no draft KV. Subclassing it is optional."""

    name: ClassVar[str]
    capabilities: ClassVar[SpeculatorCapabilities]
    Options: ClassVar[type[msgspec.Struct]] = NoOptions

    @classmethod
    def capabilities_for(cls, ctx: SpeculatorContext) -> SpeculatorCapabilities:
        """The capabilities for this target and these options (a learned drafter reads the
        target layers it consumes from its checkpoint). The kernel calls it after `check`; an
        instance exposes the same as `capabilities`."""
        return cls.capabilities

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        return None

    @classmethod
    def draft_kv_bytes_per_token(cls, ctx: SpeculatorContext) -> int:
        return 0

    def stats(self) -> dict[str, float]:
        """The speculator's own counters (name -> number), shown in the engine's stats under
        `spec.plugin` and in `/metrics`; optional for plugins written to the protocol."""
        return {}


# --- training: what `speckernel train-drafter` drives -------------------------------------


class DrafterArchitecture(Protocol):
    """What `train-drafter` reads of a drafter's config: the target state each batch must carry."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose output (`TrainBatch.hidden`) the drafter reads."""
        ...

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Target layers whose KV rows (`TrainBatch.kv`) the drafter reads."""
        ...


class TrainableDrafter(Protocol):
    """The module `train-drafter` trains: a `torch.nn.Module` (the methods below are the
    torch ones it calls) with its config and its loss."""

    @property
    def config(self) -> DrafterArchitecture: ...

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """Training loss on one batch, and named figures for the progress bar and the log: 0-dim
        tensors left on the device, which the trainer reads together once per log interval (a
        float costs a host sync in every step, which keeps the GPU waiting for the host)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    def train(self, mode: bool = True) -> Self: ...

    def eval(self) -> Self: ...

    def to(self, device: torch.device) -> Self: ...


@runtime_checkable
class FitsVocabulary(Protocol):
    """Optional for a `TrainableDrafter`: a new drafter (not one from `--init`) is fitted to
    how often the target writes each token before training (eagle3 picks its draft
    vocabulary)."""

    def fit_vocab(self, counts: torch.Tensor) -> None:
        """counts [V] int64: the target's greedy labels per token id over the training data."""
        ...


@runtime_checkable
class TrainableSpeculator(Protocol):
    """The training protocol, had by the speculators whose capabilities say `trainable`."""

    @classmethod
    def new_drafter(cls, target: ModelConfig, max_len: int, **overrides: Any) -> TrainableDrafter:
        """An untrained drafter for this target, for sequences up to max_len; overrides are
        fields of its config (`--set FIELD=VALUE`)."""
        ...

    @classmethod
    def read_checkpoint(cls, folder: Path, target: ModelConfig) -> msgspec.Struct:
        """The config of the checkpoint in folder, refused (InvalidInputError) when it is
        another method's or was trained for another target shape. Its fields other than
        `method` and `target` are overrides `new_drafter` takes (`--init` rebuilds the
        checkpoint's architecture from them)."""
        ...

    @classmethod
    def save(cls, folder: Path, drafter: TrainableDrafter) -> None:
        """Writes the checkpoint that `--draft-model folder` and `--init folder` load."""
        ...
