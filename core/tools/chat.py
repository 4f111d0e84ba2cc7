"""`speckernel chat`: a conversation with the model at a prompt that edits like a shell's.

At a terminal the prompt is prompt_toolkit's (arrow keys, history with up and down); from a pipe,
lines are read as they come. Ctrl-C while a reply streams stops that reply and keeps the
conversation; Ctrl-C at the prompt, Ctrl-D or an empty line ends the chat. What is typed while a
reply streams is neither echoed nor taken as the next message. Commands: /clear, /system [TEXT],
/stats, /history, /help.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anyio
from prompt_toolkit import PromptSession
from prompt_toolkit.history import InMemoryHistory

from ..errors import InvalidInputError, PromptTooLongError
from ..frontend.async_engine import AsyncEngine
from ..outputs import RequestOutput
from ..progress import loading_what, waiting
from ..sampling_params import SamplingParams
from .engine_args import utf8

HELP = """commands:
  /clear          forget the conversation (the system prompt stays)
  /system [TEXT]  show the system prompt, or set it (the conversation starts again)
  /stats          tokens, tokens/s and draft acceptance of the last reply and of the whole chat
                  (a reply stopped with Ctrl-C counts, as far as it went)
  /history        the conversation so far
  /help           this list
Ctrl-C stops a reply; Ctrl-C at the prompt, Ctrl-D or an empty line ends the chat."""


class PipeLines:
    """Lines from a pipe or file, read in the event loop (no thread): Ctrl-C at an idle prompt
    ends the process at once, where a thread blocked in a read would hold its exit."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.pending = b""
        self.eof = False
        self.regular_file = stat.S_ISREG(os.fstat(self.fd).st_mode)  # never "not ready": no wait

    async def read(self, prompt: str) -> str | None:
        """The next line without its newline, None at the end of input."""
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self.pending and not self.eof:
            if not self.regular_file:
                await anyio.wait_readable(self.fd)
            chunk = os.read(self.fd, 1 << 16)
            self.eof = not chunk
            self.pending += chunk
        if not self.pending:
            return None
        line, _, self.pending = self.pending.partition(b"\n")
        return utf8(line.rstrip(b"\r"), "the message")


class TerminalLines:
    """prompt_toolkit's line editor; keys typed while a reply streamed are dropped first."""

    def __init__(self) -> None:
        self.session: PromptSession[str] = PromptSession(history=InMemoryHistory())

    async def read(self, prompt: str) -> str | None:
        with contextlib.suppress(termios.error):
            termios.tcflush(sys.stdin.fileno(), termios.TCIFLUSH)
        try:
            # Ctrl-C at the prompt is a key (raw mode); the chat keeps its own SIGINT receiver for replies.
            return await self.session.prompt_async(prompt, handle_sigint=False)
        except EOFError:
            return None
        except KeyboardInterrupt:
            raise ChatInterrupted from None


EXIT_INTERRUPTED = 130


class ChatInterrupted(Exception):
    """Ctrl-C at the prompt: the chat ends (exit code 130)."""


@contextlib.contextmanager
def quiet_keys(fd: int) -> Iterator[None]:
    """No echo while a reply streams, so keys typed then do not land inside the reply."""
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:  # not a terminal
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


@dataclass(frozen=True)
class Reply:
    """What /stats counts of one reply, finished or stopped with Ctrl-C."""

    tokens: int
    decode_s: float
    """From its first token to its last."""
    drafted: int = 0
    accepted: int = 0
    stopped: bool = False

    @classmethod
    def of(cls, out: RequestOutput | None, last_token_at: float | None) -> Reply:
        """The reply whose last output was `out` (None: stopped before its first token). A stopped
        reply has no finish time and no speculation counters (the core sends those with the final
        output alone), so its decode time runs to when its last token arrived."""
        if out is None:
            return cls(0, 0.0, stopped=True)
        t = out.timing
        end = last_token_at if out.finish_reason is None else (t.finished if t is not None else None)
        start = t.first_token if t is not None else None
        spec = out.stats or {}
        return cls(len(out.token_ids), 0.0 if start is None or end is None else max(0.0, end - start),
                   int(spec.get("num_draft_tokens", 0)), int(spec.get("num_accepted_tokens", 0)),
                   stopped=out.finish_reason is None)


@dataclass
class Tally:
    """Tokens, time and drafts of the replies so far, stopped ones included."""

    replies: int = 0
    stopped: int = 0
    tokens: int = 0
    timed_tokens: int = 0
    """Tokens after each reply's first: those its decode time covers."""
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    last: Reply | None = field(default=None, repr=False)

    def add(self, reply: Reply) -> None:
        self.last = reply
        self.replies += 1
        self.stopped += reply.stopped
        self.tokens += reply.tokens
        self.timed_tokens += max(0, reply.tokens - 1)
        self.decode_s += reply.decode_s
        self.drafted += reply.drafted
        self.accepted += reply.accepted


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 and tokens > 1 else "(too short to time)"


def acceptance(drafted: int, accepted: int) -> str:
    return f", {accepted}/{drafted} drafts accepted ({accepted / drafted:.0%})" if drafted else ""


