"""The package type-checks: mypy, as `.ci/typecheck` runs it, from inside the suite, so that it
runs on a worker beside the other tests (half a minute of one core) instead of after all of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")
pytestmark = pytest.mark.slow

TYPECHECK = Path(__file__).parents[1] / ".ci" / "typecheck"


def test_the_package_type_checks() -> None:
    done = subprocess.run([str(TYPECHECK)], env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout, done.stdout[-2000:]
