"""The README's "Writing a speculator" example, as written: its two code blocks become a package,
which is installed, found through its entry point and passes the conformance suite. So the docs
cannot drift from the contract."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
README = Path(__file__).parents[2] / "README.md"


def example_blocks() -> tuple[str, str]:
    section = README.read_text().split("### Writing a speculator", 1)[1].split("\n### ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    assert python and toml, "the README's speculator section lost a code block"
    return python.group(1), toml.group(1)


def test_the_readme_speculator_installs_and_conforms(tmp_path: Path) -> None:
    code, pyproject = example_blocks()
    package = tmp_path / "src"
    (package / "my_package").mkdir(parents=True)
    (package / "my_package" / "__init__.py").write_text(code)
    (package / "pyproject.toml").write_text(pyproject.replace('dependencies = ["speckernel"]', "dependencies = []"))
    site = tmp_path / "site"
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(site),
                    str(package)], check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    probe = ("import json; from speckernel.conformance import check_speculator; "
             "print(json.dumps(check_speculator('my_drafter', max_tokens=12)))")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lossless_greedy"] and report["num_draft_tokens"] > 0
    assert report["k0_syncs"] > 0 and report["num_host_draft_copies"] == 0
