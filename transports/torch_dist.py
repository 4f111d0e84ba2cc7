"""torch.distributed transport: token frames and hidden states as p2p messages on a process
group of the platform's backend (gloo on CPU, nccl on CUDA, hccl on Ascend).

A frame travels as one int64 tensor whose size follows from (max_rows, max_k), which both ends
know, so a receiver posts its buffer before the frame exists. A receive waits at most its
timeout and stays posted, so the next call picks up where it left; a peer that is gone makes
the backend fail the receive, which surfaces as ConnectionError (or TimeoutError when the
backend only notices by waiting). Hidden states carry their shape in a small header message.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import torch

from speckernel.transport import TokenFrame, TransportCapabilities

FRAME_TAG, HEADER_TAG, HIDDEN_TAG = 1, 2, 3
MAX_DIMS = 4


def pack(frame: TokenFrame) -> np.ndarray:
    return np.concatenate([
        np.array([frame.step_id, int(frame.k0)], np.int64), frame.req_ids, frame.generations, frame.slots,
        frame.kinds.astype(np.int64), frame.accepted.astype(np.int64), frame.lengths.astype(np.int64),
        frame.tokens.reshape(-1), frame.drafts.reshape(-1)])


def unpack(flat: np.ndarray, max_rows: int, max_k: int) -> TokenFrame:
    r = max_rows
    cols = [flat[2 + i * r : 2 + (i + 1) * r] for i in range(6)]
    tokens_at = 2 + 6 * r
    drafts_at = tokens_at + r * (1 + max_k)
    return TokenFrame(
        step_id=int(flat[0]), req_ids=cols[0].copy(), generations=cols[1].copy(), slots=cols[2].copy(),
        kinds=cols[3].astype(np.int8), accepted=cols[4].astype(np.int32), lengths=cols[5].astype(np.int32),
        tokens=flat[tokens_at:drafts_at].reshape(r, 1 + max_k).copy(),
        drafts=flat[drafts_at:].reshape(r, max_k).copy(), k0=bool(flat[1]))


class TorchDistTransport:
    name = "torch_dist"
    capabilities = TransportCapabilities(cross_process=True, zero_copy=False)

    def __init__(self, group: Any, peer: int, max_rows: int, max_k: int,
                 device: torch.device | str = "cpu") -> None:
        """`group`: a torch.distributed ProcessGroup (a stage process passes its default group,
        `torch.distributed.group.WORLD`); `peer`: the other end's rank in it."""
        self.group, self.peer = group, peer
        self.max_rows, self.max_k = max_rows, max_k
        self.device = torch.device(device)
        self.size = 2 + 6 * max_rows + max_rows * (1 + 2 * max_k)
        self.posted: dict[int, tuple[Any, torch.Tensor]] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.closed = False

    def _send(self, tensor: torch.Tensor, tag: int) -> None:
        if self.closed:
            raise ConnectionError("torch_dist transport is closed")
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        self.sends.append((self.group.send([tensor], self.peer, tag), tensor))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int, timeout_s: float | None) -> torch.Tensor:
        if self.closed:
            raise ConnectionError("torch_dist transport is closed")
        if tag not in self.posted:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.posted[tag] = (self.group.recv([buf], self.peer, tag), buf)
        work, buf = self.posted[tag]
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "imed out" in str(e) or "imeout" in str(e):
                raise TimeoutError(f"no message from rank {self.peer} within {timeout_s} s") from None
            self.posted.pop(tag, None)
            raise ConnectionError(f"rank {self.peer}: {e}") from e
        self.posted.pop(tag)
        return buf

    def send_frame(self, frame: TokenFrame) -> None:
        if frame.tokens.shape != (self.max_rows, 1 + self.max_k):
            raise ValueError(f"frame of shape {frame.tokens.shape}; this transport carries "
                             f"({self.max_rows}, {1 + self.max_k})")
        self._send(torch.from_numpy(pack(frame)).to(self.device), FRAME_TAG)

    def recv_frame(self, timeout_s: float | None = None) -> TokenFrame:
        buf = self._recv((self.size,), torch.int64, FRAME_TAG, timeout_s)
        return unpack(buf.cpu().numpy(), self.max_rows, self.max_k)

    def send_hidden(self, step_id: int, hidden: np.ndarray) -> None:
        if hidden.ndim > MAX_DIMS:
            raise ValueError(f"hidden states of {hidden.ndim} dims; at most {MAX_DIMS}")
        header = np.zeros(2 + MAX_DIMS, np.int64)
        header[0], header[1], header[2 : 2 + hidden.ndim] = step_id, hidden.ndim, hidden.shape
        self._send(torch.from_numpy(header), HEADER_TAG)
        self._send(torch.from_numpy(np.ascontiguousarray(hidden, np.float32)).to(self.device), HIDDEN_TAG)

    def recv_hidden(self, timeout_s: float | None = None) -> tuple[int, np.ndarray]:
        header = self._recv((2 + MAX_DIMS,), torch.int64, HEADER_TAG, timeout_s).tolist()
        shape = tuple(header[2 : 2 + header[1]])
        data = self._recv(shape, torch.float32, HIDDEN_TAG, timeout_s)
        return header[0], data.cpu().numpy()

    def close(self) -> None:
        self.closed = True
