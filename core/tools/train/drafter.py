"""`speckernel train-drafter`: trains a learned drafter for a target by self-distillation.

1. Data: the target answers a prompt corpus through the engine (`--prompts FILE`, else the
   built-in corpus of `speckernel.tools.train.corpus`, which never draws on HumanEval, the evaluation
   set). The answers are kept as token ids (`--data`, reused when it exists).
2. Training: the frozen target runs densely over random batches of those sequences; the
   drafter learns its greedy predictions from its hidden states (or KV rows) with the method's
   own loss (chained runs for mtp/eagle3, anchor blocks for dflash/dspark/causal_cascade).
   Several `--method`s train at once on the same batches: the target's forward, the larger
   part of a step, runs once for all of them, and each learns exactly what it would alone.
   The methods are the discovered speculators whose capabilities say `trainable`: they have
   the training protocol of `speckernel.plugin.TrainableSpeculator`, so a third-party drafter
   trains here as the built-in ones do. A step never waits for the device (`step`, `feed`):
   its figures stay there until the log interval (`--log-every`) reads them all at once, and the
   progress line gives the interval's training tokens/s and GPU utilisation (`meter`).
3. Output: `--out` holds `config.json` + `model.safetensors` (what `--draft-model` loads), a
   resumable `state.pt` written every `--save-every` steps, `train_log.json` and `loss.png`.
   Running the same command again resumes where the last one stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ...config import EngineConfig
from ...errors import InvalidInputError
from ...model_config import ModelConfig
from ...models.checkpoint import read_config, resolve
from ...models.loader import load_model
from ...plugin import FitsVocabulary, TrainableDrafter
from .args import trainable
from .corpus import build_corpus, read_corpus
from .data import Sequences, TargetFeatures, batches, generate, label_counts
from .feed import DeviceBatch, DeviceFeed
from .meter import Meter
from .step import Figures, MethodRun, read_figures, syncs_fail, train_step


def parse_overrides(items: list[str], method: str | None = None) -> dict[str, Any]:
    """--set's fields for `method`: FIELD=VALUE for every method, METHOD.FIELD=VALUE for one."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise InvalidInputError(f"--set: expected FIELD=VALUE or METHOD.FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if "." in key:
            only, key = key.split(".", 1)
            if only not in trainable():
                raise InvalidInputError(f"--set {item!r}: {only!r} is not a trainable method "
                                        f"({', '.join(trainable())})")
            if only != method:
                continue
        out[key] = json.loads(value) if value[:1] in "[{0123456789-.tf" else value
        if isinstance(out[key], list):
            out[key] = tuple(out[key])
    return out


def data_path(args: argparse.Namespace) -> Path:
    """Where generated data goes: inside --out (the folder named is the one written to), or
    drafters/data.npz, which every method's default folder beside it shares."""
    return (args.out if args.out is not None else Path("drafters")) / "data.npz"


def load_data(args: argparse.Namespace) -> Sequences:
    paths = args.data or [data_path(args)]
    if all(p.exists() for p in paths):
        data = Sequences.concat([Sequences.load(p) for p in paths])
        print(f"train-drafter: {len(data)} sequences from {', '.join(map(str, paths))}", file=sys.stderr)
        return data
    if len(paths) > 1:
        raise InvalidInputError(f"--data: {', '.join(str(p) for p in paths if not p.exists())} missing; "
                                "data is generated into one file")
    path = paths[0]
    conversations = [c for f in args.prompts for c in read_corpus(f)] if args.prompts \
        else build_corpus(args.num_prompts, seed=args.seed)
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise InvalidInputError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    conversations = conversations[int(index) :: int(count)]
    if not conversations:
        raise InvalidInputError("the prompt corpus is empty")
    kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)
    config = EngineConfig(model=args.target, platform=args.platform, max_num_seqs=args.concurrency,
                          max_model_len=2048, kv_cache_bytes=kv_bytes, log_level="warning").validate()
    started = time.monotonic()
    data = generate(config, conversations, args.max_tokens, concurrency=args.concurrency,
                    temperature=args.temperature, seed=args.seed, seconds=60 * args.minutes or None)
    data.save(path)
    answered = int((np.diff(data.offsets) - data.prompt_lens).sum())
    missing = len(conversations) - len(data)
    left = f" ({missing} prompts left out at the time limit)" if missing else ""
    print(f"train-drafter: {len(data)} answers, {answered} tokens in {time.monotonic() - started:.0f} s "
          f"-> {path}{left}", file=sys.stderr)
    return data


