"""What a model name means before any weight is read: a built-in name, a GGUF file, a safetensors
folder or a random-weight preset, resolved to a path; its config and its tokenizer. No torch:
the frontend reads all of this, and only the engine core loads weights (loader.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..errors import UnknownModelError
from ..model_config import ModelConfig
from .builtin import BUILTIN_MODELS, fetch
from .gguf import MODEL_CONFIG, converted
from .hf_config import hf_config
from .presets import is_random, random_config
from .tokenizer import Tokenizer


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


def resolve(name_or_path: str) -> Path:
    """A built-in name, a GGUF file or a safetensors folder → a local path. A random-weight
    name (`random:PRESET[,FIELD=VALUE...]`) has no file: it comes back as a path of that name,
    which the loader recognises, once the name is known to be valid."""
    if name_or_path in BUILTIN_MODELS:
        return fetch(BUILTIN_MODELS[name_or_path])
    if name_or_path.startswith("random:"):
        random_config(name_or_path)
        return Path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        checkpoint_format(path)
        return path
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: not a file or folder, and not a built-in "
        f"({', '.join(BUILTIN_MODELS)}) or random-weight model (random:PRESET)"
    )


def read_config(path: Path) -> ModelConfig:
    if checkpoint_format(path) == "random":
        return random_config(path)
    if checkpoint_format(path) == "gguf":
        return msgspec.json.decode((converted(path) / MODEL_CONFIG).read_bytes(), type=ModelConfig)
    return hf_config(path)


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a resolved model path. A random-weight model ships none: token N is
    spelled `<N>`, so text and ids map one to one and the frontend runs it like any other."""
    if is_random(path):
        return Tokenizer.numbered(random_config(path).vocab_size)
    if checkpoint_format(path) == "gguf":
        path = converted(path)
    return Tokenizer.from_folder(path)
