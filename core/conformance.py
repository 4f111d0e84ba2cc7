"""Conformance suite for speculator authors: `check_speculator("my_drafter")` runs a plugin,
found through its entry point, on the real default model and checks that

- its capabilities are a frozen SpeculatorCapabilities with sane values, and a speculator that
  declares `trainable` has the training protocol (`TrainableSpeculator`);
- what it proposes matches what it declares (shape, dtype, device, fixed or variable width,
  draft distributions when it declares sampled drafts);
- every step reaches it, with every row of the step (prefill chunks included);
- K=0 steps call only `sync` when it supports K=0, and still draft (then dropped) otherwise;
- greedy output with it equals greedy output without it, token for token;
- fixed width never copies draft IDs to the host.

It raises AssertionError with what was expected, and returns a report otherwise.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from . import registry
from .config import EngineConfig
from .engine.core import EngineCore
from .models.checkpoint import load_tokenizer, resolve
from .plugin import Drafts, Speculator, SpeculatorCapabilities, TargetStates, TrainableSpeculator
from .progress import Progress, waiting
from .runner.model_runner import ModelRunner
from .sampling_params import SamplingParams
from .wire.messages import AddRequest

DEFAULT_PROMPTS = (
    "The three primary colors are",
    "def fibonacci(n):",
    "one two three one two three one two",
    "The capital of France is",
)


def check_capabilities(cls: type[Speculator]) -> SpeculatorCapabilities:
    caps = getattr(cls, "capabilities", None)
    assert isinstance(caps, SpeculatorCapabilities), (
        f"{cls.__name__}.capabilities must be a SpeculatorCapabilities, got {type(caps).__name__}")
    assert caps.max_k >= 1, f"max_k must be >= 1, got {caps.max_k}"
    assert caps.draft_width in ("fixed", "variable"), caps.draft_width
    assert caps.lookahead_slots(caps.max_k) >= 0
    for method in ("propose", "sync", "check", "draft_kv_bytes_per_token", "capabilities_for"):
        assert callable(getattr(cls, method, None)), f"{cls.__name__} has no {method}() (SpeculatorBase has defaults)"
    assert not caps.trainable or issubclass(cls, TrainableSpeculator), (
        f"{cls.__name__} declares trainable but lacks new_drafter, read_checkpoint or save (TrainableSpeculator)")
    options = getattr(cls, "Options", None)
    assert isinstance(options, type) and issubclass(options, msgspec.Struct), \
        f"{cls.__name__}.Options must be a msgspec.Struct type (speckernel.plugin.NoOptions for none)"
    return caps


class _Recorder:
    """Wraps a speculator instance to record what the kernel asked and what it answered."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.proposals: list[tuple[TargetStates, int, Drafts]] = []
        self.syncs = 0
        self.rows_seen = 0

    def propose(self, states: TargetStates, k: int) -> Drafts:
        drafts = self.inner.propose(states, k)
        self.proposals.append((states, k, drafts))
        self.rows_seen += states.num_rows
        return drafts

    def sync(self, states: TargetStates) -> None:
        self.syncs += 1
        self.rows_seen += states.num_rows
        self.inner.sync(states)


def _run(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
         desc: str) -> tuple[list[list[int]], int]:
    """Greedy outputs in prompt order, and the number of frame rows the runner executed."""
    bar = Progress(desc, len(prompts), len(prompts) * params.max_tokens)
    out: dict[int, list[int]] = {}
    base = core.num_steps * 1000
    rows = 0
    for i, ids in enumerate(prompts):
        out[base + i] = []
        error = core.add_request(AddRequest(base + i, np.asarray(ids), params))
        assert error is None, error
    while core.scheduler.requests:
        frame = core.scheduler.schedule()
        assert frame is not None
        rows += len(frame.rows)
        core.ledger.submit(frame)
        for delta in core._apply(core.execute(frame)):
            out[delta.key].extend(delta.new_token_ids)
            bar.tokens(len(delta.new_token_ids))
            if delta.finish_reason is not None:
                bar.request_done()
    bar.close()
    return [out[base + i] for i in range(len(prompts))], rows


