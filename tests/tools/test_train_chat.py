"""The general-chat training corpus: plausible everyday requests, each a different request from
the others and from the held-out general-chat set, written by the project's frames or by the
target itself at a user turn; the same for a seed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from speckernel.config import EngineConfig
from speckernel.errors import InvalidInputError
from speckernel.models.tokenizer import Tokenizer
from speckernel.tools.general_chat import GENERAL_CHAT, same_request
from speckernel.tools.train import chat
from speckernel.tools.train.corpus import read_corpus

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def distinct(requests: list[str]) -> bool:
    return not [(a, b) for i, a in enumerate(requests) for b in requests[i + 1 :] if same_request(a, b)]


def held_out_free(requests: list[str]) -> bool:
    return not [(a, b) for a in requests for b in GENERAL_CHAT if same_request(a, b)]


@pytest.mark.parametrize("text", [
    "Write a polite email to my landlord about the broken boiler.",
    "What should I pack for a week in Iceland in March?",
    "Can you give me three ideas for a cheap date night? I'm on a budget.",
    "Summarize the story of the three little pigs in two sentences.",
])
def test_everyday_requests_are_plausible(text: str) -> None:
    assert chat.implausible(text) is None


@pytest.mark.parametrize("text,reason", [
    ("Hi.", "length"),
    ("Good morning, friend!", "words"),
    ("Write a Python function that reverses a list.", "code"),
    ("Fix this, it does not work: ```x = [1, 2]```", "code"),
    ("What does {x: 1} mean in this config?", "code"),
    ("Explain the algorithm behind page rank in detail.", "code"),
    ("%%%% ### @@@ ^^^^ what is this thing here ~~~ ^^^", "not text"),
    ("Hello! How can I help you today?", "role marker"),
    ("user: tell me a joke about the weather", "role marker"),
    ("tell me tell me tell me tell me tell me tell me tell me", "repeats"),
])
def test_what_is_not_a_plausible_request_is_refused(text: str, reason: str) -> None:
    assert chat.implausible(text) == reason


def test_a_held_out_request_or_a_repeat_is_refused() -> None:
    kept = chat.DistinctRequests()
    assert not kept.admit("Please explain to me why cats purr.")  # GENERAL_CHAT: "Why do cats purr?"
    assert kept.admit("Why do dogs wag their tails when they are happy?")
    assert not kept.admit("Explain why dogs wag their tails when happy.")
    assert not kept.admit("Write a Python script to rename files.")
    assert kept.left_out == {"held out": 1, "duplicate": 1, "code": 1}


def test_written_requests_are_plausible_distinct_and_seeded() -> None:
    requests = chat.written_requests(150, random.Random(0), chat.DistinctRequests())
    assert len(requests) == 150 and len(set(requests)) == 150
    assert all(chat.implausible(r) is None for r in requests)
    assert distinct(requests) and held_out_free(requests)
    assert chat.written_requests(150, random.Random(0), chat.DistinctRequests()) == requests
    assert chat.written_requests(150, random.Random(1), chat.DistinctRequests()) != requests


def test_every_frame_and_filler_makes_a_plausible_request() -> None:
    """Each frame with each of its slots' fillers in turn (the others at their first) passes
    the filter the target's requests pass: the frames hold no code and no markup."""
    for frame in chat.FRAMES:
        names = [name for name in chat.SLOTS if f"{{{name}}}" in frame]
        for name in names:
            for filler in chat.SLOTS[name]:
                text = frame.format(**{n: chat.SLOTS[n][0] for n in names} | {name: filler})
                assert chat.implausible(text) is None, text


def test_the_user_header_is_the_template_up_to_a_users_message() -> None:
    tok = HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    assert chat.user_header(Tokenizer(tok, CHATML, None, (), False)) == "<|im_start|>user\n"
    with pytest.raises(InvalidInputError, match="no chat template"):
        chat.user_header(Tokenizer(tok, None, None, (), False))


def test_written_only_corpus_needs_no_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.jsonl.gz"
    assert chat.main(["--out", str(out), "--count", "40", "--written-share", "1", "--seed", "3"]) == 0
    conversations = read_corpus(out)
    requests = [c[0]["content"] for c in conversations]
    assert len(conversations) == 40 and all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
    assert distinct(requests) and held_out_free(requests)
    assert "wrote 40 requests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat.main(["--out", str(out), "--count", "4", "--written-share", "2"])


def test_a_target_without_a_chat_template_is_refused() -> None:
    # In this process: the refusal comes once the engine is up, and a process to start adds nothing.
    config = EngineConfig(model="random:tiny", platform="cpu", max_model_len=256, max_num_seqs=4, in_process=True)
    with pytest.raises(InvalidInputError, match="no chat template"):
        chat.build_chat_corpus(4, written_share=0.0, config=config)


@pytest.mark.slow
def test_the_target_writes_requests_at_a_user_turn() -> None:
    """The real default model, sampled at its user turn on the CPU: what it writes and keeps
    passes the filters, is new, and comes out the same for the same seed."""
    # The engine core in this process: the same engine steps, without a process per build to start
    # and import torch in.
    config = EngineConfig(model="smollm2-135m", platform="cpu", max_model_len=512, max_num_seqs=32, in_process=True)

    def build(seed: int) -> tuple[list[str], dict[str, object]]:
        conversations, stats = chat.build_chat_corpus(6, seed, 0.5, config=config, max_tokens=48, concurrency=32)
        return [c[0]["content"] for c in conversations], stats

    requests, stats = build(0)
    assert stats["written"] == 3 and 0 < stats["by_target"] <= 3 and stats["sampled"] >= 32  # type: ignore[operator]
    assert len(requests) == 3 + stats["by_target"]  # type: ignore[operator]
    assert all(chat.implausible(r) is None for r in requests) and distinct(requests) and held_out_free(requests)
    assert build(0) == (requests, stats)