def lr_at(step: int, args: argparse.Namespace, elapsed_s: float) -> float:
    """Linear warm-up, then cosine decay to a tenth over --steps or --minutes, whichever ends first."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    if args.minutes:
        done = max(done, min(1.0, elapsed_s / (60 * args.minutes)))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def evaluate(runs: list[MethodRun], features: TargetFeatures, held: list[DeviceBatch], device: torch.device) -> None:
    """Each run's loss and figures on the fixed held-out batches, added to its last log entry as
    val_*. Seeded per batch (the same anchors every time, alone or beside other methods), inside a
    forked RNG, so measuring changes nothing that training draws next. The figures are read from
    the device once, after the last batch."""
    for r in runs:
        r.flush()
        r.drafter.eval()
    measured: list[tuple[str, Figures]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for i, fed in enumerate(held):
            batch = features.batch(fed.tokens, fed.mask, fed.counted)
            for r in runs:
                torch.manual_seed(i)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss, metrics = r.drafter.loss(batch)
                measured.append((r.method, {"loss": loss, **metrics}))
    sums: dict[str, dict[str, float]] = {r.method: {} for r in runs}
    for (method, _), values in zip(measured, read_figures([f for _, f in measured]), strict=True):
        for k, v in values.items():
            sums[method][k] = sums[method].get(k, 0.0) + v / len(held)
    for r in runs:
        r.drafter.train()
        r.log[-1].update({f"val_{k}": v for k, v in sums[r.method].items()})


def method_folders(args: argparse.Namespace) -> dict[str, tuple[Path, Path | None]]:
    """Each method's output folder and --init checkpoint: --out and --init themselves for one
    method, a METHOD folder inside each for several."""
    methods = list(dict.fromkeys(args.method))
    if len(methods) == 1:
        return {methods[0]: (args.out or Path("drafters") / methods[0], args.init)}
    base = args.out or Path("drafters")
    return {m: (base / m, None if args.init is None else args.init / m) for m in methods}


def start_method(args: argparse.Namespace, method: str, out: Path, init: Path | None, target_cfg: ModelConfig,
                 data: Sequences, device: torch.device) -> MethodRun:
    """A method's drafter: new (seeded), from --init, or resumed from its folder's state.pt."""
    cls = trainable()[method]
    overrides = parse_overrides(args.set, method)
    saved: dict[str, Any] = {}
    if init is not None:
        saved = msgspec.structs.asdict(cls.read_checkpoint(init, target_cfg))
        overrides = {**{k: v for k, v in saved.items() if k not in ("method", "target")}, **overrides}
    torch.manual_seed(args.seed)  # the same drafter whether it trains alone or beside others
    drafter = cls.new_drafter(target_cfg, args.seq_len + 32, **overrides).to(device)
    if init is not None:
        state = load_file(str(init / "model.safetensors"), device=str(device))
        layers = saved.get("num_layers", 0)
        if overrides.get("num_layers", layers) > layers:
            grow(drafter, state, layers, init)
        else:
            drafter.load_state_dict(state)
    elif isinstance(drafter, FitsVocabulary):
        drafter.fit_vocab(label_counts(data, target_cfg.vocab_size))
    params = [p for p in drafter.parameters() if p.requires_grad]
    # fused: one kernel for all parameters, its step counts on the device (not read by the host)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    run = MethodRun(method, cls, drafter, optimizer, params, out)
    if (out / "state.pt").exists():  # resume
        state = torch.load(out / "state.pt", map_location=device, weights_only=False)
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        run.step, run.log = state["step"], state["log"]
        print(f"train-drafter: resuming {method} at step {run.step}", file=sys.stderr)
    return run


GROWN_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
"""The projections that write into the residual stream: zero in a grown layer."""


def grow(drafter: TrainableDrafter, state: dict[str, torch.Tensor], layers: int, init: Path) -> None:
    """Loads a checkpoint of `layers` decoder layers into a deeper drafter (`--set num_layers=N`
    with --init). The added layers start as identities, their residual outputs zero, so the
    grown drafter drafts exactly what the checkpoint did and training only has to find what the
    extra depth adds."""
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    added = [k for k in missing if k.startswith("layers.") and int(k.split(".")[1]) >= layers]
    if unexpected or len(added) != len(missing) or not any(k.endswith(GROWN_OUTPUTS) for k in added):
        raise InvalidInputError(f"--init {init}: cannot add decoder layers to this drafter (weights missing "
                                f"from the checkpoint: {sorted(set(missing) - set(added))[:4]}, unexpected: "
                                f"{sorted(unexpected)[:4]}); leave num_layers as the checkpoint has it")
    tensors = drafter.state_dict()  # the parameters' own storage
    for name in added:
        if name.endswith(GROWN_OUTPUTS):
            tensors[name].zero_()


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Trains every --method on the same batches, one forward of the target per batch for all of
    them. Returns the summary of the one method, or {"methods": {method: summary}} for several."""
    if args.minutes < 0:
        raise InvalidInputError(f"--minutes: expected >= 0, got {args.minutes}")
    if not 0 <= args.holdout < 1:
        raise InvalidInputError(f"--holdout: expected a share in [0, 1), got {args.holdout}")
    if args.eval_every < 1 or args.eval_batches < 1:
        raise InvalidInputError("--eval-every and --eval-batches: expected >= 1")
    folders = method_folders(args)
    for out, _ in folders.values():
        out.mkdir(parents=True, exist_ok=True)
    data = load_data(args)
    if args.generate_only:
        return {"sequences": len(data)}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    path = resolve(args.target)
    target_cfg = read_config(path)
    data, held_data = data.split(args.holdout)
    if not len(data):
        raise InvalidInputError(f"--holdout {args.holdout} leaves no sequence to train on")
    runs = [start_method(args, m, out, init, target_cfg, data, device) for m, (out, init) in folders.items()]
    target = load_model(path, torch.bfloat16 if on_gpu else torch.float32, device, args.seq_len + 32)
    features = TargetFeatures(target, tuple(sorted({layer for r in runs for layer in r.drafter.config.target_layers})),
                              tuple(sorted({layer for r in runs for layer in r.drafter.config.kv_layers})))
    first = min(r.step for r in runs)
    held = [] if not len(held_data) else list(itertools.islice(
        DeviceFeed(batches(held_data, args.batch_size, args.seq_len, np.random.default_rng([args.seed, 1])), device),
        args.eval_batches))
    print(f"train-drafter: training on {len(data)} sequences, {len(held_data)} held out", file=sys.stderr)
    rng = np.random.default_rng(args.seed + first)
    feed = DeviceFeed(batches(data, args.batch_size, args.seq_len, rng), device)
    meter = Meter(device)
    started = time.monotonic()
    name = "+".join(r.method for r in runs)
    bar = tqdm(total=args.steps, initial=first, desc=f"training {name}", unit="step", file=sys.stderr, disable=None)
    log_every = max(1, args.log_every)
    shown = {r.method: len(r.log) for r in runs}
    for r in runs:
        r.drafter.train()
    with bar:
        while any(r.step < args.steps for r in runs):
            if args.minutes and time.monotonic() - started > 60 * args.minutes:
                break
            stepped = [r for r in runs if r.step < args.steps]
            lrs = [lr_at(r.step, args, time.monotonic() - started) for r in stepped]
            meter.begin()
            with syncs_fail(args.sync_check and on_gpu):
                tokens = train_step(stepped, features, feed, lrs)
            meter.end(tokens)
            bar.update(1)
            step = max(r.step for r in stepped)
            if step % log_every == 0 or step == args.steps:  # the log interval: the device is read here
                for r in runs:
                    r.flush()
                postfix = interval_postfix(runs, shown, meter.read(), meter)
                bar.set_postfix(postfix)
                if bar.disable:  # no bar: a line now and then
                    rate = (step - first) / max(time.monotonic() - started, 1e-9)
                    figures = ", ".join(f"{k} {v}" for k, v in postfix.items())
                    print(f"train-drafter: {name} step {step}/{args.steps}, {figures}, {rate:.2f} steps/s",
                          file=sys.stderr, flush=True)
            due = [r for r in stepped if r.step % args.eval_every == 0]
            if held and due:
                evaluate(due, features, held, device)
            for r in stepped:
                if r.step % args.save_every == 0:
                    r.save_state()
    for r in runs:
        r.flush()
    meter.read()
    meter.close()
    elapsed = time.monotonic() - started
    last = [r for r in runs if r.log and "val_loss" not in r.log[-1]]
    if held and last:
        evaluate(last, features, held, device)
    summaries = {}
    for r in runs:
        r.save_state()
        r.cls.save(r.out, r.drafter)
        n_params = sum(p.numel() for p in r.params)
        summary = {"method": r.method, "steps": r.step, "parameters": n_params, "seconds": elapsed,
                   "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "sequences": len(data),
                   "held_out": len(held_data), "trained_with": [x.method for x in runs],
                   "config": msgspec.to_builtins(r.drafter.config), "final": r.log[-1] if r.log else {},
                   "device": str(device), "throughput": meter.total()}
        (r.out / "train_log.json").write_text(train_log_text(summary, r.log))
        plot_loss(r.log, r.out / "loss.png", r.method)
        print(f"train-drafter: {r.method} {r.step} steps, {n_params / 1e6:.1f}M parameters -> {r.out}",
              file=sys.stderr)
        summaries[r.method] = summary
    return summaries[runs[0].method] if len(runs) == 1 else {"methods": summaries}


