"""Drafter checkpoints are checked before they are served: the shipped ones against their pinned
sha256 (stamped after one full check), a user's folder against the digest its config.json
records, and every tensor for shape, dtype, finite values and index ranges. Each bad file fails
the load with one line naming it. Real shipped checkpoints, copied and damaged."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from speckernel.errors import InvalidInputError
from speckernel.kit import read_config as target_config
from speckernel.kit import resolve_model
from speckernel.models.builtin import cache_stamp, sha256_of
from speckernel.speculators import learned
from speckernel.speculators.eagle3 import Eagle3Speculator
from speckernel.speculators.learned import SHIPPED_SHA256, WEIGHTS, check_weights, read_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures


@pytest.fixture(scope="module")
def eagle3_module() -> torch.nn.Module:
    target = target_config(resolve_model("smollm2-135m"))
    return Eagle3Speculator.Module(read_config(WEIGHTS / "eagle3"), target, 64)


def copy_of(method: str, into: Path) -> Path:
    folder = into / method
    shutil.copytree(WEIGHTS / method, folder)
    return folder


def rewrite(folder: Path, change: dict[str, torch.Tensor], record_digest: bool) -> Path:
    """The folder's tensors with `change` applied, its config.json recording the new file's
    digest (as `save` writes it) or none (a checkpoint from elsewhere)."""
    path = folder / "model.safetensors"
    state = load_file(str(path)) | change
    save_file(state, str(path), metadata={"format": "pt"})
    cfg = msgspec.structs.replace(read_config(folder), sha256=sha256_of(path) if record_digest else "")
    (folder / "config.json").write_bytes(msgspec.json.encode(cfg))
    return path


def one_line(e: pytest.ExceptionInfo[InvalidInputError], path: Path) -> str:
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}:"), text
    return text


def test_every_shipped_checkpoint_has_its_pinned_digest_and_passes_the_checks() -> None:
    assert set(SHIPPED_SHA256) == {p.name for p in WEIGHTS.iterdir() if (p / "model.safetensors").is_file()}
    for method, digest in SHIPPED_SHA256.items():
        assert sha256_of(WEIGHTS / method / "model.safetensors") == digest, method
        assert read_config(WEIGHTS / method).sha256 == digest, method
    # The shipped-weight budget: 100 MB for all five together.
    assert sum((WEIGHTS / m / "model.safetensors").stat().st_size for m in SHIPPED_SHA256) <= 100_000_000


def test_a_full_check_writes_a_stamp_that_later_loads_trust(eagle3_module, tmp_path,  # type: ignore[no-untyped-def]
                                                            monkeypatch) -> None:
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))
    path = WEIGHTS / "eagle3" / "model.safetensors"
    hashed: list[Path] = []
    monkeypatch.setattr("speckernel.models.builtin.sha256_of", lambda p: hashed.append(p) or sha256_of(p))
    check_weights(eagle3_module, WEIGHTS / "eagle3", SHIPPED_SHA256["eagle3"])
    assert hashed == [path] and cache_stamp(path).is_file()
    check_weights(eagle3_module, WEIGHTS / "eagle3", SHIPPED_SHA256["eagle3"])
    assert hashed == [path]  # the stamp matched: no second full hash
    assert not (path.parent / f".{path.name}.sha256").exists()  # nothing written into the package


@pytest.mark.parametrize("where", ["header", "data"])
def test_byte_flips_in_a_copied_checkpoint_fail_with_one_line_naming_the_file(eagle3_module, tmp_path,  # type: ignore[no-untyped-def]
                                                                               where) -> None:
    folder = copy_of("eagle3", tmp_path)
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    for i in ((9, 40, 77) if where == "header" else (header + 1000, header + 500_000, len(raw) - 3)):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(InvalidInputError) as e:
        check_weights(eagle3_module, folder, read_config(folder).sha256)
    assert "corrupt" in one_line(e, path)


def test_nan_in_a_checkpoint_is_refused_naming_the_file_and_tensor(eagle3_module, tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = copy_of("eagle3", tmp_path)
    weight = load_file(str(folder / "model.safetensors"))["fc.weight"].clone()
    weight[3, 5] = float("nan")
    path = rewrite(folder, {"fc.weight": weight}, record_digest=True)  # its digest is right: the values are not
    with pytest.raises(InvalidInputError) as e:
        check_weights(eagle3_module, folder, read_config(folder).sha256)
    assert "tensor fc.weight holds 1 values that are NaN or infinite" in one_line(e, path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: {"fc.weight": s["fc.weight"][:, :-1].contiguous()}, "tensor fc.weight has shape"),
    (lambda s: {"d2t": s["d2t"].float()}, "tensor d2t is float32, not int64"),
    (lambda s: {"norm.weight": s["norm.weight"].to(torch.int32)}, "not bfloat16, float16 or float32"),
])
def test_shape_and_dtype_are_checked(eagle3_module, tmp_path, change, message) -> None:  # type: ignore[no-untyped-def]
    folder = copy_of("eagle3", tmp_path)
    path = rewrite(folder, change(load_file(str(folder / "model.safetensors"))), record_digest=False)
    with pytest.raises(InvalidInputError) as e:
        check_weights(eagle3_module, folder, read_config(folder).sha256)
    assert message in one_line(e, path)


@pytest.mark.parametrize("offset", [10**6, -(10**6)])
def test_an_out_of_range_d2t_is_refused_at_load(eagle3_module, tmp_path, offset) -> None:  # type: ignore[no-untyped-def]
    folder = copy_of("eagle3", tmp_path)
    d2t = load_file(str(folder / "model.safetensors"))["d2t"].clone()
    d2t[17] += offset
    path = rewrite(folder, {"d2t": d2t}, record_digest=True)
    with pytest.raises(InvalidInputError) as e:
        check_weights(eagle3_module, folder, read_config(folder).sha256)
    assert "tensor d2t maps draft index 17 to target id" in one_line(e, path)
    assert "outside the vocabulary [0, 49152)" in str(e.value)


def test_the_cli_names_the_bad_file_in_one_line_and_exits_2(tmp_path: Path) -> None:
    folder = copy_of("eagle3", tmp_path)
    d2t = load_file(str(folder / "model.safetensors"))["d2t"].clone()
    d2t[0] = -5
    path = rewrite(folder, {"d2t": d2t}, record_digest=True)
    proc = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", "hi", "--max-tokens", "2",
                           "--platform", "cpu", "--speculator", "eagle3", "--draft-model", str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if str(path) in line]
    assert len(lines) == 1 and "tensor d2t maps draft index 0 to target id -5" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_shipped_checkpoint_that_changed_is_refused(eagle3_module, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The shipped folder is checked against the pin in the code, whatever its config.json says."""
    weights = tmp_path / "weights"
    folder = copy_of("eagle3", weights)
    raw = bytearray((folder / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(raw))
    monkeypatch.setattr(learned, "WEIGHTS", weights)
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InvalidInputError) as e:
        check_weights(eagle3_module, folder, SHIPPED_SHA256["eagle3"])
    assert "reinstall speckernel" in one_line(e, folder / "model.safetensors")
