"""Checkpoint loaders and model shapes against HF transformers on small random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from speckernel.kernel.frame import ScheduledRow, StepFrame
from speckernel.model_config import ModelConfig, RopeScaling
from speckernel.models.gguf import unpermute_qk
from speckernel.models.loader import load_model
from speckernel.ops.rope import inv_frequencies
from speckernel.platforms.cpu import CpuPlatform
from speckernel.runner.model_runner import ModelRunner

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def logits_of(folder: Path, ids: list[int]) -> torch.Tensor:
    model = load_model(folder, torch.float32, torch.device("cpu"), 256)
    attention = CpuPlatform().attention_backend(block_size=16, max_tokens=256)
    runner = ModelRunner(model, torch.device("cpu"), num_blocks=8, block_size=16, attention=attention,
                         num_slots=1, max_model_len=128)
    frame = StepFrame(0, [ScheduledRow(0, 0, 0, 0, ids, list(range(8))[::-1], None)])
    return runner.prompt_logits(frame)


CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-untied-llama3-rope": (transformers.LlamaConfig, {"tie_word_embeddings": False, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-linear-rope": (transformers.LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn-rope": (transformers.LlamaConfig, {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": (transformers.MistralConfig, {"head_dim": 16, "sliding_window": None}),
    "qwen2-attention-bias": (transformers.Qwen2Config, {}),
    "qwen3-qk-norm": (transformers.Qwen3Config, {"head_dim": 32}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_safetensors_checkpoint_matches_hf(case: str, tmp_path: Path) -> None:
    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, config_cls.__name__.replace("Config", "ForCausalLM"))(
        config_cls(**SMALL, **extra)).eval()
    if case.startswith("qwen2"):
        for layer in hf.model.layers:  # random biases, so a dropped bias would show
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = [int(t) for t in torch.randint(0, 256, (40,))]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(tmp_path, ids), ref, rtol=1e-4, atol=1e-4)


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    n_head, head_dim, hidden = 4, 8, 16
    w = torch.randn(n_head * head_dim, hidden)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)  # llama.cpp
    assert torch.equal(unpermute_qk(permuted, n_head), w)


@pytest.mark.parametrize(
    "scaling",
    [RopeScaling(kind="linear", factor=4.0),
     RopeScaling(kind="llama3", factor=8.0, original_max_position=8192),
     RopeScaling(kind="yarn", factor=4.0, original_max_position=4096)],
)
def test_rope_frequencies_match_hf(scaling: RopeScaling) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(vocab_size=10, hidden_size=512, intermediate_size=8, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=128, rope_theta=500000.0, rope_scaling=scaling, max_position=32768)
    params = {"rope_type": scaling.kind, "factor": scaling.factor, "rope_theta": 500000.0,
              "original_max_position_embeddings": scaling.original_max_position,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf_cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=32768,
                                      rope_parameters=params)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[scaling.kind](hf_cfg, "cpu")
    inv, scale = inv_frequencies(cfg, 32768)
    torch.testing.assert_close(inv.float(), ref_inv.float(), rtol=1e-5, atol=1e-9)
    assert scale == pytest.approx(ref_scale)
