"""GGUF files (read with `gguf`): the model config, the tokenizer and the weights, and the
converted cache that makes later starts load in a second.

Parsing GGUF metadata and dequantizing takes several seconds, and every engine start would pay
it twice (frontend and core), so a GGUF file is converted once into a folder of fused fp32
safetensors, the model config and an HF-style tokenizer. The frontend finds a finished
conversion without torch; only converting imports it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import msgspec
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from ..errors import InvalidInputError, UnknownModelError
from ..model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from .builtin import builtin_source
from .cache import TEMP_PREFIX, cache_dir, remove_stale_temps, sigterm_raises
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


GGUF_PIECES = {
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_norm": "input_norm", "ffn_norm": "post_norm",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
}  # fmt: skip


GGUF_GLOBALS = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


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


def iter_gguf(reader: Any, cfg: ModelConfig, desc: str = "loading weights") -> Iterator[tuple[str, torch.Tensor]]:
    import torch  # only converting makes tensors; the frontend reads a finished conversion without torch

    permuted = cfg.architecture in ("llama", "mistral")
    for t in tqdm(reader.tensors, desc=desc, unit="tensor", leave=False, disable=None):
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


GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Mirror of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def tokenizer_from_gguf(reader: Any, path: Path) -> Tokenizer:
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnknownModelError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is); "
            "use the safetensors folder with its tokenizer.json instead"
        )
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = byte_level_pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == GGUF_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == GGUF_USER_DEFINED])
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    return Tokenizer(
        tok,
        gguf_field(reader, "tokenizer.chat_template"),
        gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
        bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )


# --- the converted cache --------------------------------------------------------------------


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
    started = time.monotonic()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        convert(path, folder)
    except OSError as e:
        raise DamagedCheckpointError(f"cannot write the converted model to {folder.parent} ({e.strerror or e}); "
                                     "set SPECKERNEL_CACHE to a writable folder") from None
    prune_conversions(path, folder)
    # A bar showed the conversion on a terminal; a log learns of it afterwards (a damaged file
    # fails in one line, with nothing before it).
    print(f"speckernel: converted {path.name} in {time.monotonic() - started:.1f}s (once; kept in {folder})",
          file=sys.stderr)
    return folder


def read_gguf(path: Path) -> Any:
    """The GGUF reader of `path`, or a one-line error naming the file and what to do."""
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise damaged(path, e) from None


def damaged(path: Path, error: BaseException) -> DamagedCheckpointError:
    model = builtin_source(path)
    what = (f"delete it and run again to fetch {model.name} anew" if model is not None
            else "download or export it again")
    return DamagedCheckpointError(f"{path} is truncated or corrupt ({type(error).__name__}: {error}); {what}")


def write_conversion(path: Path, out: Path) -> None:
    """The GGUF file's weights, config and tokenizer, written into the folder `out`."""
    # Converting needs torch (safetensors.torch, the weight assembly); reading a conversion does not.
    from safetensors.torch import save_file

    from .weights import assemble

    reader = read_gguf(path)
    cfg = gguf_config(reader)
    try:
        state = assemble(dict(iter_gguf(reader, cfg, f"converting {path.name} (once)")), cfg)
    except (ValueError, IndexError, KeyError) as e:
        raise damaged(path, e) from None
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
    tokenizer_from_gguf(reader, path).save(out)
    (out / MODEL_CONFIG).write_bytes(msgspec.json.encode(cfg))


def convert(path: Path, folder: Path) -> None:
    """write_conversion into a temporary folder, then the manifest, then one rename: a folder
    under the final name is always complete, and an interrupted one leaves nothing behind."""
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
