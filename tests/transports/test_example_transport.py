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


def engine_has_pipeline_transport() -> bool:
    from speckernel.config import EngineConfig

    return "pipeline_transport" in EngineConfig.__struct_fields__


@pytest.mark.slow
@pytest.mark.skipif(not engine_has_pipeline_transport(), reason="the engine does not select pipeline transports yet")
def test_third_party_transport_carries_a_pipeline(example_site: Path, tmp_path: Path) -> None:
    """PP=2 on the CPU in float32, every link opened through the example's entry point, gives
    the single stage's tokens."""
    code = """
import json
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from tests.engine.pipeline_util import run_loop

prompts = [[1, 415, 2936, 9060, 285, 1167], [1, 22557, 28725, 910, 460]]
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
got = {}
for pp, transport in ((1, None), (2, "tcp_pipe")):
    core = EngineCore(EngineConfig(platform="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                                   max_num_batched_tokens=16, pipeline_parallel_size=pp, pipeline_transport=transport))
    try:
        got[pp] = run_loop(core, prompts, params)
    finally:
        core.close()
print(json.dumps({"pp1": got[1], "pp2": got[2]}))
"""
    trace = tmp_path / "opened"
    proc = run_with(example_site, code, TCP_PIPE_TRACE=str(trace))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pp2"] == out["pp1"] and all(len(o) == 4 for o in out["pp1"])
    ends = {tuple(map(int, line.split()[:2])) for line in trace.read_text().splitlines()}
    assert {(0, 1), (1, 0)} <= ends, f"the stages did not link through the example transport: {ends}"
