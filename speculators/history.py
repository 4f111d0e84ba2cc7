"""Per-request token history that speculators keep in step with the ledger's confirmed tokens."""

from __future__ import annotations

from speckernel.speculator import ProposeRow


class TokenHistory:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def update(self, row: ProposeRow) -> list[int]:
        """Everything before the step stays; the step's inputs and confirmed tokens follow."""
        tokens = self.tokens.setdefault(row.req_id, [])
        del tokens[row.start_pos :]
        tokens.extend(row.input_token_ids)
        tokens.extend(row.new_token_ids)
        return tokens

    def release(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)