def interval_postfix(runs: list[MethodRun], shown: dict[str, int], rates: dict[str, float],
                     meter: Meter) -> dict[str, str]:
    """The progress figures of the log interval just read: each figure's mean over the
    interval's steps (only the loss, per method, for several methods), training tokens/s and
    GPU utilisation with where it comes from. `shown` is how much of each log was shown before."""
    postfix: dict[str, str] = {}
    for r in runs:
        new = [{k: v for k, v in e.items() if k != "step" and not k.startswith("val_")}
               for e in r.log[shown[r.method]:]]
        shown[r.method] = len(r.log)
        means = {k: sum(e[k] for e in new if k in e) / sum(k in e for e in new) for k in (new[-1] if new else {})}
        if len(runs) == 1:
            postfix.update({k: f"{v:.3f}" for k, v in means.items()})
        elif "loss" in means:
            postfix[r.method] = f"{means['loss']:.3f}"
    postfix["tokens/s"] = f"{rates['tokens_per_s']:.0f}"
    if "gpu_util" in rates and meter.gpu is not None:
        postfix["gpu"] = f"{rates['gpu_util']:.0f}% ({meter.gpu.source})"
    return postfix


def train_log_text(summary: dict[str, Any], log: list[dict[str, float]]) -> str:
    """train_log.json: the summary, then one line per step with its figures to 5 decimals, so the
    log of a run of thousands of steps stays small enough to keep beside its checkpoint."""
    steps = ",\n  ".join(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in e.items()})
                         for e in log)
    return f'{{"summary": {json.dumps(summary, indent=1)},\n "log": [\n  {steps}\n ]\n}}\n'


