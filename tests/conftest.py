"""Shared fixtures: the real default model, its tokenizer, the HF reference, an in-process core."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per worker (and per process a test starts): the workers already keep
    # every core busy, and two thread pools per core cost more than they give (the suite took
    # a third more CPU time that way).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton kernels run in Triton's interpreter, so one suite covers both paths.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of France is",
    "To make a cup of tea, you first",
    "import numpy as np\nimport",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favourite programming language is",
    "In 1969, the first humans",
    "The best way to learn a new language is",
    "SELECT name FROM users WHERE",
    "A haiku about autumn:\n",
    "The mitochondria is",
    "Here is a list of fruits: apple, banana,",
    "Photosynthesis is the process by which",
    "for i in range(10):\n    print(",
    "The largest planet in our solar system is",
    "Dear hiring manager,\n",
    "The sun rises in the",
    "Machine learning is a field of",
    "class Stack:\n    def __init__(self):",
    "The Great Wall of China",
    "Three tips for better sleep:",
    "An apple a day",
    "The chemical symbol for gold is",
    "Rain is caused by",
    "A good breakfast includes",
    "The theory of relativity was proposed by",
    "Bees are important because",
    "<html>\n<head>\n",
    "The opposite of hot is",
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    from speckernel.models.checkpoint import resolve

    return resolve("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    from speckernel.models.checkpoint import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """HF transformers' own GGUF loader (its own dequantization and q/k un-permutation), fp32.

    Its load parses the GGUF in Python (~15 s of CPU): the first worker to need it keeps what HF
    loaded, as safetensors, in pytest's cache, and the others read that back (under a lock, so
    exactly one parses). The key names the GGUF file and the transformers version."""
    import fcntl
    import json

    import torch
    import transformers
    from safetensors.torch import load_model, save_model
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    def from_gguf() -> LlamaForCausalLM:
        return LlamaForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)

    if getattr(request.config, "cache", None) is None:  # -p no:cacheprovider
        return from_gguf().eval()
    stat = model_path.stat()
    key = f"{model_path.name}-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    folder = request.config.cache.mkdir("hf-reference")
    weights, config, generation = (folder / f"{key}{suffix}" for suffix in (".safetensors", ".json", ".gen.json"))
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not weights.exists():
            model = from_gguf()
            model.config.to_json_file(config)
            model.generation_config.to_json_file(generation)
            save_model(model, str(weights.with_suffix(".partial")))
            weights.with_suffix(".partial").replace(weights)
            return model.eval()
    model = LlamaForCausalLM(LlamaConfig.from_json_file(config)).to(torch.float32)
    load_model(model, str(weights))
    model.generation_config = GenerationConfig.from_dict(json.loads(generation.read_text()))
    return model.eval()


@pytest.fixture(scope="session")
def core():  # type: ignore[no-untyped-def]
    from speckernel.config import EngineConfig
    from speckernel.engine.core import EngineCore

    return EngineCore(EngineConfig(platform="cpu", max_model_len=1024))


def install_speculators(monkeypatch: pytest.MonkeyPatch, module: str, classes: dict[str, type]) -> None:
    """Test speculators as installed plugins: entry points of the speculator group, beside the real ones."""
    from importlib.metadata import EntryPoint

    from speckernel import registry

    found = registry.discover

    def discover(kind: registry.Kind) -> dict[str, EntryPoint]:
        extra = {name: EntryPoint(name, f"{module}:{cls.__name__}", registry.GROUPS["speculator"])
                 for name, cls in classes.items()} if kind == "speculator" else {}
        return {**found(kind), **extra}

    monkeypatch.setattr(registry, "discover", discover)


def install_package(folder: Path, target: Path) -> Path:
    """A third-party plugin package (tests/example_*) installed into `target`, beside the installed
    speckernel (no dependencies, no index): put it on PYTHONPATH to see it through its entry points."""
    import importlib.util  # only the plugin-package tests install one
    import subprocess
    import sys

    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation,
                    "--target", str(target), str(folder)], check=True, timeout=600)
    return target


def run_to_completion(core, prompts: list[list[int]], params, prefix: str = "r") -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Adds every prompt to an in-process core and steps it until all finish; outputs in order."""
    from speckernel.wire.messages import AddRequest

    base = next(_KEYS) * 10_000  # keys are unique per request for the core's lifetime
    outputs: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        outputs[base + i] = []
        assert core.add_request(AddRequest(base + i, np.asarray(ids), params, f"{prefix}{i}")) is None
    while core.scheduler.requests or core.compiling:  # structured requests wait for their grammar first
        for delta in core.step():
            outputs[delta.key].extend(delta.new_token_ids)
    return [outputs[base + i] for i in range(len(prompts))]


_KEYS = itertools.count(1)


def fit(module, batch, steps: int = 30, lr: float = 3e-3) -> tuple[list[float], dict[str, float]]:  # type: ignore[no-untyped-def]
    """Adam steps of a learned drafter's loss on one batch: the losses and the last figures."""
    import torch

    opt = torch.optim.Adam(module.parameters(), lr=lr)
    losses, figures = [], {}
    for _ in range(steps):
        loss, figures = module.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, figures


def default_sigint() -> None:
    """preexec_fn for a child that must stop on Ctrl-C: a runner that starts the suite as a
    background job leaves SIGINT ignored, the child inherits that, and Python then never
    raises KeyboardInterrupt in it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def exited(pid: int) -> bool:
    """The process is gone: a zombie that no one has reaped yet counts as exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may run on, and one more; none (one process) on a
    single core. A worker spends about a third of its time waiting on processes it started
    (servers, engine cores, pipeline stages, pip) while they start up or sleep on a timeout: on 2
    cores, two workers held 1,630 s of worker time for 970 s of CPU, and a third worker took the
    suite from 851 s to 599 s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1 if cores > 1 else 0


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process, before any worker starts
        _small_pages()
        _prepare_default_model()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that measure time run on one worker, one after another: two of them side by side
    would each see the other's load in their figures (the other worker's tests they do see, and
    their bounds hold with a busy second core)."""
    for item in items:
        if item.get_closest_marker("timing") is not None:
            item.add_marker(pytest.mark.xdist_group("timing"))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker that did not group its timing tests would spread them over the workers without a
    word: refuse to run instead."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("timing") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more) with the "
                                    "other timing tests: this pytest and pytest-xdist do not work together")


def _small_pages() -> None:
    """Transparent huge pages off for this process and every process it starts (workers, engine
    cores, servers). Each engine's KV cache is a GiB of lazily zeroed memory that a test touches
    sparsely: with huge pages, every first touch zeroes 2 MB, which on virtual machines that back
    memory lazily costs ~20 ms (7% of the time of the two files measured). Behaviour is the same."""
    import ctypes
    import sys

    if sys.platform == "linux":
        pr_set_thp_disable = 41
        ctypes.CDLL(None).prctl(pr_set_thp_disable, 1, 0, 0, 0)


def _prepare_default_model() -> None:
    """Fetches and converts the default model once, before the workers start, so that they do
    not all convert it at once on a fresh machine (each would, into a folder of its own, and all
    but one would throw theirs away). A failure is left for the tests that need the model."""
    from speckernel.models.checkpoint import read_config, resolve

    with contextlib.suppress(Exception):
        read_config(resolve("smollm2-135m"))
