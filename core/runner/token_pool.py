"""One token buffer on the device, [slots, width]: every request's prompt, output and drafts.

A running request owns one slot (row). The host writes only tokens it knows (prompt chunks,
tokens confirmed by an applied step); tokens sampled, verified or drafted on the device are
written there by the step that made them. Step inputs, placeholder inputs, stored drafts and
every speculator's view of a history are read from here; nobody keeps a second copy.

Device state is keyed by (slot, generation, step id): `owner` records, per slot, the request
generation and the step that last completed on it, so a row that reads a predecessor's output
can tell whether that predecessor really ran.
"""

from __future__ import annotations

import torch

NONE = -1


class TokenPool:
    def __init__(self, num_slots: int, width: int, device: torch.device) -> None:
        self.tokens = torch.full((num_slots, width), NONE, dtype=torch.int64, device=device)
        self.device = device
        self.owner: list[tuple[int, int] | None] = [None] * num_slots
        """Per slot: (generation, step id) of the last step that completed for it."""

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def write(self, slots: torch.Tensor, start: torch.Tensor, values: torch.Tensor) -> None:
        """values [R, N] at positions start[r] .. start[r] + N - 1 of slots[r], on the device,
        without a host sync; positions past the end land in the last column, a spare one that
        is never read (the engine sizes the buffer so only padding goes there)."""
        n = values.shape[1]
        if not n or not len(slots):
            return
        pos = (start[:, None] + torch.arange(n, device=self.device)[None, :]).clamp(max=self.width - 1)
        self.tokens[slots[:, None].expand_as(pos), pos] = values

    def completed(self, slot: int, generation: int, step_id: int) -> None:
        self.owner[slot] = (generation, step_id)

    def failed(self, slot: int) -> None:
        self.owner[slot] = None

    def ran(self, slot: int, generation: int, step_id: int) -> bool:
        return self.owner[slot] == (generation, step_id)