def stats_lines(tally: Tally) -> list[str]:
    last = tally.last
    if last is None:
        return ["no reply yet"]
    return [
        f"last reply{' (stopped)' if last.stopped else ''}: {last.tokens} tokens, "
        f"{rate(last.tokens - 1, last.decode_s)}" + acceptance(last.drafted, last.accepted),
        f"this chat: {tally.replies} replies{f' ({tally.stopped} stopped)' if tally.stopped else ''}, "
        f"{tally.tokens} tokens, {rate(tally.timed_tokens, tally.decode_s)}"
        + acceptance(tally.drafted, tally.accepted),
    ]


def fit_history(messages: list[dict[str, str]], count: Callable[[list[dict[str, str]]], int], limit: int) -> int:
    """Drops the oldest turns (a system prompt stays) until count(messages) < limit; the number
    of messages dropped. The newest message always stays: if it alone is too long, the caller's
    count check raises."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while len(messages) - first > 1 and count(messages) >= limit:
        del messages[first]
        dropped += 1
        while len(messages) - first > 1 and messages[first]["role"] != "user":
            del messages[first]  # a turn starts with the user's message
            dropped += 1
    return dropped


class Chat:
    """One conversation: the history, the commands, and each reply streamed."""

    def __init__(self, engine: AsyncEngine, params: SamplingParams, system: str | None) -> None:
        self.engine = engine
        self.params = params
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.tally = Tally()
        self.streaming: anyio.CancelScope | None = None
        """The reply being streamed: Ctrl-C cancels it."""
        self.interrupted = False
        # Room kept for the reply: the history is trimmed to leave it.
        reserve = max(1, min(params.max_tokens, engine.info.max_model_len // 4))
        self.limit = engine.info.max_model_len - reserve

    def command(self, line: str) -> list[str]:
        """What a /command prints."""
        name, _, rest = line.partition(" ")
        if name == "/clear":
            del self.messages[1 if self.system is not None else 0 :]
            return ["the conversation is cleared"]
        if name == "/system":
            if not rest.strip():
                return [f"system prompt: {self.system!r}" if self.system is not None else "no system prompt"]
            self.messages[:] = [{"role": "system", "content": rest.strip()}]
            return ["system prompt set; the conversation starts again"]
        if name == "/stats":
            return stats_lines(self.tally)
        if name == "/history":
            return [f"{m['role']}: {m['content']}" for m in self.messages] or ["the conversation is empty"]
        if name == "/help":
            return HELP.splitlines()
        return [f"unknown command {name}; /help lists them"]

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    async def reply(self, line: str) -> None:
        self.messages.append({"role": "user", "content": line})
        dropped = fit_history(self.messages, lambda history: len(self.engine.encode_chat(history)), self.limit)
        if dropped:
            note(f"dropped the {dropped} oldest message(s) to fit the {self.engine.info.max_model_len}-token context")
        out: RequestOutput | None = None
        last_token_at: float | None = None
        try:
            with quiet_keys(sys.stdin.fileno()), anyio.CancelScope() as self.streaming:
                async for out in self.engine.chat(self.messages, self.params):
                    last_token_at = time.monotonic()
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
        except PromptTooLongError as e:
            self.messages.pop()
            print(f"speckernel: error: this message alone is too long: {e}", file=sys.stderr)
            return
        finally:
            self.streaming = None
        sys.stdout.write("\n")
        if out is None or out.finish_reason is None:
            note("reply stopped")
        self.messages.append({"role": "assistant", "content": out.text if out is not None else ""})
        self.tally.add(Reply.of(out, last_token_at))

    async def converse(self, lines: PipeLines | TerminalLines) -> int:
        """Reads and answers until the chat ends; the exit code."""
        note("/help lists the commands; an empty line or Ctrl-D ends the chat.")
        while True:
            try:
                line = await lines.read("> ")
            except InvalidInputError as e:
                print(f"speckernel: error: {e}", file=sys.stderr)
                continue
            except ChatInterrupted:
                return EXIT_INTERRUPTED
            if line is None or not line.strip():
                return 0
            if line.startswith("/"):
                for text in self.command(line.strip()):
                    note(text)
                continue
            await self.reply(line)

    async def watch_sigint(self, session: anyio.CancelScope) -> None:
        """Ctrl-C while a reply streams cancels that reply (its request is aborted); at the prompt
        it ends the chat. One receiver for the whole chat, so no Ctrl-C falls between two."""
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if self.streaming is not None:
                    self.streaming.cancel()
                else:
                    self.interrupted = True
                    session.cancel()


def note(text: str) -> None:
    print(f"speckernel chat: {text}", file=sys.stderr)


async def run(args: argparse.Namespace) -> int:
    lines: PipeLines | TerminalLines = TerminalLines() if sys.stdin.isatty() and sys.stdout.isatty() else PipeLines()
    async with contextlib.AsyncExitStack() as stack:
        with waiting(loading_what(args.config)):
            engine = await stack.enter_async_context(AsyncEngine(args.config))
        chat = Chat(engine, args.params, args.system)
        code = EXIT_INTERRUPTED
        async with anyio.create_task_group() as tg:
            tg.start_soon(chat.watch_sigint, tg.cancel_scope)
            code = await chat.converse(lines)
            tg.cancel_scope.cancel()
    return EXIT_INTERRUPTED if chat.interrupted else code
