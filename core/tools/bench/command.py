"""`speckernel bench SCENARIO`: measurements side by side in one run, written as
`<out>/<scenario>.json` (with the command line, host, platform, dtype and library versions), a
markdown table `<out>/<scenario>.md` and, where matplotlib is installed, a plot `<out>/<scenario>.png`.

Each scenario is one module, `bench_<scenario>.py`, with `run(args)` (a coroutine where it
drives AsyncEngine) returning the report, `markdown(report)` returning the table's lines and
`plot(report, plt)` returning a figure; its flags live in `bench_cli`. This module runs the
chosen one and holds what they share: engine configs from the flags, the report header, the
writer, and the runs log (`log_run`) that keeps a cut-short bench's finished runs.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform as host_platform
import shlex
import sys
import time
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any, overload

import anyio
import msgspec
import numpy as np

from ...config import EngineConfig
from ...errors import InvalidInputError
from ..engine_args import parse_options
from .args import split_speculator

MISSING = "\N{EN DASH}"
"""What a table shows where a figure does not apply."""

RUNS_LOG: ContextVar[Path | None] = ContextVar("bench_runs_log", default=None)
"""Where `log_run` appends, while a bench runs (`main`): `<out>/<scenario>.runs.jsonl`."""


def log_run(run: dict[str, Any]) -> None:
    """One finished run as a JSON line beside the report to come: a bench cut short (a time
    limit, a failure in a later run) keeps the figures of the runs it finished. `main` removes
    the file once the report holds them all."""
    path = RUNS_LOG.get()
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(run, default=str) + "\n")


def scenario_module(name: str) -> ModuleType:
    return importlib.import_module(f".{name}", __package__)


def base_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len or None, enforce_eager=args.enforce_eager,
                        prompts_apart=not getattr(args, "no_prompts_apart", False),
                        prompt_steps_per_decode=getattr(args, "prompt_steps_per_decode", 4),
                        prompt_batches=not getattr(args, "no_prompt_batches", False),
                        batch_invariant=getattr(args, "batch_invariant", False),
                        launch_on_loop=not getattr(args, "no_launch_on_loop", False),
                        in_process=not getattr(args, "process", False))


def with_speculator(config: EngineConfig, args: argparse.Namespace, name: str | None) -> EngineConfig:
    """name is NAME[:K[:KEY=VALUE,...]]: K and options of that run, else --num-speculative-tokens
    and --speculator-option."""
    if name is None:
        return config

    try:
        run = split_speculator(name)
    except ValueError as e:
        raise InvalidInputError(f"--speculator {e}") from None
    return msgspec.structs.replace(config, speculator=run.name,
                                   num_speculative_tokens=args.num_speculative_tokens if run.k is None else run.k,
                                   draft_model=args.draft_model,
                                   adaptive_speculation=getattr(args, "adaptive_speculation", None),
                                   speculator_options=parse_options(args.speculator_option if run.options is None
                                                                    else run.options))


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
    import torch  # `speckernel --help` and bad flags fail without loading torch

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


@overload
def ms(seconds: float) -> float: ...
@overload
def ms(seconds: None) -> None: ...
def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def cell(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return MISSING if value is None else format(value * scale, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def pyplot() -> Any:
    try:
        import matplotlib  # optional: the `bench` extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use(): the backend is chosen at import
    except ImportError:
        return None
    return plt


def concurrency_axis(ax: Any, concurrencies: list[int], xlabel: str, ylabel: str) -> None:
    """A log2 x axis ticked at the concurrencies measured, with a legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")


def write_report(name: str, report: dict[str, Any], lines: list[str], plot: Any, out: Path) -> list[Path]:
    """Writes the JSON, the markdown and, where matplotlib imports, the plot; returns the files it
    wrote, so that what the command says it wrote is what is there."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{name}.json", out / f"{name}.md"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    written[1].write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        print("bench: no plot: matplotlib is not installed (pip install 'speckernel[bench]')", file=sys.stderr)
        return written
    fig = plot(report, plt)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    return [*written, out / f"{name}.png"]


def out_folder(args: argparse.Namespace) -> Path:
    """--out, or a new bench-SCENARIO-DATE-TIME folder here: a run never lands on another's files."""
    if args.out:
        return Path(args.out)
    return Path(f"bench-{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(args: argparse.Namespace) -> int:
    out = out_folder(args)  # fixed before the run: its name says when it started
    module = scenario_module(args.scenario)
    runs_log = out / f"{args.scenario}.runs.jsonl"
    runs_log.unlink(missing_ok=True)
    token = RUNS_LOG.set(runs_log)
    try:
        report = anyio.run(module.run, args) if inspect.iscoroutinefunction(module.run) else module.run(args)
        written = write_report(args.scenario, report, module.markdown(report), module.plot, out)
    except BaseException:
        if runs_log.exists():
            kept = len(runs_log.read_text().splitlines())
            print(f"bench: the {kept} runs that finished are in {runs_log}", file=sys.stderr)
        raise
    finally:
        RUNS_LOG.reset(token)
    runs_log.unlink(missing_ok=True)
    print((out / f"{args.scenario}.md").read_text())
    print(f"bench: wrote {', '.join(str(path) for path in written)}", file=sys.stderr)
    return 0