def check_speculator(name: str, *, model: str = "smollm2-135m", k: int = 3, max_tokens: int = 16,
                     prompts: tuple[str, ...] = DEFAULT_PROMPTS, platform: str | None = "cpu",
                     draft_model: str | None = None) -> dict[str, Any]:
    caps = check_capabilities(registry.load("speculator", name))
    k = min(k, caps.max_k)
    base = EngineConfig(model=model, platform=platform, max_model_len=512, max_num_batched_tokens=6)
    what = f"check_speculator {name}"
    with waiting(f"{what}: loading {model}"):
        plain = EngineCore(base)
    tokenizer = load_tokenizer(resolve(model))
    ids = [tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected, _ = _run(plain, ids, greedy, f"{what}: without it")
    del plain

    with waiting(f"{what}: loading {model} with {name}"):
        spec = EngineCore(msgspec.structs.replace(base, speculator=name, num_speculative_tokens=k,
                                                  draft_model=draft_model))
    assert spec.speculator is not None, f"the engine loaded no speculator {name!r}"
    recorder = _Recorder(spec.speculator)
    runner = spec.runner
    assert isinstance(runner, ModelRunner), "conformance runs the target in one process"
    runner.speculator = recorder  # type: ignore[assignment]  # it wraps the instance, not the class protocol
    got, rows_run = _run(spec, ids, greedy, f"{what}: with it")
    assert recorder.rows_seen == rows_run, (
        f"the speculator saw {recorder.rows_seen} rows of the {rows_run} the runner executed")
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert want == have, f"greedy output differs with {name!r} on prompt {i}: {want} != {have}"
    # A request alone that is sure to finish with its first token: a K=0 step with a row to sync.
    (single,), _ = _run(spec, ids[:1], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                        f"{what}: a K=0 step")
    assert single == expected[0][:1], f"K=0 step changed the output: {single} != {expected[0][:1]}"

    device = runner.device
    for states, kk, drafts in recorder.proposals:
        n = states.num_rows
        t = drafts.token_ids
        assert tuple(t.shape) == (n, kk), f"propose returned shape {tuple(t.shape)}, want {(n, kk)}"
        assert t.dtype == torch.int64, f"draft ids must be int64, got {t.dtype}"
        assert t.device.type == device.type, f"drafts on {t.device}, engine on {device}"
        t = t[states.samples_device.to(t.device)]  # a device_only speculator's host lists are empty
        if caps.draft_width == "fixed":
            assert bool((t >= 0).all()), "a fixed-width speculator proposed a -1"
        else:
            neg = (t < 0).int()
            assert bool((neg.cummax(dim=1).values == neg).all()), "-1 may only end a variable-width row"
        if caps.sampled_drafts:
            assert drafts.probs is not None and tuple(drafts.probs.shape[:2]) == (n, kk), \
                "sampled_drafts needs draft probabilities [rows, K, vocab]"
    stats = spec.stats()["spec"]
    assert not stats["num_speculator_failures"], (  # the engine serves on without drafts: say why here
        f"the speculator's pass raised on {stats['num_speculator_failures']} steps (see the log)")
    assert stats["num_k0_steps"] > 0, "the prompts should have produced K=0 steps"
    if caps.supports_k0:
        assert recorder.syncs > 0, "supports_k0 is declared but sync() was never used on a K=0 step"
    else:
        assert recorder.syncs == 0, "sync() was called on a speculator that does not support K=0"
    if caps.draft_width == "fixed":
        assert stats["num_host_draft_copies"] == 0, "fixed width must not copy draft IDs to the host"
    return {"speculator": name, "capabilities": {f: getattr(caps, f) for f in caps.__struct_fields__},
            "prompts": len(ids), "lossless_greedy": True, "proposals": len(recorder.proposals),
            "k0_syncs": recorder.syncs, **{key: stats[key] for key in
                                          ("num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                                           "num_k0_steps", "num_host_draft_copies")}}
