"""Tokenizer and chat template built from the GGUF, against HF transformers' own GGUF reading."""

from __future__ import annotations

import pytest

from tests.conftest import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(__name__)]  # one worker builds the module's fixtures


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


TEXTS = [p for p in PROMPTS if not any(c.isdigit() for c in p)] + [
    "  leading spaces and\ttabs\n\nnew lines",
    "Ünïcödé — “quotes” and emoji 🙂",
    "<|im_start|>user\nhello<|im_end|>",
]


def test_encode_decode_match_hf(tokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ours = tokenizer.encode(text)
        assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_split_one_by_one_as_the_smollm_pre_tokenizer_does(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("12345")
    assert len(ids) == 5 and tokenizer.decode(ids) == "12345"


def test_special_tokens_and_eos(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.decode([2]) == ""  # skipped as a special token


def test_chat_template_matches_hf(tokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == ref
        assert ours.endswith("<|im_start|>assistant\n")


def test_token_bytes_spell_the_text_byte_for_byte(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """What logprobs report as a token's `bytes`: laid end to end they are the text's UTF-8, even
    where a token holds part of a character."""
    text = "naïve café — 東京タワー 🚀 über, ok?\n\tdone"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(not p.decode("utf-8", errors="ignore") for p in pieces if p), "no token splits a character"
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.token_bytes(eos) == tokenizer.decode([eos], skip_special_tokens=False).encode()
