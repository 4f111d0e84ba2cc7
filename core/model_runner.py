"""Runs one StepFrame on the device: builds paged-attention metadata, forwards, samples."""

from __future__ import annotations

import numpy as np
import torch

from .frame import RowResult, StepFrame, StepResult
from .models.llama import AttentionMetadata, LlamaModel
from .sampler import sample


class ModelRunner:
    def __init__(self, model: LlamaModel, device: torch.device, num_blocks: int, block_size: int) -> None:
        cfg = model.cfg
        self.model = model
        self.device = device
        self.block_size = block_size
        dtype = model.embed.weight.dtype
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads,
                                    cfg.head_dim, dtype=dtype, device=device)

    @staticmethod
    def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:  # type: ignore[no-untyped-def]
        elem = torch.empty((), dtype=dtype).element_size()
        return model_cfg.num_layers * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem

    def metadata(self, frame: StepFrame) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids, positions, slots, ctx_slots, q_rows, k_rows, k_pos, sample_idx = [], [], [], [], [], [], [], []
        offset = 0
        for r, row in enumerate(frame.rows):
            n, end = len(row.token_ids), row.start_pos + len(row.token_ids)
            table = np.asarray(row.block_ids, dtype=np.int64)
            pos = np.arange(row.start_pos, end)
            ctx = np.arange(end)
            ids.append(np.asarray(row.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            ctx_slots.append(table[ctx // bs] * bs + ctx % bs)
            q_rows.append(np.full(n, r))
            k_rows.append(np.full(end, r))
            k_pos.append(ctx)
            offset += n
            if row.sampling is not None:
                sample_idx.append(offset - 1)
        q_pos, kp = np.concatenate(positions), np.concatenate(k_pos)
        mask = (np.concatenate(q_rows)[:, None] == np.concatenate(k_rows)[None, :]) & (kp[None, :] <= q_pos[:, None])

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        meta = AttentionMetadata(positions=dev(q_pos), slot_mapping=dev(np.concatenate(slots)),
                                 context_slots=dev(np.concatenate(ctx_slots)), mask=dev(mask))
        return dev(np.concatenate(ids)), meta, sample_idx

    @torch.inference_mode()
    def execute(self, frame: StepFrame) -> StepResult:
        input_ids, meta, sample_idx = self.metadata(frame)
        hidden = self.model(input_ids, self.kv_cache, meta)
        logits = self.model.logits(hidden[sample_idx])
        sampled = iter(sample(logits, [r.sampling for r in frame.rows if r.sampling is not None]))
        return StepResult(
            step_id=frame.step_id,
            rows=[RowResult(r.req_id, r.generation, [next(sampled)] if r.sampling is not None else [])
                  for r in frame.rows],
        )

    @torch.inference_mode()
    def prompt_logits(self, frame: StepFrame) -> torch.Tensor:
        """Logits of every position of a frame (tests compare them with a reference model)."""
        input_ids, meta, _ = self.metadata(frame)
        return self.model.logits(self.model(input_ids, self.kv_cache, meta))
