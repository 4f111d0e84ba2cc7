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
   resumable `state.pt` written every `--save-every` steps and at the end, `train_log.json`
   and `loss.png`. Running the same command again resumes where the last one stopped.

Resuming is exact: runs stopped at a step and resumed (by `--minutes`, Ctrl-C, a killed job)
end with the weights and the per-step losses of one run that never stopped, so many short runs
on a GPU add up to one long training. state.pt keeps the weights, the optimizer, the step,
torch's random state (CPU, and CUDA's on a GPU: the block drafters' losses draw random anchors)
and the flags that define the training. The batch of each step is a function of (--seed, step)
alone (`data.step_batches`), so the data position is the step and nothing the feed built ahead
is lost or repeated. The learning rate is a function of the step alone too (`lr_at`: warm-up,
then cosine over --steps); `--minutes` bounds one run and does not bend the schedule, so a run
of --steps it cannot finish in time ends with the learning rate where that step has it, and the
next run goes on from there. A resumed run with another --lr, --warmup, --batch-size, --seq-len
or --seed than state.pt saved is refused (`InvalidInputError`: it would be another training);
another --steps is followed, with a note (the schedule from the current step on spreads over
the new total: how a finished training is extended). Training data that changed since state.pt
was saved (sequence count, token count, digest: another --data, --holdout, a regenerated file),
other --method(s) beside it or another kind of device are said in a note and training goes on,
no longer exactly the stopped run's. Every log entry has `tokens` (training tokens so far,
all runs together); train_log.json's `clock` gives the training wall time at each read of the
device, and its summary the totals over all runs and one entry per run (`each_run`).

`--minutes` bounds the whole run (`budget`): data gets a share of it, training the rest less
the time to save, and a checkpoint is written whatever happened before (no data in time: the
drafter as it started; Ctrl-C: as far as it got, then the command stops as interrupted). A
line comes at least every 10 s, inside a slow step too (`heartbeat`). Defaults are sized to
the device (`args.SIZED`): a CPU run is a few dozen answers and small batches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
from ...progress import LOG_EVERY_S, Every
from ...runner.host_copy import syncs_fail
from .args import size_defaults, trainable
from .budget import Budget
from .corpus import build_corpus, read_corpus
from .data import Interrupted, Sequences, TargetFeatures, batches, generate, label_counts, step_batches
from .feed import DeviceBatch, DeviceFeed
from .follow_ups import choose
from .heartbeat import Heartbeat
from .meter import Meter
from .step import Figures, MethodRun, read_figures, set_rng_state, train_step


class Doing(msgspec.Struct):
    """What training is busy with and since when: the heartbeat's line between two steps."""

    what: str
    since: float

    def start(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()


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


def load_data(args: argparse.Namespace, budget: Budget, beat: Heartbeat) -> Sequences:
    """--data when it exists, else the target's answers to the prompts, generated until every
    prompt is answered or the data's share of --minutes is over, and written to --data. On
    Ctrl-C, what was made is written too and `Interrupted` (holding it) goes on up."""
    paths = args.data or [data_path(args)]
    if all(p.exists() for p in paths):
        data = Sequences.concat([Sequences.load(p) for p in paths])
        beat.say(f"train-drafter: {len(data)} sequences from {', '.join(map(str, paths))}")
        return data
    if len(paths) > 1:
        raise InvalidInputError(f"--data: {', '.join(str(p) for p in paths if not p.exists())} missing; "
                                "data is generated into one file")
    path = paths[0]
    if not 0.0 <= args.follow_ups <= 1.0:
        raise InvalidInputError(f"--follow-ups: expected a share in [0, 1], got {args.follow_ups}")
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise InvalidInputError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)
    config = EngineConfig(model=args.target, platform=args.platform, max_num_seqs=args.concurrency,
                          max_model_len=2048, kv_cache_bytes=kv_bytes, log_level="warning").validate()
    started = time.monotonic()
    with beat.watch(lambda: f"train-drafter: building the prompt corpus, {time.monotonic() - started:.0f} s"):
        conversations = [c for f in args.prompts for c in read_corpus(f)] if args.prompts \
            else build_corpus(args.num_prompts, seed=args.seed)
    conversations = conversations[int(index) :: int(count)]
    if not conversations:
        raise InvalidInputError("the prompt corpus is empty")
    deadline = budget.data_deadline(training_follows=not args.generate_only)
    most = f" for at most {max(0.0, deadline - time.monotonic()):.0f} s" if math.isfinite(deadline) else ""
    beat.say(f"train-drafter: answering {len(conversations)} prompts, {args.concurrency} at once, up to "
             f"{args.max_tokens} tokens each{most}")
    try:
        with beat.watch(None):  # the generation's own progress line speaks for it
            data = generate(config, conversations, args.max_tokens, concurrency=args.concurrency,
                            temperature=args.temperature, seed=args.seed, deadline=deadline,
                            follow_ups=choose(len(conversations), args.follow_ups, args.seed))
    except Interrupted as e:
        keep_data(e.data, path, len(conversations), started, beat, "when interrupted")
        raise
    keep_data(data, path, len(conversations), started, beat, "at the time limit")
    return data


