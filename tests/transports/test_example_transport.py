"""A third-party transport package (tests/example_transport), installed beside speckernel and
found through its entry point: listed by `speckernel plugins`, passes `check_transport`, and
carries a pipeline selected by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import install_package

EXAMPLE = Path(__file__).parents[1] / "example_transport"
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return install_package(EXAMPLE, tmp_path_factory.mktemp("site"))


def run_with(site: Path, code: str, **more_env: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **more_env, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_third_party_transport_is_discovered_and_conforms(example_site: Path) -> None:
    proc = run_with(example_site, "from speckernel.tools.cli import main; main(['plugins', '--json'])")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["transports"]
    assert found["tcp_pipe"]["cross_process"] is True and found["tcp_pipe"]["device_direct"] is False
    proc = run_with(example_site, "from speckernel.testing import check_transport\n"
                                  "from tests.transports.test_conformance import pair_of\n"
                                  "check_transport(pair_of('tcp_pipe', lambda: 'tcp://127.0.0.1:0', bind_first=True))\n"
                                  "print('conforms')")
    assert proc.returncode == 0 and "conforms" in proc.stdout, proc.stderr[-3000:]


GENERATE = ["generate", "--raw", "--prompt", "The three primary colors are", "--temperature", "0", "--json",
            "--platform", "cpu", "--dtype", "float32", "--max-tokens", "6"]


@pytest.mark.slow
def test_third_party_transport_carries_a_pipeline(example_site: Path, tmp_path: Path) -> None:
    """`--pipeline-transport tcp_pipe`: PP=2 on the CPU in float32, its stages linked through the
    example's entry point (the trace file shows their ends), gives the single stage's tokens."""
    trace = tmp_path / "opened"
    runs = {}
    for pp, extra in ((1, []), (2, ["--pipeline-parallel-size", "2", "--pipeline-transport", "tcp_pipe"])):
        proc = run_with(example_site, f"from speckernel.tools.cli import main; main({[*GENERATE, *extra]!r})",
                        TCP_PIPE_TRACE=str(trace))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[pp] = json.loads(proc.stdout)["token_ids"]
    assert runs[2] == runs[1] and len(runs[1]) == 6
    ends = {tuple(map(int, line.split()[:2])) for line in trace.read_text().splitlines()}
    assert {(0, 1), (1, 0)} <= ends, f"the stages did not link through the example transport: {ends}"
