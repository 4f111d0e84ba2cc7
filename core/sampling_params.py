"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

import math
import numbers

import msgspec

from .errors import InvalidSamplingParamsError

MAX_INT32 = 2**31 - 1
MIN_TEMPERATURE = 1e-5
"""Temperatures in (0, MIN_TEMPERATURE) sample greedily: dividing logits by less overflows."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    max_tokens: int = 128
    temperature: float = 1.0
    """0 is greedy; below 1e-5 counts as 0."""
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
        """The same parameters with exact Python types (numpy scalars become int/float, a list
        of stop strings a tuple), or InvalidSamplingParamsError naming the field. Everything
        that passes here also encodes to the core: a value the core could not decode would
        leave the caller waiting."""

        def bad(field: str, expected: str, got: object) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{field}: expected {expected}, got {got!r}")

        def integer(field: str, value: object, lo: int, hi: int) -> int:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= int(value) <= hi:
                raise bad(field, f"an integer in [{lo}, {hi}]", value)
            return int(value)

        def real(field: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise bad(field, "a finite number", value)
            return float(value)

        def flag(field: str, value: object) -> bool:
            if not isinstance(value, bool):
                raise bad(field, "true or false", value)
            return value

        max_tokens = integer("max_tokens", self.max_tokens, 1, MAX_INT32)
        temperature = real("temperature", self.temperature)
        if temperature < 0:
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if temperature < MIN_TEMPERATURE:  # logits / 1e-45 overflow to inf: this close to 0 is greedy
            temperature = 0.0
        top_k = integer("top_k", self.top_k, 0, MAX_INT32)
        top_p = real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]", self.top_p)
        seed = None if self.seed is None else integer("seed", self.seed, 0, 2**63 - 1)
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple | list) \
                or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a sequence of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, tuple | list):
            raise bad("stop_token_ids", "a sequence of token ids", self.stop_token_ids)
        top_id = (vocab_size or 2**31) - 1
        stop_ids = tuple(integer("stop_token_ids", t, 0, top_id) for t in self.stop_token_ids)
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              stop=tuple(self.stop), stop_token_ids=stop_ids,
                              ignore_eos=flag("ignore_eos", self.ignore_eos),
                              structured_output=flag("structured_output", self.structured_output))
