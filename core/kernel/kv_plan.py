"""How many KV blocks the engine gets and what context they hold, decided once at start.

One request must always fit alone in the cache, or preemption could never make progress: a
cache too small for `max_model_len` either fails (when the user sized the cache or asked for
that context) or lowers the context with a warning (when both were defaults).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .. import log
from ..config import EngineConfig
from ..errors import InvalidInputError


class KvPlan(msgspec.Struct, frozen=True, kw_only=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    """The context each request is held to: the one asked for, or less where the cache is small."""
    lookahead_slots: int
    """KV slots a request holds past its tokens for its drafts."""
    bytes_per_block: int
    """Target KV plus the speculator's draft KV, per block."""
    draft_kv_bytes_per_token: int

    @property
    def draft_kv_bytes(self) -> int:
        """The speculator's draft-KV memory, carved per cache slot (0: it keeps none)."""
        return self.num_blocks * self.block_size * self.draft_kv_bytes_per_token

    def blocks_per_request(self, num_speculative_tokens: int) -> int:
        """Block-table width: the context, the lookahead, K drafts and the bonus token."""
        return -(-(self.max_model_len + self.lookahead_slots + num_speculative_tokens + 1) // self.block_size)


def plan_kv_cache(config: EngineConfig, *, context: int, target_bytes_per_block: int, lookahead_slots: int,
                  draft_kv_bytes_per_token: int, budget_bytes: Callable[[], int]) -> KvPlan:
    """The block count from `num_kv_blocks`, else from `kv_cache_bytes`, else from the platform's
    `budget_bytes()`; the context held (at most `context`), or InvalidInputError naming what
    would fit."""
    block_size = config.block_size
    per_block = target_bytes_per_block + draft_kv_bytes_per_token * block_size
    num_blocks = config.num_kv_blocks or max(1, (config.kv_cache_bytes or budget_bytes()) // per_block)
    held = num_blocks * block_size - lookahead_slots
    if held < context:  # a cache the user sized, or a context they asked for, fails; a default warns
        need = -(-(context + lookahead_slots) // block_size)
        why = (f"a KV cache of {num_blocks} blocks holds {held} tokens per request, below max_model_len "
               f"{context}; give it {need} blocks ({need * per_block} bytes) or lower max_model_len")
        if held < 2 or config.kv_cache_bytes or config.num_kv_blocks or config.max_model_len:
            raise InvalidInputError(why)
        log.get("engine_core").warning("kv_cache_shrinks_context", max_model_len=context, context=held, reason=why)
    return KvPlan(num_blocks=num_blocks, block_size=block_size, max_model_len=min(context, held),
                  lookahead_slots=lookahead_slots, bytes_per_block=per_block,
                  draft_kv_bytes_per_token=draft_kv_bytes_per_token)