def keep_data(data: Sequences, path: Path, asked: int, started: float, beat: Heartbeat, why: str) -> None:
    """Writes the answers made (none: nothing written, so the next run generates again) and says
    how many, and how many prompts got a whole answer."""
    if not len(data):
        beat.say(f"train-drafter: no answer made {why} ({time.monotonic() - started:.0f} s); nothing written "
                 f"to {path}")
        return
    data.save(path)
    answered = int((np.diff(data.offsets) - data.prompt_lens).sum())
    missing = asked - len(data)
    left = f" ({missing} prompts left out {why}; delete the file to generate again)" if missing else ""
    beat.say(f"train-drafter: {len(data)} answers, {answered} tokens in {time.monotonic() - started:.0f} s "
             f"-> {path}{left}")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth at --steps: a function of the step and the
    saved flags alone, never of the clock, so runs stopped and resumed follow the schedule of
    one run that never stopped."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


REFUSED = {"lr": "--lr", "warmup": "--warmup", "batch_size": "--batch-size", "seq_len": "--seq-len",
           "seed": "--seed"}
"""The flags a resumed run must share with state.pt: another value of any is another training
(another schedule, other batches), which resuming would silently mix with this one."""


def settings(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The flags that define the training, as state.pt keeps them."""
    return {**{k: getattr(args, k) for k in REFUSED}, "steps": args.steps, "methods": sorted(set(args.method)),
            "device": device.type}


def check_resume(args: argparse.Namespace, method: str, out: Path, state: dict[str, Any],
                 fingerprint: dict[str, Any], device: torch.device, beat: Heartbeat) -> None:
    """Refuses a resumed run whose REFUSED flags differ from state.pt's; says in a note what
    else differs (--steps, the data, the methods beside it, the device) and goes on."""
    saved = state.get("settings")
    if saved is None:
        beat.say(f"train-drafter: {method}: {out / 'state.pt'} is from a version that kept no settings: resuming its "
                 "weights and optimizer, but the batches and the random state start anew, not where it stopped")
        return
    now = settings(args, device)
    differ = [k for k in REFUSED if saved.get(k) != now[k]]
    if differ:
        then = " ".join(f"{REFUSED[k]} {saved.get(k)}" for k in differ)
        asked = " ".join(f"{REFUSED[k]} {now[k]}" for k in differ)
        raise InvalidInputError(f"train-drafter: {out / 'state.pt'} was trained with {then}, this run asks for "
                                f"{asked}: a resumed run continues the same training; pass the saved values, or "
                                "another --out to start a new training")
    if saved["steps"] != now["steps"] and state["step"] < now["steps"]:
        beat.say(f"train-drafter: {method}: --steps {now['steps']} (state.pt: {saved['steps']}): the learning rate "
                 f"from step {state['step']} on follows the schedule over {now['steps']} steps")
    if saved["methods"] != now["methods"]:
        beat.say(f"train-drafter: {method}: trained beside {'+'.join(saved['methods'])} before, "
                 f"{'+'.join(now['methods'])} now: the random stream the losses share differs from there on")
    if saved["device"] != now["device"]:
        beat.say(f"train-drafter: {method}: trained on {saved['device']} before, {now['device']} now: the "
                 "arithmetic and the device's random state differ from there on")
    data = state.get("data", {})
    if data and data != fingerprint:
        then, now_ = (f"{d['sequences']} sequences, {d['tokens']} tokens" for d in (data, fingerprint))
        how = f"{then} then, {now_} now" if then != now_ else f"{now_} as then, but other tokens"
        beat.say(f"train-drafter: {method}: the training data is not what state.pt was trained on ({how}: another "
                 "--data or --holdout, or a file changed); training goes on with it, on other batches than the "
                 "stopped run's")


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


@runtime_checkable
class ShipsCheckpoint(Protocol):
    """Optional for a `TrainableSpeculator`: a checkpoint that comes with it, which
    `--init METHOD` names (the learned drafters ship theirs for the default model)."""

    @classmethod
    def shipped_checkpoint(cls) -> Path | None:
        """The shipped checkpoint's folder (None: none ships)."""
        ...


def init_folder(init: str | None, method: str, several: bool) -> Path | None:
    """The checkpoint --init names for `method`: a folder (with several methods, the METHOD
    folder inside it), or, by a trainable method's name, the checkpoint shipped with it."""
    if init is None:
        return None
    path = Path(init).expanduser()
    if path.exists():
        return path / method if several else path
    names = ", ".join(n for n in trainable() if isinstance(trainable()[n], ShipsCheckpoint))
    if init not in trainable():
        raise InvalidInputError(f"--init {init}: no such folder, nor the name of a shipped drafter ({names})")
    if several:
        raise InvalidInputError(f"--init {init}: a shipped drafter's name serves one --method; with several, "
                                "--init takes a folder holding one checkpoint folder per method")
    cls = trainable()[init]
    shipped = cls.shipped_checkpoint() if isinstance(cls, ShipsCheckpoint) else None
    if shipped is None:
        raise InvalidInputError(f"--init {init}: no drafter ships with {init} (shipped: {names or 'none'}); "
                                "pass a checkpoint folder")
    return shipped


def method_folders(args: argparse.Namespace) -> dict[str, tuple[Path, Path | None]]:
    """Each method's output folder and --init checkpoint: --out and --init themselves for one
    method, a METHOD folder inside each for several."""
    methods = list(dict.fromkeys(args.method))
    several = len(methods) > 1
    if not several:
        return {methods[0]: (args.out or Path("drafters") / methods[0], init_folder(args.init, methods[0], False))}
    base = args.out or Path("drafters")
    return {m: (base / m, init_folder(args.init, m, True)) for m in methods}


def start_method(args: argparse.Namespace, method: str, out: Path, init: Path | None, target_cfg: ModelConfig,
                 data: Sequences, fingerprint: dict[str, Any], device: torch.device, beat: Heartbeat) -> MethodRun:
    """A method's drafter: new (seeded), from --init, or resumed from its folder's state.pt
    (checked by `check_resume` first, so a refused run changes nothing)."""
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
    run = MethodRun(method, cls, drafter, optimizer, params, out, settings=settings(args, device), data=fingerprint)
    if (out / "state.pt").exists():  # resume
        state = torch.load(out / "state.pt", map_location=device, weights_only=False)
        check_resume(args, method, out, state, fingerprint, device, beat)
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        run.step, run.log = state["step"], state["log"]
        run.tokens, run.seconds_before = state.get("tokens", 0), state.get("seconds", 0.0)
        run.clock, run.runs, run.rng = list(state.get("clock", [])), list(state.get("runs", [])), state.get("rng")
        killed = sum(r["stopped_by"] is None for r in run.runs)
        lost = f"; {killed} ended without their final save" if killed else ""
        beat.say(f"train-drafter: resuming {method} at step {run.step} ({len(run.runs)} runs before this one{lost})")
    run.begin_run()
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
    them, within --minutes when given, and saves each checkpoint whatever stopped the run (the
    steps, the deadline, no data in time, Ctrl-C: saved, then KeyboardInterrupt goes on up).
    Returns the summary of the one method, or {"methods": {method: summary}} for several."""
    budget = Budget(args.minutes, args.data_share)  # the run's clock starts here
    if args.minutes < 0:
        raise InvalidInputError(f"--minutes: expected >= 0, got {args.minutes}")
    if not 0 < args.data_share <= 1:
        raise InvalidInputError(f"--data-share: expected a share in (0, 1], got {args.data_share}")
    if not 0 <= args.holdout < 1:
        raise InvalidInputError(f"--holdout: expected a share in [0, 1), got {args.holdout}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size_defaults(args, device.type == "cuda")
    if args.eval_every < 1 or args.eval_batches < 1:
        raise InvalidInputError("--eval-every and --eval-batches: expected >= 1")
    if args.seed < 0:
        raise InvalidInputError(f"--seed: expected >= 0, got {args.seed}")
    folders = method_folders(args)
    for out, _ in folders.values():
        out.mkdir(parents=True, exist_ok=True)
    with Heartbeat() as beat, beat.watch(lambda: f"train-drafter: {time.monotonic() - budget.start:.0f} s into "
                                                  f"the run{until(budget)}"):
        within = f", within {budget.seconds:.0f} s" if budget.limited else ""
        beat.say(f"train-drafter: {'+'.join(folders)} for {args.target}, training on {device}{within}")
        stopped: KeyboardInterrupt | None = None
        try:
            data = load_data(args, budget, beat)
        except Interrupted as e:
            data, stopped = e.data, e
        if args.generate_only:
            if stopped is not None:
                raise stopped
            return {"sequences": len(data)}
        return train_and_save(args, data, folders, device, budget, beat, stopped)


def until(budget: Budget) -> str:
    """', N s left' with a deadline, else nothing: the end of a progress line."""
    return f", {max(0.0, budget.left()):.0f} s left" if budget.limited else ""


def split_data(data: Sequences, holdout: float, beat: Heartbeat) -> tuple[Sequences, Sequences]:
    """(kept, held out) by --holdout; all kept when the share would hold out every sequence (a
    few answers made before a deadline), since a run always trains on what it has."""
    kept, held = data.split(holdout)
    if len(data) and not len(kept):
        beat.say(f"train-drafter: --holdout {holdout} would hold out all {len(data)} sequences; training on "
                 "all of them, none held out")
        return data, data.select(np.zeros(0, np.int64))
    return kept, held


def train_and_save(args: argparse.Namespace, data: Sequences, folders: dict[str, tuple[Path, Path | None]],
                   device: torch.device, budget: Budget, beat: Heartbeat, stopped: KeyboardInterrupt | None
                   ) -> dict[str, Any]:
    """The drafters built (or resumed), trained while there is data, time and no Ctrl-C, then saved."""
    path = resolve(args.target)
    target_cfg = read_config(path)
    data, held_data = split_data(data, args.holdout, beat)
    fingerprint = data.fingerprint()
    runs = [start_method(args, m, out, init, target_cfg, data, fingerprint, device, beat)
            for m, (out, init) in folders.items()]
    meter = Meter(device)
    why = "steps"
    if stopped is not None:
        why = "interrupted"
    elif not len(data):
        why = "no data"
        beat.say("train-drafter: no data to train on (none made in time): saving the drafter as it started")
    elif any(r.step < args.steps for r in runs):
        try:
            why = fit(args, runs, data, held_data, path, device, budget, beat, meter)
        except KeyboardInterrupt as e:
            stopped, why = e, "interrupted"
            beat.say("train-drafter: interrupted: saving what was trained")
    summaries = {}
    saving = time.monotonic()
    with beat.watch(lambda: f"train-drafter: saving, {time.monotonic() - saving:.0f} s"):
        for r in runs:
            summaries[r.method] = save_run(args, r, runs, meter, len(data), len(held_data), device, why, beat)
    meter.close()
    if stopped is not None:
        raise stopped
    return summaries[runs[0].method] if len(runs) == 1 else {"methods": summaries}


def fit(args: argparse.Namespace, runs: list[MethodRun], data: Sequences, held_data: Sequences, path: Path,
        device: torch.device, budget: Budget, beat: Heartbeat, meter: Meter) -> str:
    """The training loop, until --steps or the time to save; returns which ended it ("steps" or
    "deadline"). A step starts only when the mean step so far still fits before the deadline, a
    held-out measurement only when its estimate does; a line comes every --log-every steps or
    10 s (`heartbeat`: while a long step runs too). A resumed run goes on from the step its runs
    are at, with the batches of those steps and the random state its state.pt saved; the
    training clock runs from the first step to the last measurement."""
    on_gpu = device.type == "cuda"
    loading = time.monotonic()
    with beat.watch(lambda: f"train-drafter: loading the target, {time.monotonic() - loading:.0f} s"):
        target = load_model(path, torch.bfloat16 if on_gpu else torch.float32, device, args.seq_len + 32)
    features = TargetFeatures(target, tuple(sorted({layer for r in runs for layer in r.drafter.config.target_layers})),
                              tuple(sorted({layer for r in runs for layer in r.drafter.config.kv_layers})))
    first = min(r.step for r in runs)
    held = [] if not len(held_data) else list(itertools.islice(
        DeviceFeed(batches(held_data, args.batch_size, args.seq_len, np.random.default_rng([args.seed, 1])), device),
        args.eval_batches))
    span = f", for {max(0.0, budget.training_end - time.monotonic()):.0f} s" if budget.limited else ""
    beat.say(f"train-drafter: training on {len(data)} sequences, {len(held_data)} held out{span}")
    if len({r.step for r in runs if r.step < args.steps}) > 1:
        at = ", ".join(f"{r.method} {r.step}" for r in runs)
        beat.say(f"train-drafter: the methods resume at different steps ({at}): the batches follow step {first}, so "
                 "those further on see other batches than they would alone")
    feed = DeviceFeed(step_batches(data, args.batch_size, args.seq_len, args.seed, first), device)
    saved = next((r.rng for r in runs if r.step == first and r.rng is not None), None)
    if saved is not None:  # the random stream where the stopped run left it, after whatever loading drew
        set_rng_state(saved, device)
    for r in runs:
        r.drafter.train()
        r.start_clock()
    started = time.monotonic()
    try:
        return train_loop(args, runs, held, features, feed, device, budget, beat, meter, first, started)
    finally:
        for r in runs:
            r.stop_clock()


def train_loop(args: argparse.Namespace, runs: list[MethodRun], held: list[DeviceBatch], features: TargetFeatures,
               feed: DeviceFeed, device: torch.device, budget: Budget, beat: Heartbeat, meter: Meter, first: int,
               started: float) -> str:
    """`fit`'s steps, measurements and saves, from step `first`; returns what ended them."""
    on_gpu = device.type == "cuda"
    name = "+".join(r.method for r in runs)
    bar = tqdm(total=args.steps, initial=first, desc=f"training {name}", unit="step", file=sys.stderr, disable=None)
    log_every = max(1, args.log_every)
    shown = {r.method: len(r.log) for r in runs}
    every = Every(LOG_EVERY_S)
    doing = Doing(f"step {first + 1}", time.monotonic())

    def status() -> str:
        return (f"train-drafter: {name} {doing.what} running for {time.monotonic() - doing.since:.0f} s"
                f"{until(budget)}")

    why = "steps"
    with bar, beat.watch(status):
        while any(r.step < args.steps for r in runs):
            done = max(r.step for r in runs) - first
            per_step = (time.monotonic() - started) / done if done else 0.0
            if not budget.fits(per_step):
                why = "deadline"
                break
            stepped = [r for r in runs if r.step < args.steps]
            lrs = [lr_at(r.step, args) for r in stepped]
            doing.start(f"step {max(r.step for r in stepped) + 1}")
            meter.begin()
            with syncs_fail(args.sync_check and on_gpu):
                tokens = train_step(stepped, features, feed, lrs)
            meter.end(tokens)
            bar.update(1)
            step = max(r.step for r in stepped)
            if step % log_every == 0 or step == args.steps or every():  # the device is read here
                for r in runs:
                    r.flush()
                postfix = interval_postfix(runs, shown, meter.read(), meter)
                bar.set_postfix(postfix)
                if bar.disable:  # no bar: a line now and then
                    rate = (step - first) / max(time.monotonic() - started, 1e-9)
                    figures = ", ".join(f"{k} {v}" for k, v in postfix.items())
                    beat.say(f"train-drafter: {name} step {step}/{args.steps}, {figures}, {rate:.2f} steps/s"
                             f"{until(budget)}")
                else:
                    beat.heard()
            due = [r for r in stepped if r.step % args.eval_every == 0]
            if held and due and budget.fits(eval_estimate(held, per_step)):
                doing.start("measuring on the held-out prompts")
                evaluate(due, features, held, device)
            for r in stepped:
                if r.step % args.save_every == 0:
                    r.save_state()
        for r in runs:
            r.flush()
        last = [r for r in runs if r.log and "val_loss" not in r.log[-1]]
        if held and last:
            done = max(r.step for r in runs) - first
            if budget.fits(eval_estimate(held, (time.monotonic() - started) / max(done, 1))):
                doing.start("measuring on the held-out prompts")
                evaluate(last, features, held, device)
            else:
                beat.say("train-drafter: no final held-out measurement: it would not end before the deadline")
    meter.read()
    return why


def eval_estimate(held: list[DeviceBatch], per_step: float) -> float:
    """Seconds a held-out measurement should take: a forward of target and drafter per batch,
    about half a training step (which adds the backward and the optimizer)."""
    return 0.5 * per_step * len(held)


def save_run(args: argparse.Namespace, r: MethodRun, runs: list[MethodRun], meter: Meter, sequences: int,
             held_out: int, device: torch.device, why: str, beat: Heartbeat) -> dict[str, Any]:
    """One method's checkpoint, state.pt, train_log.json and loss.png; returns its summary:
    steps, tokens and training seconds in all, over every run of the training (`runs` of them,
    one entry each in `each_run`, this one last), and this run's settings and throughput."""
    r.save_state(why)
    r.cls.save(r.out, r.drafter)
    n_params = sum(p.numel() for p in r.params)
    each_run = [*r.runs, r.run_entry(why)]
    summary = {"method": r.method, "steps": r.step, "tokens": r.tokens, "seconds": r.seconds(),
               "runs": len(each_run), "parameters": n_params, "batch_size": args.batch_size,
               "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "planned_steps": args.steps,
               "seed": args.seed, "sequences": sequences, "held_out": held_out, "data": r.data,
               "trained_with": [x.method for x in runs], "stopped_by": why,
               "config": msgspec.to_builtins(r.drafter.config), "final": r.log[-1] if r.log else {},
               "device": str(device), "throughput": meter.total(), "each_run": each_run}
    (r.out / "train_log.json").write_text(train_log_text(summary, r.log, r.clock))
    plot_loss(r.log, r.out / "loss.png", r.method)
    beat.say(f"train-drafter: {r.method} {r.step} steps ({why}), {n_params / 1e6:.1f}M parameters -> {r.out}")
    return summary


def interval_postfix(runs: list[MethodRun], shown: dict[str, int], rates: dict[str, float],
                     meter: Meter) -> dict[str, str]:
    """The progress figures of the log interval just read: each figure's mean over the
    interval's steps (only the loss, per method, for several methods), training tokens/s and
    GPU utilisation with where it comes from. `shown` is how much of each log was shown before."""
    postfix: dict[str, str] = {}
    for r in runs:
        new = [{k: v for k, v in e.items() if k not in ("step", "tokens") and not k.startswith("val_")}
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


def train_log_text(summary: dict[str, Any], log: list[dict[str, float]],
                   clock: list[tuple[int, float]] | None = None) -> str:
    """train_log.json: the summary, then one line per step with its figures to 5 decimals, so the
    log of a run of thousands of steps stays small enough to keep beside its checkpoint; then
    `clock`, [step, training seconds so far] at each read of the device (the time axis of the
    curve; not in the steps' lines, which stay the same whatever the clock said)."""
    steps = ",\n  ".join(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in e.items()})
                         for e in log)
    times = ",\n  ".join(json.dumps([step, round(seconds, 3)]) for step, seconds in clock or [])
    return (f'{{"summary": {json.dumps(summary, indent=1)},\n "log": [\n  {steps}\n ],\n'
            f' "clock": [\n  {times}\n ]\n}}\n')


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
