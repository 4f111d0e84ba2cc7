"""Checkpoint loading: GGUF files (through `gguf`) and Hugging Face safetensors folders.

Both formats are mapped onto one set of per-layer piece names, then fused into the
model's qkv and gate_up projections. Names `random:...` build a random-weight model of a
preset's shape instead (see synthetic.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from speckernel.errors import InvalidInputError, UnknownModelError
from speckernel.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, from_hf_config

if TYPE_CHECKING:  # torch loads only where weights do: the frontend finds a converted model without it
    import torch

    from speckernel.models.llama import LlamaModel

GGUF_PIECES = {
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_norm": "input_norm", "ffn_norm": "post_norm",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}  # fmt: skip
HF_PIECES = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
    "mlp.down_proj": "down", "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm", "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
}  # fmt: skip
GGUF_GLOBALS = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
HF_GLOBALS = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def is_random(path: str | Path) -> bool:
    return str(path).startswith("random:")


def checkpoint_format(path: Path) -> str:
    if is_random(path):
        return "random"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return "safetensors"
    raise UnknownModelError(
        f"{path} is neither a .gguf file nor a folder with config.json and *.safetensors"
    )


# --- GGUF -------------------------------------------------------------------------------


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnknownModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    tensors = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    scaling_kind = meta("rope.scaling.type", "default") or "default"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(
            kind="default" if scaling_kind == "none" else scaling_kind,
            factor=float(meta("rope.scaling.factor", 1.0)),
            original_max_position=meta("rope.scaling.original_context_length"),
        ),
        max_position=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
    )


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows so the rotate-half RoPE applies."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(reader: Any, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    import numpy as np
    import torch
    from tqdm import tqdm

    permuted = cfg.architecture in ("llama", "mistral")
    for t in tqdm(reader.tensors, desc="loading weights", unit="tensor", leave=False, disable=None):
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable or not array.flags.c_contiguous:  # F32 tensors map the file
            array = array.copy()
        tensor = torch.from_numpy(array)
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, piece, kind = int(parts[1]), GGUF_PIECES.get(parts[2]), parts[3]
            if piece is None:
                continue
            if permuted and piece in ("q", "k"):
                tensor = unpermute_qk(tensor, cfg.num_heads if piece == "q" else cfg.num_kv_heads)
            yield f"layers.{layer}.{piece}.{kind}", tensor
        elif parts[0] in GGUF_GLOBALS:
            yield f"{GGUF_GLOBALS[parts[0]]}.{parts[1]}", tensor


# --- safetensors ---------------------------------------------------------------------------


def hf_config(folder: Path) -> ModelConfig:
    return from_hf_config(json.loads((folder / "config.json").read_text()))


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(folder.glob("*.safetensors"))
    for file in tqdm(files, desc="loading shards", unit="shard", leave=False, disable=None):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                mapped = map_hf_name(name)
                if mapped is not None:
                    yield mapped, f.get_tensor(name)


def map_hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in HF_GLOBALS:
        return f"{HF_GLOBALS[stem]}.{kind}"
    if stem.startswith("model.layers."):
        _, _, idx, rest = stem.split(".", 3)
        piece = HF_PIECES.get(rest)
        return None if piece is None else f"layers.{idx}.{piece}.{kind}"
    return None


# --- assembly ------------------------------------------------------------------------------


FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
MODULE_OF = {"o": "attn.o", "down": "mlp.down", "q_norm": "attn.q_norm", "k_norm": "attn.k_norm",
             "input_norm": "input_norm", "post_norm": "post_norm"}  # fmt: skip


def assemble(pieces: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    import torch

    state: dict[str, torch.Tensor] = {}
    for name in ("embed.weight", "norm.weight", "lm_head.weight"):
        if name in pieces:
            state[name] = pieces.pop(name)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for fused, parts in FUSED.items():
            owner = "attn" if fused == "qkv" else "mlp"
            for kind in ("weight", "bias"):
                if all(f"{p}{part}.{kind}" in pieces for part in parts):
                    state[f"{p}{owner}.{fused}.{kind}"] = torch.cat(
                        [pieces.pop(f"{p}{part}.{kind}") for part in parts]
                    )
        for piece, module in MODULE_OF.items():
            for kind in ("weight", "bias"):
                if f"{p}{piece}.{kind}" in pieces:
                    state[f"{p}{module}.{kind}"] = pieces.pop(f"{p}{piece}.{kind}")
    return state


CONVERTED_VERSION = 2
MODEL_CONFIG, WEIGHTS, MANIFEST = "speckernel_model.json", "speckernel_model.safetensors", "speckernel_manifest.json"


class Manifest(msgspec.Struct, frozen=True):
    """Written last into a converted folder: the source it came from and every file's size, so
    a truncated or half-deleted conversion is seen with a few stat calls."""

    source: str
    sizes: dict[str, int]


class DamagedCheckpointError(InvalidInputError):
    """A model file that cannot be read (truncated, corrupt); the message says what to do."""


def converted_folder(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTED_VERSION}".encode())
    from speckernel.models.builtin import cache_dir

    return cache_dir() / "converted" / f"{path.stem}-{key.hexdigest()[:16]}"


def intact(folder: Path) -> bool:
    """The folder holds a finished conversion whose files still have the sizes written."""
    try:
        manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=Manifest)
        return all((folder / name).stat().st_size == size for name, size in manifest.sizes.items())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return False


def converted(path: Path) -> Path:
    """A GGUF file converted once into a folder that loads in a second: fused fp32 safetensors,
    the model config and an HF-style tokenizer. Parsing GGUF metadata and dequantizing takes
    several seconds, and every engine start would pay it twice (frontend and core). A damaged
    conversion is converted again."""
    folder = converted_folder(path)
    if intact(folder):
        return folder
    if folder.exists():
        print(f"speckernel: converted cache {folder} is incomplete or damaged; converting {path} again",
              file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        convert(path, folder)
    except OSError as e:
        raise DamagedCheckpointError(f"cannot write the converted model to {folder.parent} ({e.strerror or e}); "
                                     "set SPECKERNEL_CACHE to a writable folder") from None
    prune_conversions(path, folder)
    return folder


def read_gguf(path: Path) -> Any:
    """The GGUF reader of `path`, or a one-line error naming the file and what to do."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise damaged(path, e) from None


