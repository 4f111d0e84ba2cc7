"""Engine configuration: one frozen struct that travels to the engine-core process."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .errors import InvalidInputError
from .sampling_params import MAX_INT32, MAX_INT64, Seed, strict_fields

Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT32)]
LogLevel = Annotated[str, msgspec.Meta(pattern="^(?i:debug|info|warning|error|critical)$")]

CONTEXT_CAP = 4096
"""Where `max_model_len=None` caps a model's context: the one definition the engine and the CLI
read (a longer context is there for the asking)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
"""The names `platform.DTYPES` maps to torch dtypes, here so a bad dtype fails before the platform loads."""
GRAMMAR_DRAFTS = 4
"""Without a speculator, the most tokens a grammar forces that a row verifies in one step (with
one: K), so such steps keep the shape of the graphs captured for them."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "smollm2-135m"
    """A built-in model name, a GGUF file or a safetensors folder."""
    platform: str | None = None
    """None picks the highest-priority available platform."""
    dtype: str | None = None
    """None takes the platform's default (float32 on CPU, bfloat16 on CUDA)."""
    max_model_len: Annotated[int, msgspec.Meta(ge=2, le=MAX_INT32)] | None = None
    """None takes the model's context length, capped at CONTEXT_CAP (4096)."""
    block_size: Positive = 16
    kv_cache_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT64)] | None = None
    """Memory budget for the paged KV cache; None sizes it from the platform's free memory. A
    budget (or num_kv_blocks) too small for one request of max_model_len fails at start."""
    num_kv_blocks: Positive | None = None
    """Overrides kv_cache_bytes with an exact block count (tests use it to force preemption)."""
    max_num_seqs: Positive = 64
    max_num_batched_tokens: Positive = 2048
    seed: Seed | None = None
    """Seeds drawn for requests that bring none. None: fresh randomness on every start (two
    runs give different text); an int makes unseeded requests repeat across runs."""
    in_process: bool = False
    """Run the engine core inside the caller's event loop instead of its own process."""
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    log_level: LogLevel = "warning"
    """Level the engine-core process logs at, on its stderr (the CLI passes --log-level)."""
    speculator: str | None = None
    """A name from the `speckernel.speculators` entry points; None decodes without drafts."""
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] = 4
    draft_model: str | None = None
    """Checkpoint for speculators that run their own model (draft_model: the target if None)."""
    speculator_options: dict[str, str] = {}
    skip_drafts: bool = True
    """Allow K=0 steps when no scheduled request can use the drafts."""
    async_scheduling: bool = True
    """Schedule step N+1 while step N runs (decode requests without speculation run ahead on
    a placeholder for the token step N samples)."""
    enforce_eager: bool = False
    """Never replay captured device graphs (they are captured at start where the platform
    supports them and Triton kernels run)."""
    prompts_apart: bool = True
    """Where device graphs are captured, a prompt runs in steps of its own (one request, at most
    the largest captured prompt graph's tokens a step), taking turns with decode steps, so every
    step replays a graph; False lets prompts share decode steps, which then run eagerly."""
    prompt_steps_per_decode: Positive = 4
    """With prompts apart, while more than one prompt waits: prompt steps that may run between
    two decode steps (one prompt waiting: they alternate). A burst of arrivals gets its first
    tokens sooner; running requests wait up to that many prompt steps for their next token."""
    prompt_batches: bool = True
    """With prompts apart: graphs of steps that hold several prompts (up to 16, 2048 tokens, each
    row's chunk at most the largest one-prompt graph's) are captured too, and while several
    prompts wait they share such steps instead of taking one step each."""
    adaptive_speculation: bool | None = None
    """Let measured step times turn drafting off (K=0 steps) for batch sizes where verifying
    drafts costs more than it yields (`speckernel.kernel.spec_governor`). None: on where the
    step graphs of a speculator that drafts inside the step are timed at start (the governor
    then needs no plain steps to measure), off elsewhere."""
    allow_special_tokens: bool = False
    """Chat message content may spell control tokens ("<|im_end|>" becomes the token that ends a
    turn): for trusted callers only. By default such text in content is encoded as text."""
    batch_invariant: bool = False
    """Run the target's matmuls, attention, norms and activations with kernels whose results for a
    token do not depend on the other rows, its row's place in the batch or its row's query count
    (decode, verification, prefill chunk): speculative greedy output then equals plain greedy
    output token for token in any dtype, at some cost in speed (`speckernel bench invariant`)."""
    small_batch_kernels: bool = True
    """Where Triton runs, steps of at most 16 tokens (decode, verification) run each projection
    fused with its norm, rope, activation or residual add (`speckernel.ops.small_batch`); off:
    library GEMMs between the fused elementwise kernels (benchmarks compare the two)."""
    grammar_drafts: bool = True
    """Structured output: the tokens a request's grammar forces next (a fixed key, a closing
    brace) are verified as drafts, with or without a speculator (up to K, or GRAMMAR_DRAFTS without
    one): lossless, since the target verifies them, and counted apart (`num_forced_drafts`). Off:
    `--no-grammar-drafts`."""

    def forced_drafts(self, k: int, sampled_drafts: bool = False) -> int:
        """The most forced tokens a row verifies in a step: none beside a speculator whose drafts
        verification reads with their distribution, or on pipeline stages without one (their token
        frames are K wide)."""
        if not self.grammar_drafts or sampled_drafts:
            return 0
        return k if k or self.pipeline_parallel_size > 1 else GRAMMAR_DRAFTS
    grammar_graphs: bool = True
    """Structured output: steps with a grammar (prompt, decode and verification steps) replay
    device graphs of their own, captured at start beside the free ones (twice the graphs: start
    time and graph memory); off (`--no-grammar-graphs`), such steps run eagerly."""
    late_masks: bool | None = None
    """Structured output without a speculator: a constrained row runs ahead of its frame in flight
    like a free one. Its mask needs that frame's token, so the step's forward is launched first and
    its sampling waits on the device for the mask, which the host computes once the frame before is
    applied (the grammar works while the device runs the forward). A row whose grammar forces its
    next tokens waits for its frame instead, so they go in as drafts. Off (`--no-late-masks`): a
    constrained row always waits for its frame, and the grammar's work sits between its steps.
    None: on where the device runs apart from the host; off on the CPU, where the forward and the
    grammar share the cores and running ahead only forgoes forced drafts (8-20% slower there,
    `bench-results/cpu-grammar-late`)."""
    launch_on_loop: bool = True
    """Where a launch returns before the device runs the step (graphs and kernels queued on a
    stream, gates the stream waits on) and frames run ahead, the engine core launches each frame
    on its serving loop's thread, right after scheduling it. A runner thread there contends for
    the GIL with the loop's scheduling, applying and streaming, and each moment its launch waits
    for the GIL the device may stand idle. Off (`--no-launch-on-loop`), and wherever a launch
    can wait for the device (the CPU, a gate that blocks the host, pipeline stages), a runner
    thread launches."""
    sampling_graphs: bool = True
    """Steps where some row has a repetition, frequency or presence penalty or asks for logprobs
    replay device graphs of their own (decode and verification steps, captured a third time:
    start time and graph memory); off (`--no-sampling-graphs`), such steps run eagerly. A prompt
    step with either, and a step with either under a grammar, run eagerly."""
    force_host_drafts: bool = False
    """Copy draft IDs to the host after every drafting step even when the speculator's fixed
    width makes it unnecessary (benchmarks measure what avoiding the copy saves)."""

    pipeline_parallel_size: Positive = 1
    """Stage processes the target's layers are split over (contiguous slices, one per stage),
    started by the engine core with torch.distributed's env:// rendezvous on the platform's
    `dist_backend`; 1 runs the whole model in the engine core."""
    pipeline_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """The stages' rendezvous port (MASTER_PORT) on `pipeline_host`; 0 takes a free one."""
    pipeline_host: str = "127.0.0.1"
    """Where the stages meet: the rendezvous, the links between stages and the engine core's
    sockets listen on this address (an IP address of this host that every stage reaches)."""
    pipeline_transport: str | None = None
    """The transport (a `speckernel.transports` entry-point name) of the links between stages
    and of the last stage's token frames to the engine core; None takes the first installed of
    the platform's `preferred_transports`."""
    data_parallel_size: Positive = 1
    """Engine-core ranks behind the frontend, each with its own model and requests; every step
    they agree in one all-reduce on the padded batch size and on skipping drafts."""
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] = 0
    """This core's rank (the frontend sets it for each core it starts)."""
    data_parallel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Where the ranks meet (rank 0 listens); the frontend picks a free one."""

    def validate(self) -> EngineConfig:
        """The same config with exact types within each field's bounds (numpy scalars become
        int), or InvalidInputError naming the field: a bool or float where an int belongs, a
        negative budget, a seed past int64."""
        config = strict_fields(self, InvalidInputError)
        if config.speculator is not None and config.num_speculative_tokens < 1:
            raise InvalidInputError(
                f"num_speculative_tokens: expected >= 1 with a speculator, got {config.num_speculative_tokens}")
        return config
