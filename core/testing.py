"""Conformance suite for speculator authors: `check_speculator("my_drafter")` runs a plugin,
found through its entry point, on the real default model and checks that

- its capabilities are a frozen SpeculatorCapabilities with sane values;
- what it proposes matches what it declares (shape, dtype, device, fixed or variable width,
  draft distributions when it declares sampled drafts);
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

from . import plugins
from .config import EngineConfig
from .engine_core import EngineCore
from .messages import AddRequest
from .sampling_params import SamplingParams
from .speculator import Drafts, ProposeRow, SpeculatorCapabilities

DEFAULT_PROMPTS = (
    "The three primary colors are",
    "def fibonacci(n):",
    "one two three one two three one two",
    "The capital of France is",
)


def check_capabilities(cls: Any) -> SpeculatorCapabilities:
    caps = getattr(cls, "capabilities", None)
    assert isinstance(caps, SpeculatorCapabilities), (
        f"{cls.__name__}.capabilities must be a SpeculatorCapabilities, got {type(caps).__name__}")
    assert caps.max_k >= 1, f"max_k must be >= 1, got {caps.max_k}"
    assert caps.draft_width in ("fixed", "variable"), caps.draft_width
    assert caps.lookahead_slots(caps.max_k) >= 0
    for method in ("propose", "sync", "release", "check"):
        assert callable(getattr(cls, method, None)), f"{cls.__name__} has no {method}()"
    return caps


class _Recorder:
    """Wraps a speculator instance to record what the kernel asked and what it answered."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.proposals: list[tuple[list[ProposeRow], int, Drafts]] = []
        self.syncs = 0

    def propose(self, rows: list[ProposeRow], k: int) -> Drafts:
        drafts = self.inner.propose(rows, k)
        self.proposals.append((rows, k, drafts))
        return drafts

    def sync(self, rows: list[ProposeRow]) -> None:
        self.syncs += 1
        self.inner.sync(rows)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)


def _run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        out[f"c{i}"] = []
        error = core.add_request(AddRequest(f"c{i}", np.asarray(ids), params))
        assert error is None, error
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.req_id].extend(delta.new_token_ids)
    return [out[f"c{i}"] for i in range(len(prompts))]


def check_speculator(name: str, *, model: str = "smollm2-135m", k: int = 3, max_tokens: int = 16,
                     prompts: tuple[str, ...] = DEFAULT_PROMPTS, platform: str | None = "cpu",
                     draft_model: str | None = None) -> dict[str, Any]:
    caps = check_capabilities(plugins.load("speculator", name))
    k = min(k, caps.max_k)
    base = EngineConfig(model=model, platform=platform, max_model_len=512, max_num_batched_tokens=6)
    plain = EngineCore(base)
    from .models.builtin import resolve
    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve(model))
    ids = [tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = _run(plain, ids, greedy)
    del plain

    spec = EngineCore(msgspec.structs.replace(base, speculator=name, num_speculative_tokens=k,
                                              draft_model=draft_model))
    recorder = _Recorder(spec.speculator)
    spec.runner.speculator = recorder  # type: ignore[assignment]
    got = _run(spec, ids, greedy)
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert want == have, f"greedy output differs with {name!r} on prompt {i}: {want} != {have}"
    # A request alone that is sure to finish with its first token: a K=0 step with a row to sync.
    (single,) = _run(spec, ids[:1], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert single == expected[0][:1], f"K=0 step changed the output: {single} != {expected[0][:1]}"

    device = spec.runner.device
    for rows, kk, drafts in recorder.proposals:
        t = drafts.token_ids
        assert tuple(t.shape) == (len(rows), kk), f"propose returned shape {tuple(t.shape)}, want {(len(rows), kk)}"
        assert t.dtype == torch.int64, f"draft ids must be int64, got {t.dtype}"
        assert t.device.type == device.type, f"drafts on {t.device}, engine on {device}"
        if caps.draft_width == "fixed":
            assert bool((t >= 0).all()), "a fixed-width speculator proposed a -1"
        else:
            neg = (t < 0).int()
            assert bool((neg.cummax(dim=1).values == neg).all()), "-1 may only end a variable-width row"
        if caps.sampled_drafts:
            assert drafts.probs is not None and tuple(drafts.probs.shape[:2]) == (len(rows), kk), \
                "sampled_drafts needs draft probabilities [rows, K, vocab]"
    stats = spec.stats()["spec"]
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
