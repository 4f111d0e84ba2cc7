"""Acceptance of the shipped block drafters (dflash, dspark) estimated on the CPU, no GPU needed.

The target's greedy answers to the HumanEval prompts are walked the way greedy serving steps
through them: a block drafted from the last known token, accepted up to its first miss, the next
block drafted from the token after the bonus one. Every answer position's block comes from one
dense pass (the training code path, which a test holds equal to serving), and the drafts from the
drafter's own serving `draft`. On the shipped dflash this gives the H200's served figures (see
README.md). Answers are generated once (about 5 minutes on two cores) and kept in --answers.

    python bench-results/drafters/walk.py [--limit 164] [--answers FILE.npz] [--out DIR] \\
        [--spec dflash:7] [--spec dspark:7:threshold=0.25] [--spec dspark:7:threshold=0] ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file

from speckernel import registry
from speckernel.config import EngineConfig
from speckernel.models.checkpoint import read_config, resolve
from speckernel.models.loader import load_model
from speckernel.speculators.learned import WEIGHTS, trim
from speckernel.tools.datasets import humaneval_messages
from speckernel.tools.train.data import Sequences, TargetFeatures, generate


def parse_spec(text: str) -> tuple[str, int, dict[str, str]]:
    name, k, *opts = text.split(":")
    return name, int(k), dict(o.split("=", 1) for o in opts)


def shipped(method: str, target_cfg) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    cls = registry.load("speculator", method)
    cfg = cls.read_checkpoint(WEIGHTS / method, target_cfg)
    fields = {k: v for k, v in msgspec.structs.asdict(cfg).items() if k not in ("method", "target")}
    module = cls.new_drafter(target_cfg, 2048, **fields)
    module.load_state_dict({k: v.float() for k, v in load_file(str(WEIGHTS / method / "model.safetensors")).items()})
    return module.eval()


def cut(method: str, options: dict[str, str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The speculator's own `keep` (which drafts a row proposes), with these options (the
    defaults where not given); it reads nothing of the speculator but its options."""
    cls = registry.load("speculator", method)
    speculator = cls.__new__(cls)
    speculator.options = msgspec.convert({k: float(v) for k, v in options.items()}, cls.Options)
    return speculator.keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=None, help="METHOD:K[:OPTION=VALUE...] (repeatable)")
    ap.add_argument("--limit", type=int, default=164, help="HumanEval prompts")
    ap.add_argument("--answers", type=Path, default=Path(tempfile.gettempdir()) / "speckernel-he-greedy.npz",
                    help="the target's greedy answers (made when missing, kept for the next run)")
    ap.add_argument("--out", type=Path, default=None, help="folder for walk.json and walk.md")
    args = ap.parse_args()
    specs = [parse_spec(s) for s in (args.spec or ["dflash:7", "dspark:7", "dspark:7:threshold=0"])]
    torch.set_grad_enabled(False)
    if not args.answers.exists():
        config = EngineConfig(model="smollm2-135m", platform="cpu", max_num_seqs=64, max_model_len=2048,
                              log_level="warning").validate()
        generate(config, humaneval_messages()[: args.limit], 256, concurrency=64).save(args.answers)
    answers = Sequences.load(args.answers)
    path = resolve("smollm2-135m")
    target_cfg = read_config(path)
    target = load_model(path, torch.float32, torch.device("cpu"), 2048)
    drafters = {m: shipped(m, target_cfg) for m in dict.fromkeys(name for name, _, _ in specs)}
    features = TargetFeatures(target, tuple(sorted({layer for d in drafters.values()
                                                    for layer in d.config.target_layers})), ())
    keeps = [cut(method, options) for method, _, options in specs]
    lengths: list[list[int]] = [[] for _ in specs]
    for i in range(min(args.limit, len(answers))):
        seq, prompt_len = answers.get(i)
        tokens = torch.from_numpy(seq.astype(np.int64))[None]
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[0, max(prompt_len - 1, 0) : len(seq) - 1] = True
        batch = features.batch(tokens, mask)
        answer = int(mask.sum())  # every answer position is an anchor
        drafts: dict[str, tuple[torch.Tensor, ...]] = {}
        for method, module in drafters.items():
            full = torch.full((1, answer), module.config.block_size)
            blocks = module.train_blocks(batch, block_lens=full, num_anchors=answer)
            anchor = tokens[0, blocks.anchors[0]]
            drafts[method] = (*module.draft(blocks.hidden[0], anchor, batch.target), blocks.labels[0],
                              blocks.valid[0], blocks.anchors[0])
        for s, ((method, k, _), keep) in enumerate(zip(specs, keeps, strict=True)):
            ids, score, labels, valid, anchors = drafts[method]
            proposed = trim(ids[:, :k], keep(score[:, :k]))
            hit = ((proposed == labels[:, :k]) & valid[:, :k]).int().cumprod(dim=1).sum(dim=1).tolist()
            at = {int(a): j for j, a in enumerate(anchors.tolist())}
            a = prompt_len  # the first answer token comes from the prompt step
            while a in at:
                n = hit[at[a]]
                lengths[s].append(n)
                a += n + 1
        print(f"walked {i + 1} answers", file=sys.stderr, end="\r")
    rows = []
    for (method, k, options), accepted in zip(specs, lengths, strict=True):
        counts = np.bincount(accepted, minlength=k + 1)
        per_position = [float(counts[j:].sum() / len(accepted)) for j in range(1, k + 1)]
        rows.append({"spec": ":".join([method, str(k), *(f"{a}={b}" for a, b in options.items())]),
                     "acceptance_length": 1 + float(np.mean(accepted)), "steps": len(accepted),
                     "per_position": per_position})
    prompts = min(args.limit, len(answers))
    table = [f"# Walked acceptance on {prompts} HumanEval greedy answers (CPU, float32, temperature 0)", "",
             f"Command: `python bench-results/drafters/walk.py {' '.join(sys.argv[1:])}`", "",
             "| drafter | walked acceptance length | steps | per position |", "|---|---|---|---|"]
    table += [f"| {r['spec']} | {r['acceptance_length']:.2f} | {r['steps']} | "
              f"{' '.join(f'{x:.2f}' for x in r['per_position'])} |" for r in rows]
    print("\n" + "\n".join(table), file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "walk.json").write_text(json.dumps({"prompts": prompts, "rows": rows}, indent=1) + "\n")
        (args.out / "walk.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
