"""Paged KV-cache accounting: block tables and a free list, nothing else."""

from __future__ import annotations

from collections import deque

from .request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Grows req's block table to hold num_tokens; False (and no change) if blocks run out."""
        missing = self.blocks_needed(num_tokens) - len(req.block_ids)
        if missing <= 0:
            return True
        if missing > len(self.free_blocks):
            return False
        req.grant_blocks(self.free_blocks.popleft() for _ in range(missing))
        return True

    def free(self, req: Request) -> None:
        self.free_blocks.extend(req.release_blocks())
