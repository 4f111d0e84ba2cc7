"""Engine configuration: one frozen struct that travels to the engine-core process."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "smollm2-135m"
    """A built-in model name, a GGUF file or a safetensors folder."""
    platform: str | None = None
    """None picks the highest-priority available platform."""
    dtype: str | None = None
    """None takes the platform's default (float32 on CPU, bfloat16 on CUDA)."""
    max_model_len: int | None = None
    """None takes the model's context length, capped at 4096."""
    block_size: int = 16
    kv_cache_bytes: int | None = None
    """Memory budget for the paged KV cache; None sizes it from the platform's free memory."""
    num_kv_blocks: int | None = None
    """Overrides kv_cache_bytes with an exact block count (tests use it to force preemption)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int | None = None
    """Seeds drawn for requests that bring none. None: fresh randomness on every start (two
    runs give different text); an int makes unseeded requests repeat across runs."""
    in_process: bool = False
    """Run the engine core inside the caller's event loop instead of its own process."""
    startup_timeout_s: float = 300.0
    log_level: str = "warning"
    speculator: str | None = None
    """A name from the `speckernel.speculators` entry points; None decodes without drafts."""
    num_speculative_tokens: int = 4
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
    adaptive_speculation: bool = False
    """Let measured step times turn drafting off (K=0 steps) for batch sizes where verifying
    drafts costs more than it yields (`speckernel.spec_governor`)."""
    force_host_drafts: bool = False
    """Copy draft IDs to the host after every drafting step even when the speculator's fixed
    width makes it unnecessary (benchmarks measure what avoiding the copy saves)."""

    def validate(self) -> EngineConfig:
        from .errors import InvalidInputError

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidInputError(f"num_kv_blocks: expected >= 1, got {self.num_kv_blocks}")
        if self.speculator is not None and self.num_speculative_tokens < 1:
            raise InvalidInputError(
                f"num_speculative_tokens: expected >= 1 with a speculator, got {self.num_speculative_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidInputError(f"max_model_len: expected >= 2, got {self.max_model_len}")
        return self
