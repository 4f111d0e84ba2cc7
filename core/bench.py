"""`speckernel bench SCENARIO`: measurements side by side in one run, written as
`<out>/<scenario>.json` (with the command line, host, platform, dtype and library versions), a
markdown table `<out>/<scenario>.md` and a plot `<out>/<scenario>.png`.

Each scenario is one module, `bench_<scenario>.py`, with `add_arguments(parser)`, `run(args)`
(a coroutine where it drives AsyncEngine) returning the report, `markdown(report)` returning
the table's lines and `plot(report, plt)` returning a figure. This module wires them to the
command line and holds what they share: engine flags, the report header, the writer.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform as host_platform
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from .config import EngineConfig

SCENARIOS = {
    "accept": "acceptance per speculator on HumanEval",
    "decode": "decode speed at batch 1 and under concurrency, per speculator, next to HF transformers",
    "hostsync": "a fixed-width speculator with and without copying draft IDs to the host",
    "prefill": "prefill-only requests with and without K=0 steps",
    "scale": "one decode step of a Llama-3-8B-shaped model against the weight-read floor",
}
MISSING = "\N{EN DASH}"
"""What a table shows where a figure does not apply."""


def scenario_module(name: str) -> ModuleType:
    return importlib.import_module(f".bench_{name}", __package__)


def add_arguments(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark scenarios (JSON, markdown table, plot)")
    scenarios = bench.add_subparsers(dest="scenario", required=True)
    for name, help_text in SCENARIOS.items():
        module = scenario_module(name)
        p = scenarios.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        p.add_argument("--out", default=f"bench-results/{name}", help="folder for the JSON, markdown and PNG")


# --- flags the scenarios share ------------------------------------------------------------


def engine_flags(p: argparse.ArgumentParser, *, model: str | None = "smollm2-135m", max_num_seqs: int = 64,
                 max_model_len: int | None = 2048, dtype: str | None = None, process: bool = True) -> None:
    p.add_argument("--model", default=model,
                   help=f"built-in name, GGUF file, safetensors folder or random:PRESET (default: {model})")
    p.add_argument("--platform", default=None)
    p.add_argument("--dtype", default=dtype, help="float32 makes speculative and plain greedy runs bit-comparable")
    p.add_argument("--enforce-eager", action="store_true", help="never replay captured device graphs")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    if process:
        p.add_argument("--process", action="store_true",
                       help="run the engine core in its own process (default: in-process)")


def speculator_flags(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--speculator", action="append", default=None, help=f"speculator to measure ({default_help})")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--adaptive-speculation", action="store_true",
                   help="let measured step times turn drafting off where it does not pay")


def int_list(text: str) -> list[int]:
    """`1,4,16` → [1, 4, 16] (argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def base_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                        in_process=not getattr(args, "process", False))


def with_speculator(config: EngineConfig, args: argparse.Namespace, name: str | None) -> EngineConfig:
    if name is None:
        return config
    from .cli import parse_options

    return msgspec.structs.replace(config, speculator=name, num_speculative_tokens=args.num_speculative_tokens,
                                   draft_model=args.draft_model,
                                   adaptive_speculation=getattr(args, "adaptive_speculation", False),
                                   speculator_options=parse_options(args.speculator_option))


# --- the report ------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("speckernel", "torch", "transformers", "triton"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def header(scenario: str) -> dict[str, Any]:
    """What every report starts with; the scenario adds platform and dtype once its engine ran.
    The command is this process's own (`speckernel bench ...`)."""
    return {
        "scenario": scenario,
        "command": "speckernel " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "host": f"{host_platform.machine()} {host_platform.system()}",
        "versions": versions(),
    }


def device_name(device: Any) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({host_platform.processor() or host_platform.machine()})"


def preamble(report: dict[str, Any], title: str) -> list[str]:
    """The markdown title and the lines that say how and where the table was measured."""
    v = report["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "triton") if v.get(k))
    return [
        f"# {title}",
        "",
        f"Command: `{report['command']}`  ",
        f"Platform: {report.get('platform', '?')} ({report.get('dtype', '?')}), "
        f"{report.get('device', '?')}, host {report['host']}; {libs}",
        "",
    ]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def cell(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return MISSING if value is None else format(value * scale, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(name: str, report: dict[str, Any], lines: list[str], plot: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        print("bench: matplotlib not installed, no plot (pip install 'speckernel[bench]')", file=sys.stderr)
        return
    fig = plot(report, plt)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    import anyio

    module = scenario_module(args.scenario)
    report = anyio.run(module.run, args) if inspect.iscoroutinefunction(module.run) else module.run(args)
    out = Path(args.out)
    write_report(args.scenario, report, module.markdown(report), module.plot, out)
    print((out / f"{args.scenario}.md").read_text())
    return 0
