"""The plugin author kit: the conformance suite on the built-ins, and a third-party speculator
package installed from tests/example_speculator and found through its entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speckernel.conformance import check_speculator
from tests.conftest import install_package

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures
EXAMPLE = Path(__file__).parents[1] / "example_speculator"


@pytest.mark.parametrize("name", ["ngram", "draft_model"])
def test_builtins_pass_conformance(name: str) -> None:
    report = check_speculator(name, k=3, max_tokens=12)
    assert report["lossless_greedy"] and report["num_draft_tokens"] > 0
    assert report["k0_syncs"] > 0  # both built-ins support K=0


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return install_package(EXAMPLE, tmp_path_factory.mktemp("site"))


def run_with(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)


def test_third_party_speculator_is_discovered_and_conforms(example_site: Path) -> None:
    proc = run_with(example_site, "from speckernel.tools.cli import main; main(['plugins', '--json'])")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["speculators"]
    assert found["repeat_last"]["draft_width"] == "fixed" and found["repeat_last"]["supports_k0"] is False
    proc = run_with(example_site, "import json; from speckernel.conformance import check_speculator; "
                                  "print(json.dumps(check_speculator('repeat_last', max_tokens=12)))")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lossless_greedy"] and report["k0_syncs"] == 0 and report["num_host_draft_copies"] == 0


def test_declared_hidden_states_and_target_handles_reach_the_speculator(example_site: Path) -> None:
    """hidden_probe asserts on every step that it got exactly layers (2, 15, 29), the target's
    handles, and a layer-29 output that predicts the token the target sampled; any miss fails
    its rows and so the lossless check."""
    proc = run_with(example_site, "import json; from speckernel.conformance import check_speculator; "
                                  "print(json.dumps(check_speculator('hidden_probe', max_tokens=12)))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lossless_greedy"] and report["k0_syncs"] > 0


def test_capability_the_target_cannot_serve_is_refused_at_start(example_site: Path) -> None:
    code = ("from speckernel.engine.core import EngineCore; from speckernel.config import EngineConfig\n"
            "try:\n    EngineCore(EngineConfig(platform='cpu', max_model_len=128, speculator='needs_hidden'))\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    proc = run_with(example_site, code)
    assert "InvalidInputError" in proc.stdout and "layers [1000]" in proc.stdout, proc.stdout + proc.stderr