def damaged(path: Path, error: BaseException) -> DamagedCheckpointError:
    from speckernel.models.builtin import builtin_source

    model = builtin_source(path)
    what = (f"delete it and run again to fetch {model.name} anew" if model is not None
            else "download or export it again")
    return DamagedCheckpointError(f"{path} is truncated or corrupt ({type(error).__name__}: {error}); {what}")


def write_conversion(path: Path, out: Path) -> None:
    """The GGUF file's weights, config and tokenizer, written into the folder `out`."""
    from safetensors.torch import save_file

    from speckernel.models.tokenizer import Tokenizer

    reader = read_gguf(path)
    cfg = gguf_config(reader)
    try:
        state = assemble(dict(iter_gguf(reader, cfg)), cfg)
    except (ValueError, IndexError, KeyError) as e:
        raise damaged(path, e) from None
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
    Tokenizer.from_gguf_reader(reader, path).save(out)
    (out / MODEL_CONFIG).write_bytes(msgspec.json.encode(cfg))


def convert(path: Path, folder: Path) -> None:
    """write_conversion into a temporary folder, then the manifest, then one rename: a folder
    under the final name is always complete, and an interrupted one leaves nothing behind."""
    from speckernel.models.builtin import TEMP_PREFIX, remove_stale_temps, sigterm_raises

    remove_stale_temps(folder.parent)
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix=TEMP_PREFIX, dir=folder.parent) as tmp:
        write_conversion(path, Path(tmp))
        sizes = {f.name: f.stat().st_size for f in Path(tmp).iterdir()}
        Path(tmp, MANIFEST).write_bytes(msgspec.json.encode(Manifest(str(path.resolve()), sizes)))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process converted it first
            pass
        else:
            os.mkdir(tmp)  # TemporaryDirectory cleans up a path that must exist


def prune_conversions(path: Path, keep: Path) -> None:
    """Earlier conversions of the same file (before it changed, or by an older version, which
    wrote no manifest) are dead weight, hundreds of MB each: remove them."""
    source = str(path.resolve())
    for other in keep.parent.glob(f"{path.stem}-*"):
        if other == keep or not other.is_dir():
            continue
        try:
            stale = msgspec.json.decode((other / MANIFEST).read_bytes(), type=Manifest).source == source
        except FileNotFoundError:
            stale = True
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            stale = False
        if stale:
            shutil.rmtree(other, ignore_errors=True)


def read_config(path: Path) -> ModelConfig:
    if checkpoint_format(path) == "random":
        from speckernel.models.synthetic import random_config

        return random_config(path)
    if checkpoint_format(path) == "gguf":
        return msgspec.json.decode((converted(path) / MODEL_CONFIG).read_bytes(), type=ModelConfig)
    return hf_config(path)


def load_state(path: Path) -> dict[str, torch.Tensor]:
    if checkpoint_format(path) == "gguf":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = converted(path)
        try:
            return load_file(str(folder / WEIGHTS))
        except SafetensorError as e:
            shutil.rmtree(folder, ignore_errors=True)  # the next start converts again
            raise DamagedCheckpointError(f"converted cache {folder} is damaged ({e}); it was removed: "
                                         "run again to convert the model anew") from None
    return assemble(dict(iter_safetensors(path)), hf_config(path))


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Modules built here skip their random init (their weights are assigned next), and are
    built on the host rather than the meta device: there `normal_` and `arange` run through
    torch._refs, whose import of torch._dynamo costs seconds at every start."""
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    with SkipInit():
        yield


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_len: int) -> LlamaModel:
    from speckernel.models.llama import LlamaModel
    from speckernel.ops.rope import cos_sin_table

    cfg = read_config(path)
    if checkpoint_format(path) == "random":
        from speckernel.models.synthetic import random_model

        return random_model(cfg, dtype, device, max_len)
    state = load_state(path)
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
    return model
