"""remote: a drafter served by `speckernel serve-drafter` in a second process, with a round trip
injected by the server (`--inject-rtt-ms`), resolved deferred (its reply overlaps the next step's
host work) or synchronously (propose waits for it), next to the same drafter in the engine.

The engine core is driven in process, one `step()` after another (schedule, launch, the
speculator's pass, the ledger), so the step period is the loop's own: its p50 over every step of
the run, and tokens/s over the whole run. Each run is greedy on HumanEval chat prompts; the
outputs of every run are compared with the local drafter's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ... import registry
from ...config import EngineConfig
from ...models.checkpoint import load_tokenizer, resolve
from ...sampling_params import SamplingParams
from ...wire.messages import AddRequest
from ..datasets import humaneval_messages
from .command import base_config, cell, device_name, header, percentile, preamble, ratio

MODES = ("local", "sync", "deferred")


def prompts_for(model: str, n: int) -> list[list[int]]:
    tok = load_tokenizer(resolve(model))
    conversations = humaneval_messages()
    out = []
    for i in range(n):
        text = tok.apply_chat_template(conversations[i % len(conversations)], add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def serve(args: argparse.Namespace, address: str, keys: Path, rtt_ms: float) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "speckernel", "serve-drafter", "--method", args.method, "--model", args.model,
           "--bind", address, "--keys", str(keys), "--inject-rtt-ms", str(rtt_ms), "--log-level", "warning"]
    for flag, value in (("--platform", args.platform), ("--dtype", args.dtype), ("--draft-model", args.draft_model)):
        if value is not None:
            cmd += [flag, value]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving"):
        proc.kill()
        raise RuntimeError(f"serve-drafter did not start: {line!r}")
    return proc


def measure(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Warm-up requests, then the prompts at once: per-step periods, tokens/s, outputs."""
    from ...engine.core import EngineCore  # torch loads for this scenario alone

    core = EngineCore(config)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    keys = iter(range(1 << 30))

    def run(batch: list[list[int]], p: SamplingParams) -> tuple[list[list[int]], list[float], float]:
        ids = [next(keys) for _ in batch]
        out: dict[int, list[int]] = {k: [] for k in ids}
        for k, prompt in zip(ids, batch, strict=True):
            assert core.add_request(AddRequest(k, np.asarray(prompt), p)) is None
        periods = []
        started = time.perf_counter()
        while core.scheduler.requests:
            t = time.perf_counter()
            for delta in core.step():
                out[delta.key].extend(delta.new_token_ids)
            periods.append(time.perf_counter() - t)
        return [out[k] for k in ids], periods, time.perf_counter() - started

    run(prompts[:1], warm)
    before = core.stats()["spec"]
    outputs, periods, elapsed = run(prompts, params)
    spec = core.stats()["spec"]
    phases = phase_means(before.get("plugin", {}), spec.get("plugin", {}))
    timed = getattr(core.speculator, "timed_proposals", None)
    p50 = phase_p50(timed()[-int(phases["num_timed_proposals"]) :]) if phases and callable(timed) else None
    generated = sum(len(o) for o in outputs)
    close = getattr(core.speculator, "close", None)
    if callable(close):
        close()
    return {"num_steps": len(periods), "step_p50_ms": percentile([p * 1e3 for p in periods], 50),
            "step_p90_ms": percentile([p * 1e3 for p in periods], 90), "generated_tokens": generated,
            "elapsed_s": elapsed, "tokens_per_s": generated / elapsed if elapsed else None,
            "mean_acceptance_length": spec["mean_acceptance_length"],
            "accepted_tokens": spec["num_accepted_tokens"] - before["num_accepted_tokens"],
            "plugin": spec.get("plugin", {}), "phases": phases, "phases_p50": p50, "outputs": outputs}


BEFORE_SEND = ("decode", "hold", "prepare", "compute", "d2h")
"""The server's phases inside a proposal's round trip, up to its reply's send (the `send` a reply
carries is of the reply before it)."""


