"""GGUF files (read with `gguf`): the model config, the tokenizer and the weights, and the
converted cache that makes later starts load in a second.

Parsing GGUF metadata takes seconds (a 50k-token vocabulary) and dequantizing more, and every
engine start would pay it twice (frontend and core). So a GGUF file is converted once per cache
entry, under a lock: its config, tokenizer and tensor table into one folder (all the frontend
reads, without torch), and its weights, dequantized and cast to the dtype the engine runs in,
into a folder per dtype (only the engine core converts those, from the tensor table, without
parsing the metadata again). The engine casts its weights to its dtype at load anyway, so a
bfloat16 entry (half an fp32 one) loads bit for bit the weights an fp32 one would.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
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
from .cache import TEMP_PREFIX, cache_dir, entry_lock, lock_path, remove_stale_temps, sigterm_raises
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


def iter_gguf(tensors: Iterable[tuple[str, int, np.ndarray]], cfg: ModelConfig, dtype: torch.dtype,
              desc: str = "loading weights") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, GGML type, raw data as the reader views it) → the model's piece names, dequantized
    and cast to `dtype` one tensor at a time (the cast the model's `.to(dtype)` would make)."""
    import torch  # only converting makes tensors; the frontend reads a finished conversion without torch

    permuted = cfg.architecture in ("llama", "mistral")
    for name, kind, data in tqdm(list(tensors), desc=desc, unit="tensor", leave=False, disable=None):
        array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind))
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable or not array.flags.c_contiguous:  # F32 tensors map the file
            array = array.copy()
        tensor = torch.from_numpy(array)
        parts = name.split(".")
        if parts[0] == "blk":
            layer, piece, kind_ = int(parts[1]), GGUF_PIECES.get(parts[2]), parts[3]
            if piece is None:
                continue
            if permuted and piece in ("q", "k"):
                tensor = unpermute_qk(tensor, cfg.num_heads if piece == "q" else cfg.num_kv_heads)
            yield f"layers.{layer}.{piece}.{kind_}", tensor.to(dtype)
        elif parts[0] in GGUF_GLOBALS:
            yield f"{GGUF_GLOBALS[parts[0]]}.{parts[1]}", tensor.to(dtype)


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


CONVERTED_VERSION = 3
"""3: config and tokenizer apart from the weights, which are kept in the engine's dtype."""


MODEL_CONFIG, WEIGHTS, MANIFEST = "speckernel_model.json", "speckernel_model.safetensors", "speckernel_manifest.json"


TENSORS = "speckernel_tensors.json"


class Manifest(msgspec.Struct, frozen=True):
    """Written last into a converted folder: the source it came from and every file's size, so
    a truncated or half-deleted conversion is seen with a few stat calls."""

    source: str
    sizes: dict[str, int]
    seconds: float = 0.0
    """How long the conversion took: the first start's summary line names it."""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor's data in the GGUF file, as the reader views it: the weights are converted
    from this table without parsing the file's metadata a second time."""

    name: str
    kind: int
    """Its GGMLQuantizationType."""
    offset: int
    dtype: str
    """The numpy dtype of its raw data (uint8 blocks for a quantized tensor), byte order included."""
    shape: list[int]


class DamagedCheckpointError(InvalidInputError):
    """A model file that cannot be read (truncated, corrupt); the message says what to do."""


class Conversion(msgspec.Struct, frozen=True):
    """A converted cache entry, and how long converting it took where this call did (None: it
    was there already, or another process converted it while this one waited)."""

    folder: Path
    seconds: float | None = None


