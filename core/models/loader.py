"""Weights onto the device: a resolved checkpoint (GGUF through its converted cache, in the
engine's dtype, or a safetensors folder) or a random-weight preset becomes a LlamaModel; the
start that converted a GGUF file says in one line where its time went.

Random weights are drawn on the target device from a fixed seed, so the 16 GB of an 8B model in
bf16 never pass through the host, and two loads of one name (a target and its draft_model) hold
the same weights."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from ..errors import UnknownModelError
from ..model_config import ModelConfig
from ..ops.rope import cos_sin_table
from .builtin import fetch_seconds
from .checkpoint import checkpoint_format, read_config
from .gguf import WEIGHTS, Conversion, DamagedCheckpointError, converted, converted_weights, manifest_of
from .hf_config import hf_config
from .llama import LlamaModel
from .weights import assemble, iter_safetensors

INIT_STD = 0.02


SEED = 0


def load_state(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; a GGUF file's from its weights converted to `dtype` (the cast
    the model's `.to(dtype)` makes, done once at conversion)."""
    if checkpoint_format(path) == "gguf":
        folder = converted_weights(path, dtype).folder
        try:
            return load_file(str(folder / WEIGHTS))
        except SafetensorError as e:
            shutil.rmtree(folder, ignore_errors=True)  # the next start converts again
            raise DamagedCheckpointError(f"converted cache {folder} is damaged ({e}); it was removed: "
                                         "run again to convert the model anew") from None
    return assemble(dict(iter_safetensors(path)), hf_config(path))


def conversion_line(path: Path, dtype: torch.dtype, conversion: Conversion, load_s: float) -> str:
    """Where a first start's time went, in one line: the fetch (of a built-in model), the
    conversion (config and tokenizer, then the weights; the first may have been another
    process's work, which its manifest times) and the load."""
    meta = manifest_of(converted(path))
    weights = manifest_of(conversion.folder)
    meta_s, weights_s = meta.seconds if meta is not None else 0.0, conversion.seconds or 0.0
    size = 0 if weights is None else sum(weights.sizes.values())
    fetch_s = fetch_seconds(path)
    fetch = "" if fetch_s is None else f"fetch {fetch_s:.1f}s, "
    return (f"speckernel: {path.name}: {fetch}converted once in {meta_s + weights_s:.1f}s (config and tokenizer "
            f"{meta_s:.1f}s, {str(dtype).removeprefix('torch.')} weights {weights_s:.1f}s), load {load_s:.1f}s; "
            f"kept in {conversion.folder} ({size / 2**20:.0f} MiB)")


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Modules built here skip their random init (their weights are assigned next), and are
    built on the host rather than the meta device: there `normal_` and `arange` run through
    torch._refs, whose import of torch._dynamo costs seconds at every start."""
    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    with SkipInit():
        yield


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_len: int) -> LlamaModel:
    cfg = read_config(path)
    if checkpoint_format(path) == "random":
        return random_model(cfg, dtype, device, max_len)
    conversion = converted_weights(path, dtype) if checkpoint_format(path) == "gguf" else None
    started = time.monotonic()
    state = load_state(path, dtype)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed.weight"]
    with skip_init():  # empty host tensors, replaced by the loaded ones below
        model = LlamaModel(cfg, max_len)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in ("cos", "sin")]
    if missing or unexpected:
        raise UnknownModelError(f"{path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    cos, sin = cos_sin_table(cfg, max_len)
    model.cos, model.sin = cos, sin
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.cos, model.sin = cos.to(device), sin.to(device)  # rotary tables stay float32
    if conversion is not None and conversion.seconds is not None:  # this process converted: a first start
        print(conversion_line(path, dtype, conversion, time.monotonic() - started), file=sys.stderr)
    return model


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int) -> LlamaModel:
    """Matrices ~ N(0, INIT_STD), norm weights 1, biases 0, allocated on `device` directly."""
    with torch.device("meta"), skip_init():  # the modules' own init on meta tensors imports torch._dynamo
        model = LlamaModel(cfg, max_len)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.ndim == 1:  # norm weights
            param.fill_(1.0)
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
    cos, sin = cos_sin_table(cfg, max_len)
    model.cos, model.sin = cos.to(device), sin.to(device)  # rotary tables stay float32, as loaded ones do
    return model.eval().requires_grad_(False)