def phase_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Mean ms per proposal of each timed phase over the measured run (the remote speculator's
    `time_*_ms` counters), with `wire`: the round trip less the server's phases before its send
    (the reply's own send and the transport both ways)."""
    n = after.get("num_timed_proposals", 0) - before.get("num_timed_proposals", 0)
    if not n:
        return None
    means = {name.removeprefix("time_").removesuffix("_ms"): (after[name] - before.get(name, 0.0)) / n
             for name in after if name.startswith("time_")}
    means["wire"] = means["round_trip"] - sum(means[f"server_{p}"] for p in BEFORE_SEND)
    means["num_timed_proposals"] = n
    return means


def phase_p50(calls: list[dict[str, float]]) -> dict[str, float] | None:
    """Each phase's p50 over the run's proposals (one slow wake-up on a busy host moves a mean)."""
    if not calls:
        return None
    for c in calls:
        c["wire"] = c["round_trip"] - sum(c[f"server_{p}"] for p in BEFORE_SEND)
    return {name: float(np.percentile([c[name] for c in calls], 50)) for name in calls[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = prompts_for(args.model, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    base = msgspec.structs.replace(base_config(args), max_num_seqs=max(args.num_prompts, 1))
    spec = {"num_speculative_tokens": args.num_speculative_tokens, "draft_model": args.draft_model}
    runs: list[dict[str, Any]] = []
    local = measure(msgspec.structs.replace(base, speculator=args.method, **spec), prompts, params)
    runs.append({"mode": "local", "rtt_ms": 0.0} | local)
    with tempfile.TemporaryDirectory(prefix="sk-remote-") as tmp:
        keys = Path(tmp) / "keys"
        for rtt in args.rtt_ms:
            address = f"ipc://{tmp}/drafter-{rtt}.sock"
            proc = serve(args, address, keys, rtt)
            try:
                for mode in ("sync", "deferred"):
                    options = {"address": address, "keys": str(keys), "deferred": str(mode == "deferred").lower()}
                    config = msgspec.structs.replace(base, speculator="remote", speculator_options=options, **spec)
                    runs.append({"mode": mode, "rtt_ms": rtt} | measure(config, prompts, params))
                    phases = runs[-1]["phases"] or {}
                    print(f"bench remote: rtt {rtt} ms {mode}: step p50 {runs[-1]['step_p50_ms']:.2f} ms; per "
                          "proposal, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait()
    for r in runs:
        sync = next((s for s in runs if s["mode"] == "sync" and s["rtt_ms"] == r["rtt_ms"]), None)
        r["period_vs_sync"] = ratio(r["step_p50_ms"], sync["step_p50_ms"]) if sync is not None else None
        r["identical_to_local"] = sum(a == b for a, b in zip(r["outputs"], local["outputs"], strict=True))
    for r in runs:
        r.pop("outputs")
    platform = registry.pick_platform(args.platform)
    return header("remote") | {
        "platform": platform.name, "dtype": args.dtype or str(platform.default_dtype()).removeprefix("torch."),
        "device": device_name(platform.device), "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts, "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Remote drafter ({report['method']}, K={report['num_speculative_tokens']}) in a second "
                             f"process, {report['num_prompts']} HumanEval chat prompts at once, greedy, "
                             f"max_tokens {report['max_tokens']}")
    lines += [
        "Round trip injected by the server (`--inject-rtt-ms`); step period: one `EngineCore.step()` (schedule, "
        "launch, the speculator's pass, the ledger). vs sync: deferred's step p50 over sync's at the same round trip.",
        "",
        "| mode | injected RTT ms | steps | step p50 ms | step p90 ms | tokens/s | mean acceptance length | "
        "vs sync | failed calls | identical to local |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        failed = r["plugin"].get("num_failed_calls")
        lines.append(
            f"| {r['mode']} | {r['rtt_ms']:g} | {r['num_steps']} | {cell(r['step_p50_ms'])} | {cell(r['step_p90_ms'])} "
            f"| {cell(r['tokens_per_s'], '.1f')} | {cell(r['mean_acceptance_length'])} | {cell(r['period_vs_sync'])} "
            f"| {cell(failed, '.0f')} | {r['identical_to_local']}/{report['num_prompts']} |")
    timed = [r for r in report["runs"] if r.get("phases_p50")]
    if timed:
        lines += [
            "",
            "Where a proposal's time goes, p50 ms per proposal (means in the JSON). Engine: build (the request, its "
            "device-to-host copy included), encode, send (to the socket: waiting for the reply thread to let go of "
            "it), round trip (the socket's send call to the reply in), decode (into the staging), release (staged "
            "to the waiting work going on), exposed (how long the step waited for the reply: what no host work "
            "hid), overlap (the host work between the send and that wait). Server: decode, hold (the injected "
            "round trip), prepare (checks, plan, copies to the device), compute (as the host issued it; device: its "
            "device time, where timed), d2h, send (encoding and sending the reply before); wire: the round trip "
            "less the server's phases before its send (the reply's own send and the transport both ways).",
            "",
            "| mode | injected RTT ms | build | encode | send | round trip | server decode | hold | prepare | compute "
            "| device | d2h | server send | wire | decode | release | exposed | overlap |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in timed:
            p = r["phases_p50"]
            device = p.get("server_device_compute") if p.get("server_device_compute") else None
            cells = [p["build"], p["encode"], p["send"], p["round_trip"], p["server_decode"], p["server_hold"],
                     p["server_prepare"], p["server_compute"], device, p["server_d2h"], p["server_send"], p["wire"],
                     p["decode"], p["release"], p["exposed"], p["overlap"]]
            lines.append(f"| {r['mode']} | {r['rtt_ms']:g} | " + " | ".join(cell(c, ".3f") for c in cells) + " |")
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("sync", "deferred"):
        rows = sorted((r for r in report["runs"] if r["mode"] == mode), key=lambda r: r["rtt_ms"])
        ax.plot([r["rtt_ms"] for r in rows], [r["step_p50_ms"] for r in rows], marker="o", label=f"remote, {mode}")
    local = next(r for r in report["runs"] if r["mode"] == "local")
    ax.axhline(local["step_p50_ms"], color="grey", linestyle="--", label="local drafter")
    ax.set_xlabel("injected round trip (ms)")
    ax.set_ylabel("step period p50 (ms)")
    ax.set_title(f"Remote {report['method']}, {report['platform']} {report['dtype']}")
    ax.legend()
    return fig
