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


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("train-drafter", help="train a learned drafter (a trainable speculator)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", required=True, choices=TrainableNames(), action="append", metavar="METHOD",
                   help="a trainable speculator (%(choices)s); repeatable: several methods train at once on the "
                        "same batches, sharing one forward of the target per batch (--out and --init then hold a "
                        "folder per method)")
    p.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: drafters/METHOD; with several methods, drafters/ holding one "
                        "folder per method)")
    p.add_argument("--data", type=Path, action="append", default=None,
                   help="token data (.npz, repeatable: concatenated); generated from the prompts when missing "
                        "(default: data.npz inside --out, or drafters/data.npz)")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="generate only every N-th prompt from the I-th (several GPUs, one process each)")
    p.add_argument("--prompts", type=Path, action="append", default=None,
                   help="JSON Lines of {\"messages\": [...]} (repeatable: concatenated; default: the built-in "
                        "corpus)")
    p.add_argument("--num-prompts", type=int, default=6000, help="prompts drawn from the built-in corpus")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length when generating data")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the answers (more varied data; labels stay the target's greedy tokens)")
    p.add_argument("--generate-only", action="store_true", help="write the data and stop")
    p.add_argument("--concurrency", type=int, default=256, help="answers generated at once")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache for generating data (default: sized from free memory; set it to run "
                        "several generating processes on one GPU)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps in all (a resumed run continues)")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this long and save (0: no limit); when generating data, prompts not "
                        "started by then are left out")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (longer ones are cut)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50,
                   help="steps between reads of the training figures from the device (the only host sync of "
                        "training besides measuring and saving) and progress lines on stderr when it is not a "
                        "terminal (a bar shows otherwise): each figure's mean over the interval, training tokens/s "
                        "and GPU utilisation")
    p.add_argument("--sync-check", action="store_true",
                   help="on CUDA, fail at the first host sync inside a training step (torch.cuda.set_sync_debug_mode): "
                        "a check that steps never make the GPU wait for the host")
    p.add_argument("--holdout", type=float, default=0.02,
                   help="share of the prompts kept out of training (chosen by a hash of the prompt, so every "
                        "answer to one prompt is on the same side) to measure the drafter on; 0: none")
    p.add_argument("--eval-every", type=int, default=200,
                   help="steps between measurements on the held-out prompts (val_* in train_log.json and "
                        "loss.png), and one at the end")
    p.add_argument("--eval-batches", type=int, default=4, help="batches per held-out measurement (fixed ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--platform", default=None, help="platform for generating data (default: best available)")
    p.add_argument("--device", default=None, help="torch device for training (default: cuda if present)")
    p.add_argument("--init", type=Path, default=None, metavar="DIR",
                   help="start from this checkpoint's weights (e.g. a shipped drafter) instead of random ones; "
                        "its architecture replaces the defaults (with several methods: a folder holding one "
                        "checkpoint folder per method)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the drafter's architecture (e.g. num_layers=1); with several "
                        "--method, it applies to every one of them, and METHOD.FIELD=VALUE to one. With --init, "
                        "a larger num_layers grows the checkpoint: the added layers start as identities")
