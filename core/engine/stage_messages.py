"""What the engine core and its pipeline stage processes say to each other (msgpack over zmq)."""

from __future__ import annotations

import msgspec

from ..config import EngineConfig
from ..kernel.frame import StepFrame


class StageBootstrap(msgspec.Struct, frozen=True, kw_only=True):
    config: EngineConfig
    num_blocks: int
    max_model_len: int
    lookahead_slots: int
    draft_kv_bytes: int
    commands: list[str]
    """Per rank: the address its StepFrames come from."""
    results: str
    """Where the last stage sends TokenFrames (the engine core binds it)."""
    reports: str
    """Where each stage reports (ready, digests)."""
    threads: int = 0
    transport: str
    """The transport of every link (`stage_links.transport_name`), resolved once by the engine core."""
    k: int = 0
    """Drafts per row of a token frame (0 without a speculator)."""
    blocks_per_request: int = 0
    """Block-table width of a step (0: as wide as each step needs), as the engine core plans it."""


class RunStep(msgspec.Struct, frozen=True, tag=True):
    frame: StepFrame


class Digest(msgspec.Struct, frozen=True, tag=True):
    pass


class Stop(msgspec.Struct, frozen=True, tag=True):
    pass


StageCommand = RunStep | Digest | Stop


class StageReport(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    ready: bool = False
    num_steps: int = 0
    num_graph_steps: int = 0
    """Steps this stage ran as a replayed device graph."""
    meta_digest: str = ""
    """sha256 over the TokenFrame metadata of every step this stage ran."""
    error: str = ""
    busy_s: float = 0.0
    """Seconds this stage spent running steps (the rest of its time it waited: the bubbles)."""
    beat: bool = False
    """A liveness beat (every BEAT_S from a thread of its own), not an answer to a command."""
    speculator: str = ""
    """The class of the speculator this stage built ("": none; drafters live on the last stage)."""
    drafter_bytes: int = 0
    """Bytes of the tensors that speculator holds (its weights, buffers and draft KV)."""
    num_sync_checked: int = 0
    """Decode steps this stage ran under the device's sync check (`stage_process.SYNC_DEBUG_ENV`)."""
    prefill_tokens: list[int] = msgspec.field(default_factory=list)
    """Ready: token buckets of the one-prompt step graphs this stage captured."""
    prompt_batches: list[tuple[int, int]] = msgspec.field(default_factory=list)
    """Ready: (rows, tokens) of the several-prompt step graphs this stage captured."""


BEAT_S = 0.5
"""How often a stage beats; the engine core calls one silent for HUNG_S hung."""
HUNG_S = 2.0
"""Below the frontend's 3 s core heartbeat timeout: the core, blocked on the stage meanwhile,
names the stage before the frontend gives up on the core."""
