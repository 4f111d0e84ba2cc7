"""The held-out general-chat set stays held out: no request of it is in the training corpus,
none is code, and `bench accept --dataset chat` reads it."""

from __future__ import annotations

from speckernel.tools.cli import build_parser
from speckernel.tools.datasets import humaneval_prompts
from speckernel.tools.general_chat import GENERAL_CHAT, general_chat_messages, same_request
from speckernel.tools.train.corpus import INSTRUCTIONS


def test_no_held_out_request_is_in_the_training_corpus() -> None:
    assert len(GENERAL_CHAT) == len(set(GENERAL_CHAT)) == 64
    assert not [(t, c) for t in GENERAL_CHAT for c in INSTRUCTIONS if same_request(t, c)]
    stubs = " ".join(humaneval_prompts())
    assert not [t for t in GENERAL_CHAT if "def " in t or "```" in t or t in stubs]


def test_bench_accept_reads_the_chat_set() -> None:
    args = build_parser().parse_args(["bench", "accept", "--dataset", "chat"])
    assert args.dataset == "chat"
    assert general_chat_messages()[0] == [{"role": "user", "content": GENERAL_CHAT[0]}]


def test_a_request_in_other_words_is_the_same_request() -> None:
    assert same_request("Why do cats purr?", "Explain why cats purr.")
    assert same_request("Write a haiku about the sea.", "Write me a haiku about the sea at night.")
    assert not same_request("Why do cats purr?", "Why do dogs bark at night?")
