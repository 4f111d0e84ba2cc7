"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

import math

import msgspec

from .errors import InvalidSamplingParamsError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    top_p: float = 1.0
    seed: int | None = None
    """Fixes the random stream of this request alone: same seed, same tokens, whatever the batch."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured_output: bool = False
    """Reserved for the grammar engine: forces draft IDs to the host for validation."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        def bad(field: str, expected: str, got: object) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{field}: expected {expected}, got {got!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 disables it)", self.top_k)
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "a number in (0, 1]", self.top_p)
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2**63)", self.seed)
        if any(not s for s in self.stop):
            raise bad("stop", "non-empty strings", self.stop)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"token ids in [0, {vocab_size})", self.stop_token_ids)
        return self
