"""`speckernel chat` at a real terminal (a pty, through pexpect) on the real default model: the line
edits with the arrow keys, Ctrl-C stops a reply and keeps the conversation, a line typed while a
reply streams is not taken as the next message, /clear forgets the conversation, Ctrl-D ends it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pexpect
import pytest

pytestmark = pytest.mark.slow

LEFT = "\x1b[D"
PROMPT = "\x1b[?2004h"
"""prompt_toolkit turns bracketed paste on each time it shows the prompt (the "> " itself is
drawn with cursor moves)."""


def spawn_chat(max_tokens: int) -> pexpect.spawn:
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "speckernel", "chat", "--platform", "cpu", "--max-model-len", "512",
                                           "--max-tokens", str(max_tokens), "--temperature", "0"],
                          env=env, encoding="utf-8", timeout=180, dimensions=(40, 200))
    child.expect("/help lists the commands")
    return child


@pytest.fixture
def chat() -> Iterator[pexpect.spawn]:
    child = spawn_chat(400)
    yield child
    child.close(force=True)


def at_prompt(child: pexpect.spawn) -> None:
    """Waits for the prompt: what is typed before it shows is dropped, by design."""
    child.expect_exact(PROMPT)


def say(child: pexpect.spawn, line: str) -> None:
    at_prompt(child)
    child.send(line + "\r")


def test_a_terminal_chat_edits_stops_a_reply_and_keeps_the_conversation(chat: pexpect.spawn) -> None:
    at_prompt(chat)
    chat.send("Tell me a long stoy")
    chat.send(LEFT)
    chat.send("r\r")  # the arrow key moved the cursor: "stoy" became "story"
    chat.expect("story")  # the edited line, as the prompt shows it on Enter
    chat.expect(r"\n[^>\n]*\w+ \w+ \w+ \w+")  # the reply streams
    chat.sendintr()  # Ctrl-C: stops the reply, not the chat
    chat.expect("reply stopped")
    say(chat, "/history")
    chat.expect("user: Tell me a long story")
    chat.expect("assistant: ")
    say(chat, "/stats")
    chat.expect(r"last reply \(stopped\): [1-9]\d* tokens, ")  # a stopped reply counts, as far as it went
    chat.expect(r"this chat: 1 replies \(1 stopped\), [1-9]\d* tokens")
    assert chat.isalive()
    say(chat, "/clear")
    chat.expect("the conversation is cleared")
    say(chat, "/history")
    chat.expect("the conversation is empty")
    at_prompt(chat)
    chat.sendeof()  # Ctrl-D at the prompt ends the chat, with exit code 0
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_a_line_typed_while_a_reply_streams_is_not_the_next_message() -> None:
    child = spawn_chat(24)
    try:
        say(child, "Name three colors.")
        child.send("typed during the reply\r")  # Enter included: a second message, were it read
        child.expect("Name three colors")
        say(child, "/history")  # the prompt after the reply, not one for the typed line
        child.expect("assistant: ")
        at_prompt(child)
        assert "typed during the reply" not in child.before
        child.send("/stats\r")
        child.expect(r"last reply: \d+ tokens")
        child.expect("this chat: 1 replies")
    finally:
        child.close(force=True)
