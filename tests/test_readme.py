"""The README runs as written: every Python block runs, every bash block marked `<!-- runnable -->`
(on the line before its fence) runs, and what it states about the code (defaults, the test count,
the bench folder, which methods are coroutines, the install lines) is read back from the code."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

from speckernel.frontend.async_engine import AsyncEngine
from speckernel.sampling_params import SamplingParams
from speckernel.tools.bench.command import out_folder
from speckernel.tools.bench.repeats import SPREAD_WARNING
from speckernel.tools.cli import build_parser
from tests.speculators.test_readme_example import example_blocks

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
RUNNABLE = "<!-- runnable -->"
BIN = Path(sys.executable).parent  # where this environment's `speckernel` command lives


class Block(NamedTuple):
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    runnable: bool


def blocks() -> list[Block]:
    """The README's fenced blocks, with whether the line before the fence marks them runnable."""
    lines = README.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = lines.index("```", i + 1)
            runnable = i > 0 and lines[i - 1].strip() == RUNNABLE
            found.append(Block(lines[i][3:].strip(), "\n".join(lines[i + 1:end]) + "\n", i + 1, runnable))
            i = end
        i += 1
    return found


def text() -> str:
    return " ".join(README.read_text().split())  # one line: a sentence may wrap anywhere


def number(pattern: str) -> float:
    match = re.search(pattern, text())
    assert match, f"the README no longer says {pattern!r}"
    return float(match.group(1).replace(",", ""))


# --- what the README states, read back from the code -------------------------------------------


def test_every_runnable_marker_sits_on_a_bash_block() -> None:
    lines = README.read_text().splitlines()
    markers = [i for i, line in enumerate(lines) if line.strip() == RUNNABLE]
    assert markers, "no block is marked runnable"
    assert all(lines[i + 1].startswith("```bash") for i in markers)
    assert sum(b.runnable for b in blocks()) == len(markers)
    assert [b.lang for b in blocks()].count("python") >= 3


def test_the_sampling_defaults_are_the_commands() -> None:
    parser = build_parser()
    generate = parser.parse_args(["generate", "--prompt", "x"])
    chat = parser.parse_args(["chat"])
    assert number(r"`generate` and `chat` sample at `--temperature ([\d.]+)`") == generate.temperature == \
        chat.temperature
    assert number(r"a `SamplingParams\(\)` built in Python samples at ([\d.]+)") == SamplingParams().temperature
    assert number(r"`--max-tokens` is (\d+) for `generate`") == generate.max_tokens
    assert number(r"and (\d+) for each `chat` reply") == chat.max_tokens
    assert (generate.top_k, generate.top_p) == (0, 1.0)  # "top-k and top-p off"


def test_the_bench_folder_and_repeats_are_the_commands() -> None:
    template = re.search(r"`--out` \(default: a new `(bench-[A-Z-]+)`", text())
    assert template, "the README no longer names the bench folder"
    for scenario in ("decode", "scale"):
        pattern = template.group(1).replace("SCENARIO", scenario).replace("DATE", r"\d{8}").replace("TIME", r"\d{6}")
        assert re.fullmatch(pattern, out_folder(argparse.Namespace(out=None, scenario=scenario)).name)
    repeats = number(r"run each configuration `--repeats` times \(default (\d+)\)")
    for scenario in ("decode", "hostsync", "prefill"):
        assert build_parser().parse_args(["bench", scenario]).repeats == repeats
    assert number(r"a spread above (\d+)% of the median") == SPREAD_WARNING * 100


def test_the_method_table_marks_what_is_awaited() -> None:
    section = README.read_text().split("### `AsyncEngine` methods", 1)[1].split("\n#", 1)[0]
    rows = [line.split(" | ")[0].strip("| `") for line in section.splitlines() if line.startswith("| `")]
    checked = set()
    for row in rows:
        for call in row.split("` / `"):
            match = re.fullmatch(r"(await |async for out in )?(\w+)\(.*", call)
            if not match or match.group(2) == "AsyncEngine":
                continue
            method = getattr(AsyncEngine, match.group(2))
            kind = ("await " if inspect.iscoroutinefunction(method) else
                    "async for out in " if inspect.isasyncgenfunction(method) else None)
            assert match.group(1) == kind, f"README: {call!r}, but {match.group(2)} is {kind or 'a plain call'}"
            checked.add(match.group(2))
    assert {"stats", "generate", "chat", "abort", "shutdown", "encode_chat"} <= checked
    speculation = README.read_text().split("## Speculative decoding", 1)[1].split("\n## ", 1)[0]
    assert "`(await engine.stats())[\"spec\"]`" in speculation  # stats() is a coroutine: its result is awaited


