"""MTP, DeepSeek-V3 style: `eh_proj(cat[enorm(embed(token)), hnorm(feature)])`, one decoder
block, then the shared head (its own `shared_head.norm`, the target's output projection),
chained for K > 1 with the block's output as the next feature. The feature of a confirmed
position is the target's last hidden state.

Checkpoint names follow DeepSeek's MTP layer: `enorm`, `hnorm`, `eh_proj`, `input_layernorm`,
`self_attn.*`, `post_attention_layernorm`, `mlp.*`, `shared_head.norm`. Fixed width.
"""

from __future__ import annotations

import torch
from torch import nn

from speckernel.plugin import ModelConfig, TargetModel
from speckernel.speculators.chain import ChainModule, ChainSpeculator
from speckernel.speculators.learned import Attend, DecoderBlock, DrafterConfig, Norm, TargetShape


class SharedHead(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpModule(ChainModule):
    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, target, max_len)
        h = cfg.hidden_size
        self.enorm = Norm(h, cfg.rms_norm_eps)
        self.hnorm = Norm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        block = DecoderBlock(cfg)
        self.input_layernorm, self.self_attn = block.input_layernorm, block.self_attn
        self.post_attention_layernorm, self.mlp = block.post_attention_layernorm, block.mlp
        self.shared_head = SharedHead(cfg)

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[self.config.target_layers[0]]

    def run(self, embedded: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: Attend) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(feature)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor, target: TargetModel) -> torch.Tensor:
        assert target.head is not None, "mtp declares uses_target_weights"
        return target.head(self.shared_head.norm(out))


class MtpSpeculator(ChainSpeculator):
    name = "mtp"
    Module = MtpModule

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        return DrafterConfig(method="mtp", target=TargetShape.of(target), hidden_size=target.hidden_size,
                             intermediate_size=1024, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                             head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                             target_layers=(target.num_layers - 1,), num_steps=3)
