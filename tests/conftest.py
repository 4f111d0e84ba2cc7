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
def hf_model(model_path: Path):  # type: ignore[no-untyped-def]
    """HF transformers' own GGUF loader (its own dequantization and q/k un-permutation), fp32."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                             dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def core():  # type: ignore[no-untyped-def]
    from speckernel.config import EngineConfig
    from speckernel.engine.core import EngineCore

    return EngineCore(EngineConfig(platform="cpu", max_model_len=1024))


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
    """`-n auto`: a worker per core this process may run on; none (one process) on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores if cores > 1 else 0


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
