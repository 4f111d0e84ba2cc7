"""The held-out general-chat set stays held out: no request of it is in the training corpus,
none is code, and `bench accept --dataset chat` reads it."""

from __future__ import annotations

import re

from speckernel.tools.cli import build_parser
from speckernel.tools.datasets import humaneval_prompts
from speckernel.tools.general_chat import GENERAL_CHAT, general_chat_messages
from speckernel.tools.train.corpus import INSTRUCTIONS

COMMON = set("a an and are as at be by do does for from give how i in is it its me my of on or some that the "
             "their them they this to was what when which who why will with write you your".split())


def content(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower())) - COMMON


def same_request(a: str, b: str) -> bool:
    """Most of their content words shared: the same request in other words."""
    x, y = content(a), content(b)
    return len(x & y) >= 0.5 * len(x | y)


def test_no_held_out_request_is_in_the_training_corpus() -> None:
    assert len(GENERAL_CHAT) == len(set(GENERAL_CHAT)) == 64
    assert not [(t, c) for t in GENERAL_CHAT for c in INSTRUCTIONS if same_request(t, c)]
    stubs = " ".join(humaneval_prompts())
    assert not [t for t in GENERAL_CHAT if "def " in t or "```" in t or t in stubs]


def test_bench_accept_reads_the_chat_set() -> None:
    args = build_parser().parse_args(["bench", "accept", "--dataset", "chat"])
    assert args.dataset == "chat"
    assert general_chat_messages()[0] == [{"role": "user", "content": GENERAL_CHAT[0]}]
