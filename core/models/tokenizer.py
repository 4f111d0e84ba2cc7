"""Tokenizer (`tokenizers`) and chat template (Jinja2), read from a model folder (a GGUF file's
conversion is one; gguf.py builds it).

Chat content never becomes control tokens: `encode_chat` encodes the template's own text with
its special tokens, and each message's content as text, so a user who writes "<|im_end|>" gets
the characters, not the id that ends a turn. `allow_special_tokens=True` (trusted callers:
`EngineConfig.allow_special_tokens`, `--allow-special-tokens`) encodes the whole rendered text
as before, where content may spell control tokens.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import msgspec
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import InvalidInputError, UnknownModelError

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
RELEASE_GIL_CHARS = 4096
"""Texts longer than this are encoded through `encode_batch`, which releases the GIL while it runs
(`encode` holds it), so other threads and the caller's event loop keep going meanwhile."""
class ChatTurn(msgspec.Struct):
    """What the chat template reads of a message (other keys pass through to it untouched)."""

    role: Annotated[str, msgspec.Meta(min_length=1)]
    content: str


def check_messages(messages: object) -> None:
    """InvalidInputError naming the first message field a template could not render (a None or
    list content would render as 'None' or fail deep inside Jinja)."""
    if not isinstance(messages, list | tuple):
        raise InvalidInputError(f"messages: expected a list of {{'role': str, 'content': str}}, got {messages!r}")
    try:
        msgspec.convert(messages, list[ChatTurn], strict=True)
    except msgspec.ValidationError as e:
        message, _, where = str(e).partition(" - at `$")
        raise InvalidInputError(f"messages{where.rstrip('`')}: {message[:1].lower()}{message[1:]}") from None


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self._template: Template | None = None
        self._special: re.Pattern[str] | None = None
        self._as_text: HFTokenizer | None = None
        self._alone: dict[int, str] = {}
        """Each token's text decoded on its own, as `decode_alone` found it (at most the vocabulary)."""

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tok.id_to_token(token_id) or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raw prompts get the model's BOS; chat-templated text carries its own specials."""
        if len(text) > RELEASE_GIL_CHARS:
            ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_alone(self, token_id: int) -> str:
        """`decode([token_id])`, remembered: an incremental detokenizer decodes the token before
        each new one on its own, for every token of every stream."""
        text = self._alone.get(token_id)
        if text is None:
            text = self._alone[token_id] = self.tok.decode([token_id], skip_special_tokens=True)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        check_messages(messages)
        if not self.chat_template:
            # Without a template the conversation is joined plainly, so raw base models still work.
            return "\n".join(m["content"] for m in messages)
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token(self.bos_token_id),
                eos_token=self.token(self.eos_token_ids[0] if self.eos_token_ids else None),
            )
        except TemplateError as e:
            raise InvalidInputError(f"chat template rejected the conversation: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    allow_special_tokens: bool = False) -> list[int]:
        """The templated conversation's ids. Special-token text inside a message's content is
        encoded as text unless `allow_special_tokens`; a conversation without any encodes exactly
        as its rendered text does."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        spelled = [] if allow_special_tokens else [
            i for i, m in enumerate(messages)
            if isinstance(m.get("content"), str) and self.spells_special(m["content"])]
        if not spelled:
            return self.encode(text, add_special_tokens=False)
        # Render again with a marker per such content, then encode the template's pieces with
        # their specials and each content as text.
        nonce = secrets.token_hex(8)
        marked = [dict(m, content=f"\ue000{nonce}:{i}\ue001") if i in spelled else m for i, m in enumerate(messages)]
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", self.apply_chat_template(marked, add_generation_prompt))
        found = [int(i) for i in pieces[1::2]]
        if sorted(found) != spelled:
            raise InvalidInputError(f"messages[{spelled[0]}].content: spells a special token, and the chat template "
                                    "does not place the content as it is; remove the special-token text")
        template = self.tok.encode_batch(pieces[0::2], add_special_tokens=False)
        contents = self._text_tokenizer().encode_batch([messages[i]["content"] for i in found],
                                                       add_special_tokens=False)
        ids: list[int] = []
        for j, part in enumerate(template):
            ids += part.ids
            if j < len(contents):
                ids += contents[j].ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a character): byte-level BPE
        pieces mapped back through GPT-2's byte alphabet, other pieces as UTF-8 ('▁' a space)."""
        piece = self.token(token_id)
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode("utf-8")

    def spells_special(self, text: str) -> bool:
        """Whether text holds the text of a special token (a control token such as <|im_end|>)."""
        if self._special is None:
            specials = sorted((t.content for t in self.tok.get_added_tokens_decoder().values() if t.special),
                              key=len, reverse=True)
            self._special = re.compile("|".join(map(re.escape, specials)) or r"(?!)")
        return self._special.search(text) is not None

    def _text_tokenizer(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as plain text."""
        if self._as_text is None:
            tok = HFTokenizer.from_str(self.tok.to_str())
            tok.encode_special_tokens = True
            self._as_text = tok
        return self._as_text

    # --- construction ----------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """Writes tokenizer.json and the HF-style configs that `from_folder` reads back."""
        self.tok.save(str(folder / "tokenizer.json"))
        cfg = {"chat_template": self.chat_template, "add_bos_token": self.add_bos,
               "bos_token": self.tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.eos_token_ids)}))

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        if not (folder / "tokenizer.json").exists():
            raise UnknownModelError(f"{folder}: no tokenizer.json")
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        eos = gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if not eos_ids and token_id("eos_token") is not None:
            eos_ids = (token_id("eos_token"),)
        bos = token_id("bos_token")
        return cls(tok, template, model_cfg.get("bos_token_id") if bos is None else bos, eos_ids,
                   bool(cfg.get("add_bos_token", False)))

    @classmethod
    def numbered(cls, vocab_size: int) -> Tokenizer:
        """`<N>` for every id below vocab_size; any other text encodes as id 0. No BOS, no EOS and
        no chat template (messages are joined): for random-weight models, which ship none."""
        tok = HFTokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\d+>"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return cls(tok, chat_template=None, bos_token_id=None, eos_token_ids=(), add_bos=False)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character each byte is spelled with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = kept + [256 + n for n in range(256 - len(kept))]
    return {chr(c): b for c, b in zip(spelled, kept + [b for b in range(256) if b not in kept], strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
