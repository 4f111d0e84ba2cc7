"""A GGUF file is converted once per cache entry, whoever asks at the same time; a killed
converter leaves no lock behind; the weights are kept in the engine's dtype, bit for bit what
loading the fp32 conversion and casting gave; a first start says in one line where its time went."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from speckernel.models import gguf, loader
from speckernel.models.weights import assemble
from tests.models.tiny_gguf import write_tiny_gguf


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SPECKERNEL_CACHE": str(tmp_path / "cache")}


RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    from speckernel.models import gguf

    source, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    for name in ("write_conversion", "write_weights"):
        def logged(*args, _real=getattr(gguf, name), _name=name):
            with log.open("a") as f:
                f.write(f"{_name} {os.getpid()}\\n")
            time.sleep(2.0)  # the other process arrives while this one converts
            _real(*args)
        setattr(gguf, name, logged)
    (go.parent / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.01)
    conversion = gguf.converted_weights(source, torch.bfloat16)
    print(conversion.folder, conversion.seconds is not None)
""")


def test_two_processes_converting_one_fresh_entry_convert_once(tiny: Path, tmp_path: Path) -> None:
    log, go = tmp_path / "conversions.log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tiny), str(log), str(go)], env=env_for(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2:  # both have imported torch
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()  # both start converting at once
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    calls = sorted(line.split()[0] for line in log.read_text().splitlines())
    assert calls == ["write_conversion", "write_weights"]  # once each, for both processes
    results = [out.split() for out, _ in outs]
    assert results[0][0] == results[1][0]  # one folder, converted by one of them
    assert sorted(converted for _, converted in results) == ["False", "True"]
    state = loader.load_state(tiny, torch.bfloat16)
    assert state["embed.weight"].dtype == torch.bfloat16


KILLED_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from speckernel.models import cache, gguf

    with cache.entry_lock(gguf.converted_folder(Path(sys.argv[1]))):
        print("held", flush=True)
        time.sleep(120)
""")


def test_a_killed_converter_leaves_no_lock_that_blocks(tiny: Path, tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, str(tiny)], env=env_for(tmp_path),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    code = "import sys; from pathlib import Path; from speckernel.models import gguf; gguf.converted(Path(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tiny)], env=env_for(tmp_path), timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert gguf.intact(gguf.converted_folder(tiny))


def fp32_then_cast(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the engine loaded before weights were kept per dtype: the GGUF reader's fp32
    tensors, fused, then cast by the model's `.to(dtype)`."""
    reader = gguf.read_gguf(path)
    cfg = gguf.gguf_config(reader)
    raw = ((t.name, int(t.tensor_type), t.data) for t in reader.tensors)
    return {k: v.to(dtype) for k, v in assemble(dict(gguf.iter_gguf(raw, cfg, torch.float32)), cfg).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_kept_in_the_engine_dtype_load_bit_identical(tiny: Path, dtype: torch.dtype) -> None:
    model = loader.load_model(tiny, dtype, torch.device("cpu"), 32)
    expected = fp32_then_cast(tiny, dtype)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert all(state[k].dtype == dtype for k in expected)
    if dtype != torch.float32:  # half the bytes of the fp32 entry
        fp32 = gguf.weights_folder(tiny, torch.float32)
        loader.load_state(tiny, torch.float32)
        ratio = (gguf.weights_folder(tiny, dtype) / gguf.WEIGHTS).stat().st_size / (fp32 / gguf.WEIGHTS).stat().st_size
        assert ratio < 0.55


def conversion_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "convert" in line]


def test_a_first_generate_prints_one_conversion_line(tiny: Path, tmp_path: Path) -> None:
    """The frontend (tokenizer, config) and the engine core (weights) start together on a fresh
    cache: one conversion each, one line naming fetch-or-not, conversion and load times."""
    cmd = [sys.executable, "-m", "speckernel", "generate", "--prompt", "hi", "--max-tokens", "4", "--model", str(tiny)]
    first = subprocess.run(cmd, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    lines = conversion_lines(first.stderr)
    assert len(lines) == 1, first.stderr
    assert "converted once in" in lines[0] and "float32 weights" in lines[0] and "load" in lines[0]
    again = subprocess.run(cmd, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and conversion_lines(again.stderr) == [], again.stderr
