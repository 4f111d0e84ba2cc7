"""Acceptance counters mean one thing on every path: a variable-width drafter's -1 padding,
which the device keeps where the backend plans steps on the device (CUDA), is verified but not
counted as drafted, exactly as the host path (the CPU), which trims it, never sees it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.request import SpecCounters
from speckernel.ops.paged_attention import TorchPagedAttention
from speckernel.runner.verify import drafted_counts
from speckernel.sampling_params import SamplingParams
from tests.conftest import run_to_completion

K = 4
CONFIG = EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
                      seed=0, async_scheduling=False, skip_drafts=False, adaptive_speculation=False,
                      speculator="ngram", num_speculative_tokens=K)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [3, 3, 3, 3, 3, 3], [20, 21, 22, 23, 24, 25]]


def run(device_planned: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], dict[str, Any]]:
    """The CPU engine with ngram; `device_planned` makes the torch backend claim what CUDA's does,
    so the drafts stay in the token buffer, padded with -1, and the device path counts them."""
    monkeypatch.setattr(TorchPagedAttention, "device_planned", device_planned)
    core = EngineCore(CONFIG)
    assert core.scheduler.spec is not None and core.scheduler.spec.variable_width is not device_planned
    outputs = run_to_completion(core, PROMPTS, GREEDY)
    return outputs, core.stats()["spec"]


def test_device_path_counts_drafts_as_the_host_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    host_out, host = run(False, monkeypatch)
    device_out, device = run(True, monkeypatch)
    assert device_out == host_out  # the same drafts were verified: the same tokens came out
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "acceptance_per_position")
    assert {k: device[k] for k in keys} == {k: host[k] for k in keys}
    assert 0 < host["num_draft_tokens"] < K * host["num_drafts"]  # some steps had fewer than K drafts: padding


def host_count(row: list[int]) -> int:
    """The host path: drafts trimmed at the first -1 (`token_frames`, `ModelRunner` host copy)."""
    return next((i for i, t in enumerate(row) if t < 0), len(row))


def test_drafted_counts_match_the_host_trim_on_padded_drafts() -> None:
    rows = [[5, 7, -1, -1], [3, -1, -1, -1], [1, 2, 3, 4], [-1, -1, -1, -1], [8, -1, 9, -1]]
    accepted = [2, 0, 3, 0, 1]
    on_device, on_host = SpecCounters(), SpecCounters()
    for n, row, acc in zip(drafted_counts(torch.tensor(rows)).tolist(), rows, accepted, strict=True):
        on_device.record(n, acc)
        on_host.record(host_count(row), acc)
    assert drafted_counts(torch.tensor(rows)).tolist() == [2, 1, 4, 0, 1]
    assert on_device.summary() == on_host.summary()
    assert drafted_counts(torch.empty(3, 0, dtype=torch.int64)).tolist() == [0, 0, 0]
