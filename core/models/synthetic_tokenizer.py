"""A tokenizer for random-weight models (`random:PRESET`), which ship none: token N is spelled
`<N>`, so text and ids map one to one. With it the frontend (AsyncEngine, `speckernel serve`)
runs these models like any other, e.g. for load tests that need no real weights."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from speckernel.models.synthetic import random_config
from speckernel.models.tokenizer import Tokenizer


def synthetic_tokenizer(name: str | Path) -> Tokenizer:
    """`<N>` for every id of the model's vocabulary; any other text encodes as id 0. No BOS,
    no EOS and no chat template (messages are joined), as the random presets have none."""
    vocab = {f"<{i}>": i for i in range(random_config(name).vocab_size)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\d+>"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return Tokenizer(tok, chat_template=None, bos_token_id=None, eos_token_ids=(), add_bos=False)
