"""Start-up time: what a fresh `speckernel generate` must not import on its way to the first
token, and `speckernel bench startup`, which times the phases in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def fresh(code: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_frontend_reaches_the_core_without_importing_torch(model_path: Path) -> None:
    """The CLI process parses, checks the cached model and loads its tokenizer; torch (seconds
    to import) is the engine core's alone, which starts meanwhile in its own process."""
    code = (
        "import sys\n"
        "from speckernel.tools import cli\n"
        "from speckernel.frontend.async_engine import AsyncEngine\n"
        "from speckernel.models.checkpoint import resolve\n"
        "from speckernel.models.checkpoint import load_tokenizer\n"
        "cli.build_parser().parse_args(['generate', '--prompt', 'hi'])\n"
        "from speckernel.config import EngineConfig\n"
        "from speckernel.engine.check import check\n"
        "check(EngineConfig(platform='cpu'))  # a platform named: its class is loaded and asked\n"
        "load_tokenizer(resolve('smollm2-135m'))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n"
    )
    assert fresh(code) == "[]"


def test_engine_core_start_imports_no_compiler(model_path: Path) -> None:
    """Building the model on the meta device ran its random init through torch._refs, which
    imports torch._dynamo: about 3 s of every start on a CPU. Triton and transformers have no
    part in the CPU path either."""
    code = (
        "import sys, time\n"
        "from speckernel.config import EngineConfig\n"
        "from speckernel.engine.core import EngineCore\n"
        "core = EngineCore(EngineConfig(platform='cpu', max_model_len=256))\n"
        "assert all(not p.is_meta for p in core.runner.model.parameters())\n"
        "core = EngineCore(EngineConfig(model='random:tiny', platform='cpu', max_model_len=256))  # built on meta\n"
        "assert all(not p.is_meta for p in core.runner.model.parameters())\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton', 'transformers') if m in sys.modules))\n"
    )
    assert fresh(code) == "[]"


@pytest.mark.slow
def test_bench_startup_reports_each_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's phases and table, not the real model's times: the bench runs in this process
    (its probes are the fresh processes) on random:tiny, which skips the real model's load."""
    from speckernel.tools import cli

    assert cli.build_parser().parse_args(["bench", "startup"]).model == "smollm2-135m"  # the default, as a user runs it
    argv = ["bench", "startup", "--repeats", "1", "--platform", "cpu", "--model", "random:tiny", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["speckernel", *argv])  # the report records this process's command
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "startup.json").read_text())
    assert report["scenario"] == "startup" and report["platform"] == "cpu" and report["model"] == "random:tiny"
    (run,) = report["modes"]["process"]["runs"]
    phases = [run[f"{p}_s"] for p in ("python", "import", "load", "first_token")]
    assert all(p > 0 for p in phases)
    assert sum(phases) == pytest.approx(run["total_s"]) and run["cpu_s"] > 0
    table = (tmp_path / "startup.md").read_text()
    assert "| process |" in table and report["command"] in table


def test_cpu_kv_cache_is_zero_without_touching_its_memory() -> None:
    """The CPU KV cache (up to 1 GiB) comes from calloc: zero pages the OS fills on first touch,
    where torch.zeros wrote every byte at start (about a second per GiB)."""
    import resource

    import torch

    from speckernel.model_config import ModelConfig
    from speckernel.models.paged import new_kv_cache

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=4, num_heads=4, num_kv_heads=4,
                      head_dim=64, max_position=64)
    before = rss_mib()
    kv = new_kv_cache(cfg, num_blocks=8192, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv.shape == (4, 2, 8192 * 16, 4, 64) and kv.dtype == torch.bfloat16
    assert kv.numel() * 2 == 512 * 2**20
    assert rss_mib() - before < 64  # 512 MiB allocated, almost none of it resident
    assert not kv[3, 1, -16:].any() and not kv[0, 0, :16].any()
    kv[1, 0, 5] = 1.5
    assert kv[1, 0, 5].eq(1.5).all() and kv.sum().item() == 1.5 * 4 * 64