def plot_loss(log: list[dict[str, float]], path: Path, title: str) -> None:
    if not log:
        return
    try:
        import matplotlib  # optional: the `bench` extra
    except ImportError:
        print("train-drafter: matplotlib not installed, no loss.png (pip install 'speckernel[bench]')",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): the backend is chosen at import

    steps = [e["step"] for e in log]
    fig, ax = plt.subplots(figsize=(6, 4))
    window = max(1, len(log) // 50)
    smooth = np.convolve([e["loss"] for e in log], np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, color="C0", label="loss")
    measured = [e for e in log if "val_loss" in e]  # held-out figures: markers in the train curves' colours
    if measured:
        ax.plot([e["step"] for e in measured], [e["val_loss"] for e in measured], marker="o", markersize=3,
                color="C0", linestyle=":", label="held-out loss")
        ax.legend(loc="upper left", fontsize="small")
    accs = sorted({k for e in log for k in e if k.startswith("acc")})
    if accs:
        ax2 = ax.twinx()
        for i, k in enumerate(accs, start=1):
            values = np.convolve([e.get(k, 0.0) for e in log], np.ones(window) / window, mode="valid")
            ax2.plot(steps[window - 1 :], values, color=f"C{i}", linestyle="--", label=k)
            if measured:
                ax2.plot([e["step"] for e in measured], [e.get(f"val_{k}", np.nan) for e in measured], marker="o",
                         markersize=3, linestyle=":", color=f"C{i}")
        ax2.set_ylabel("top-1 accuracy (dots: held out)")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="center right", fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
