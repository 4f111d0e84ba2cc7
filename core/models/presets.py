"""Random-weight models, named `random:PRESET[,FIELD=VALUE...]`: a real checkpoint's shapes
without its file, for measurements that depend on shapes alone (the time of a decode step does
not depend on what the weights hold).

`random:llama3-8b` has Llama-3-8B's shapes, `random:smollm2-135m` the default model's (a GPU
run of it needs no model file); `random:tiny` builds in milliseconds for tests. Any
ModelConfig field can follow the preset: `random:llama3-8b,num_layers=4`. Weights are drawn on
the target device from a fixed seed, so the 16 GB of an 8B model in bf16 never pass through the
host, and two loads of one name (a target and its draft_model) hold the same weights. The
presets name no end-of-sequence token: random logits would otherwise end requests at random.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..errors import UnknownModelError
from ..model_config import ModelConfig

PREFIX = "random:"


PRESETS = {
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=8192),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position=8192,
                                tie_word_embeddings=True),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position=2048),
}


def is_random(name: str | Path) -> bool:
    return str(name).startswith(PREFIX)


def random_config(name: str | Path) -> ModelConfig:
    """The preset's config with the overrides in the name applied (values converted to the
    field's type), or UnknownModelError naming what is wrong."""
    preset, *items = str(name).removeprefix(PREFIX).split(",")
    if preset not in PRESETS:
        raise UnknownModelError(f"unknown random model {str(name)!r}; presets: "
                                + ", ".join(PREFIX + p for p in PRESETS))
    fields = {f.name for f in msgspec.structs.fields(ModelConfig)}
    overrides: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise UnknownModelError(f"{str(name)!r}: expected FIELD=VALUE with a ModelConfig field, got {item!r}")
        overrides[key] = value
    raw = msgspec.to_builtins(PRESETS[preset]) | overrides
    try:
        return msgspec.convert(raw, ModelConfig, strict=False)
    except msgspec.ValidationError as e:
        raise UnknownModelError(f"{str(name)!r}: {e}") from None