def test_the_install_lines_match_ci_and_the_extras() -> None:
    pin = re.search(r"torch==[\d.]+", (ROOT / ".ci/run").read_text())
    assert pin and f"pip install {pin.group(0)} --index-url https://download.pytorch.org/whl/cpu" in text()
    install = next(b.code for b in blocks() if "speckernel generate" in b.code and "venv" in b.code)
    assert f"pip install {pin.group(0)} \".[cuda]\"" in install
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])  # a CPU host never imports it
    for extra in ("cuda", "test"):  # the kernel tests run Triton's interpreter on the CPU
        assert any(d.startswith("triton") for d in project["optional-dependencies"][extra])


@pytest.mark.slow
def test_the_stated_test_count(request: pytest.FixtureRequest) -> None:
    """The suite's size is within the README's range: as this session collected it when it runs
    the whole suite (no second collection of ~1,300 tests), else from `pytest --collect-only`."""
    low, high = (number(r"between ([\d,]+) and [\d,]+ tests"), number(r"between [\d,]+ and ([\d,]+) tests"))
    config = request.config
    whole = (not config.option.keyword and not config.option.markexpr
             and [Path(a).resolve() for a in config.args] == [ROOT / p for p in config.getini("testpaths")])
    if whole:
        count = request.session.testscollected
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-n0", "-p", "no:cacheprovider", "--collect-only", "-q"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        match = re.search(r"^(\d+) tests collected", proc.stdout, re.M)
        assert match, proc.stdout[-2000:] + proc.stderr[-2000:]
        count = int(match.group(1))
    assert low <= count <= high, count


def test_the_example_plugin_installs_beside_an_installed_speckernel() -> None:
    """The README's command resolves with no index at all: pip takes the installed speckernel."""
    command = re.search(r"pip install (tests/example_speculator)\b", README.read_text())
    assert command, "the README no longer says how to install the example plugin"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           command.group(1)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Would install speckernel-example-speculator" in proc.stdout


# --- the blocks, run ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(log: Path) -> Iterator[int]:
    """`speckernel serve` as the README starts it, on a free port; the port once /health answers."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "speckernel"), "serve", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"serve did not start:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


RUN_BLOCKS = r"""
import json, sys
for line, code in json.load(sys.stdin):
    print(f"\n@@ README.md:{line}", flush=True)  # on a line of its own: a block may end without a newline
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
print("\n@@ done", flush=True)
"""


@pytest.mark.slow
def test_every_python_block_runs(tmp_path: Path) -> None:
    """All Python blocks in one process, in order, each in a fresh namespace: the speculator class
    (installed with the README's pyproject, so the conformance block finds `my_drafter`), the
    embedding example, and the OpenAI client against a server started as the README says (its
    port the only change)."""
    code, pyproject = example_blocks()
    package = tmp_path / "src"
    (package / "my_package").mkdir(parents=True)
    (package / "my_package" / "__init__.py").write_text(code)
    (package / "pyproject.toml").write_text(pyproject)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(package)], check=True, timeout=600)
    python = [b for b in blocks() if b.lang == "python"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    with served(tmp_path / "serve.log") as port:
        listed = [(b.line, b.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")) for b in python]
        proc = subprocess.run([sys.executable, "-c", RUN_BLOCKS], input=json.dumps(listed), env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("@@ done"), proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = re.split(r"^@@ README\.md:\d+$", proc.stdout.removesuffix("@@ done\n"), flags=re.M)[1:]
    assert len(outputs) == len(python)
    for block, out in zip(python, outputs, strict=True):
        assert out.strip() or "print(" not in block.code, f"README.md:{block.line} printed nothing"


@pytest.mark.slow
def test_every_runnable_bash_block_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ["PATH"]])}
    for block in (b for b in blocks() if b.runnable):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README.md:{block.line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        assert proc.stdout.strip(), f"README.md:{block.line} printed nothing"
