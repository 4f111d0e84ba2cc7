"""`speckernel train-drafter`'s flags, and which speculators it trains: the discovered ones whose
capabilities say `trainable` (they have `speckernel.plugin.TrainableSpeculator`). Torch-free, so
building the CLI parser for any command stays light; the trainer itself is `drafter.py`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from ... import registry
from ...plugin import TrainableSpeculator


@cache
def trainable() -> dict[str, type[TrainableSpeculator]]:
    """Every discovered speculator that `train-drafter` trains, by name in sorted order: its
    capabilities say `trainable` and its class has the training protocol."""
    found: dict[str, type[TrainableSpeculator]] = {}
    for name in sorted(registry.discover("speculator")):
        try:
            cls = registry.load("speculator", name)
        except Exception:  # a broken third-party plugin must not hide the others (`speckernel plugins` shows it)
            continue
        if cls.capabilities.trainable and issubclass(cls, TrainableSpeculator):
            found[name] = cls
    return found


class TrainableNames:
    """`--method`'s choices, read from the registry the first time argparse checks or lists
    them: loading plugins imports torch, which building the parser for another command need not."""

    def __contains__(self, name: object) -> bool:
        return name in trainable()

    def __iter__(self) -> Iterator[str]:
        return iter(trainable())


SIZED: dict[str, tuple[int, int]] = {
    "num_prompts": (6000, 24),
    "concurrency": (256, 8),
    "max_tokens": (256, 96),
    "steps": (2000, 300),
    "batch_size": (32, 2),
    "seq_len": (512, 128),
    "warmup": (100, 10),
    "log_every": (50, 5),
    "save_every": (200, 50),
    "eval_every": (200, 50),
    "eval_batches": (4, 1),
}
"""Defaults sized to where the run happens, (on CUDA, elsewhere): a GPU answers 256 prompts at
once and steps through 16k-token batches in milliseconds; two CPU cores take seconds for a
batch of 512 tokens, so there the run is a few dozen short answers and small steps, and a
time-boxed run (`--minutes`) still trains and logs before its deadline."""


def size_defaults(args: argparse.Namespace, cuda: bool) -> None:
    """Fills the SIZED options the command line left unset, for CUDA or not."""
    for name, (on_cuda, elsewhere) in SIZED.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else elsewhere)


def sized(name: str) -> str:
    on_cuda, elsewhere = SIZED[name]
    return f"(default: {on_cuda} on CUDA, {elsewhere} elsewhere)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it has none to show (None, a flag's False): those say
    in their own words what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("train-drafter", help="train a learned drafter (a trainable speculator)",
                       formatter_class=HelpFormatter)
    p.add_argument("--method", required=True, choices=TrainableNames(), action="append", metavar="METHOD",
                   help="a trainable speculator (%(choices)s); repeatable: several methods train at once on the "
                        "same batches, sharing one forward of the target per batch (--out and --init then hold a "
                        "folder per method)")
    p.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: drafters/METHOD; with several methods, drafters/ holding one "
                        "folder per method); when it holds a state.pt, the run resumes it exactly: weights, "
                        "optimizer, step, batches, random state, log (--lr, --warmup, --batch-size, --seq-len and "
                        "--seed must be the saved ones; other data than it was trained on is said in a note)")
    p.add_argument("--data", type=Path, action="append", default=None,
                   help="token data (.npz, repeatable: concatenated); generated from the prompts when missing "
                        "(default: data.npz inside --out, or drafters/data.npz)")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="generate only every N-th prompt from the I-th (several GPUs, one process each)")
    p.add_argument("--prompts", type=Path, action="append", default=None,
                   help="JSON Lines of {\"messages\": [...]} (repeatable: concatenated; default: the built-in "
                        "corpus)")
    p.add_argument("--num-prompts", type=int, default=None, help=f"prompts drawn from the built-in corpus "
                                                                 f"{sized('num_prompts')}")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"answer length when generating data {sized('max_tokens')}")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the answers (more varied data; labels stay the target's greedy tokens)")
    p.add_argument("--follow-ups", type=float, default=0.0, metavar="SHARE",
                   help="when generating data, this share of the conversations gets a second user turn after the "
                        "target's whole answer (\"Can you make that shorter?\", \"How would you test that?\": "
                        "follow_ups.json) and the target answers it too, with its first answer in the context; the "
                        "held-out split keeps both answers on one side (0: none)")
    p.add_argument("--generate-only", action="store_true",
                   help="write the data and stop (--minutes then bounds the generation alone)")
    p.add_argument("--concurrency", type=int, default=None, help=f"answers generated at once {sized('concurrency')}")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache for generating data (default: sized from free memory; set it to run "
                        "several generating processes on one GPU)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps in all, every run of a resumed training together; the learning-rate "
                        "schedule spans them (a resumed run with a larger --steps extends the training: the "
                        f"schedule from its step on follows the new total, with a note) {sized('steps')}")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="bound the whole run (fractions allowed), then save (0: no limit): generating data "
                        "takes at most --data-share of it, answers still being written are cut there and kept "
                        "as far as they got; training runs until the deadline less the time to save; a "
                        "checkpoint is written even when no data was made in time (the drafter as it started). "
                        "It bounds this run only, not the learning-rate schedule, which follows the step: runs "
                        "cut by --minutes and resumed add up to one run of --steps (size --steps to the training "
                        "meant in all)")
    p.add_argument("--data-share", type=float, default=0.4,
                   help="with --minutes and training to follow: the share of the time that generating data "
                        "may take (it stops sooner when every prompt is answered)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences per training step (a resumed run must keep the saved one) {sized('batch_size')}")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per training sequence (longer ones are cut; a resumed run must keep the saved "
                        f"one) {sized('seq_len')}")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (AdamW; a resumed run must keep the saved one)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps of linear learning-rate warm-up, then cosine decay to a tenth at --steps: a "
                        "function of the step alone, never of --minutes, so a resumed run goes on with the "
                        f"schedule of one that never stopped (it must keep the saved --warmup) {sized('warmup')}")
    p.add_argument("--save-every", type=int, default=None,
                   help="steps between writes of the resumable state.pt (also written at the end): a run "
                        "killed without its final save resumes from the last one, exactly as if it had stopped "
                        f"there {sized('save_every')}")
    p.add_argument("--log-every", type=int, default=None,
                   help="steps between reads of the training figures from the device (the only host sync of "
                        "training besides measuring and saving; also whenever 10 s passed) and progress lines on "
                        "stderr when it is not a terminal (a bar shows otherwise): each figure's mean over the "
                        "interval, training tokens/s and GPU utilisation; a step longer than 10 s is reported "
                        f"while it runs {sized('log_every')}")
    p.add_argument("--sync-check", action="store_true",
                   help="on CUDA, fail at the first host sync inside a training step (torch.cuda.set_sync_debug_mode): "
                        "a check that steps never make the GPU wait for the host")
    p.add_argument("--holdout", type=float, default=0.02,
                   help="share of the prompts kept out of training (chosen by a hash of the prompt, so every "
                        "answer to one prompt is on the same side) to measure the drafter on; 0: none")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between measurements on the held-out prompts (val_* in train_log.json and "
                        f"loss.png), and one at the end {sized('eval_every')}")
    p.add_argument("--eval-batches", type=int, default=None,
                   help=f"batches per held-out measurement (fixed ones) {sized('eval_batches')}")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the corpus, the drafter's initial weights and the batches (each step's batch is "
                        "a function of the seed and the step; >= 0; a resumed run must keep the saved one)")
    p.add_argument("--platform", default=None, help="platform for generating data (default: best available)")
    p.add_argument("--device", default=None, help="torch device for training (default: cuda if present)")
    p.add_argument("--init", default=None, metavar="DIR|METHOD",
                   help="start from this checkpoint's weights instead of random ones: a checkpoint folder, or a "
                        "method's name for the drafter shipped with it (e.g. --init mtp: the shipped mtp "
                        "checkpoint, made for the default model); its architecture replaces the defaults (with "
                        "several methods: a folder holding one checkpoint folder per method)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the drafter's architecture (e.g. num_layers=1); with several "
                        "--method, it applies to every one of them, and METHOD.FIELD=VALUE to one. With --init, "
                        "a larger num_layers grows the checkpoint: the added layers start as identities")