def converted_folder(path: Path) -> Path:
    """The entry of `path`'s config and tokenizer; its weights' entries are named after it."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTED_VERSION}".encode())
    return cache_dir() / "converted" / f"{path.stem}-{key.hexdigest()[:16]}"


def weights_folder(path: Path, dtype: torch.dtype) -> Path:
    meta = converted_folder(path)
    return meta.with_name(f"{meta.name}-{str(dtype).removeprefix('torch.')}")


def intact(folder: Path) -> bool:
    """The folder holds a finished conversion whose files still have the sizes written."""
    return manifest_of(folder) is not None


def manifest_of(folder: Path) -> Manifest | None:
    """The manifest of a finished conversion whose files still have the sizes written."""
    try:
        manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=Manifest)
        ok = all((folder / name).stat().st_size == size for name, size in manifest.sizes.items())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return manifest if ok else None


def converted(path: Path) -> Path:
    """The folder of a GGUF file's config, tokenizer and tensor table: converted once (the
    first caller converts, one that comes meanwhile waits for it and reads its result)."""
    return convert_once(path, converted_folder(path), lambda out: write_conversion(path, out)).folder


def converted_weights(path: Path, dtype: torch.dtype) -> Conversion:
    """The folder of a GGUF file's weights dequantized, fused and cast to `dtype`, converted
    once per dtype (as `converted`)."""
    meta = converted(path)
    return convert_once(path, weights_folder(path, dtype), lambda out: write_weights(path, meta, dtype, out))


def convert_once(path: Path, folder: Path, write: Callable[[Path], None]) -> Conversion:
    """`folder` as `write` fills it, written once: under the entry's lock, a finished entry is
    reused and a damaged one converted again. An OSError is one line naming the cache."""
    try:
        with entry_lock(folder):
            if intact(folder):
                return Conversion(folder)
            if folder.exists():
                print(f"speckernel: converted cache {folder} is incomplete or damaged; converting {path} again",
                      file=sys.stderr)
                shutil.rmtree(folder, ignore_errors=True)
            started = time.monotonic()
            convert(path, folder, write, started)
            prune_conversions(path, converted_folder(path))
            return Conversion(folder, time.monotonic() - started)
    except OSError as e:
        raise DamagedCheckpointError(f"cannot write the converted model to {folder.parent} ({e.strerror or e}); "
                                     "set SPECKERNEL_CACHE to a writable folder") from None


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
    """The GGUF file's config, tokenizer and tensor table, written into the folder `out`."""
    reader = read_gguf(path)
    cfg = gguf_config(reader)
    table = [TensorEntry(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str, list(t.data.shape))
             for t in reader.tensors]
    tokenizer_from_gguf(reader, path).save(out)
    (out / TENSORS).write_bytes(msgspec.json.encode(table))
    (out / MODEL_CONFIG).write_bytes(msgspec.json.encode(cfg))


def tensor_data(path: Path, table: list[TensorEntry]) -> Iterator[tuple[str, int, np.ndarray]]:
    """Each tensor's raw data, viewed as the reader viewed it, from a map of the file."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in table:
        dtype = np.dtype(t.dtype)
        count = int(np.prod(t.shape))
        end = t.offset + dtype.itemsize * count
        if end > len(data):
            raise ValueError(f"tensor {t.name} ends at byte {end}, past the file's end")
        yield t.name, t.kind, data[t.offset : end].view(dtype).reshape(t.shape)


def write_weights(path: Path, meta: Path, dtype: torch.dtype, out: Path) -> None:
    """The GGUF file's weights, fused and cast to `dtype`, written into the folder `out`."""
    # Converting needs torch (safetensors.torch, the weight assembly); reading a conversion does not.
    from safetensors.torch import save_file

    from .weights import assemble

    cfg = msgspec.json.decode((meta / MODEL_CONFIG).read_bytes(), type=ModelConfig)
    table = msgspec.json.decode((meta / TENSORS).read_bytes(), type=list[TensorEntry])
    desc = f"converting {path.name} to {str(dtype).removeprefix('torch.')} (once)"
    try:
        state = assemble(dict(iter_gguf(tensor_data(path, table), cfg, dtype, desc)), cfg)
    except (ValueError, IndexError, KeyError) as e:
        raise damaged(path, e) from None
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))


def convert(path: Path, folder: Path, write: Callable[[Path], None], started: float) -> None:
    """`write` into a temporary folder, then the manifest, then one rename: a folder under the
    final name is always complete, and an interrupted one leaves nothing behind."""
    remove_stale_temps(folder.parent)
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix=TEMP_PREFIX, dir=folder.parent) as tmp:
        write(Path(tmp))
        sizes = {f.name: f.stat().st_size for f in Path(tmp).iterdir()}
        manifest = Manifest(str(path.resolve()), sizes, time.monotonic() - started)
        Path(tmp, MANIFEST).write_bytes(msgspec.json.encode(manifest))
        os.rename(tmp, folder)  # the entry's lock is held: no other process writes this folder
        os.mkdir(tmp)  # TemporaryDirectory cleans up a path that must exist


def prune_conversions(path: Path, keep: Path) -> None:
    """Earlier conversions of the same file (before it changed, or by an older version, which
    wrote no manifest) are dead weight, hundreds of MB each: remove them, and their locks.
    `keep` and its weights' folders (named after it) stay."""
    source = str(path.resolve())
    for other in keep.parent.glob(f"{path.stem}-*"):
        if other.name == keep.name or other.name.startswith(f"{keep.name}-") or not other.is_dir():
            continue
        try:
            stale = msgspec.json.decode((other / MANIFEST).read_bytes(), type=Manifest).source == source
        except FileNotFoundError:
            stale = True
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            stale = False
        if stale:
            shutil.rmtree(other, ignore_errors=True)
            lock_path(other).unlink(missing_ok=True)
