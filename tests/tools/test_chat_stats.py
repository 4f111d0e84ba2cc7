"""`speckernel chat`'s /stats counts every reply: one stopped with Ctrl-C counts as far as it went
(its tokens, and its speed up to its last token), and says it was stopped."""

from __future__ import annotations

from speckernel.outputs import RequestOutput, Timing
from speckernel.tools.chat import Reply, Tally, stats_lines


def output(tokens: int, first_token: float, finished: float | None, finish_reason: str | None,
           stats: dict[str, int] | None = None) -> RequestOutput:
    """The last output a reply's stream gave: finished, or cut short (no finish time, no counters)."""
    ids = list(range(tokens))
    return RequestOutput(request_id="r", delta_text="", delta_token_ids=[], text="x" * tokens, token_ids=ids,
                         prompt_token_ids=[1], finished=finish_reason is not None, finish_reason=finish_reason,
                         timing=Timing(arrival=0.0, first_token=first_token, finished=finished), stats=stats)


def test_a_stopped_reply_counts_up_to_its_last_token() -> None:
    tally = Tally()
    tally.add(Reply.of(output(41, first_token=1.0, finished=None, finish_reason=None), last_token_at=5.0))
    assert stats_lines(tally) == ["last reply (stopped): 41 tokens, 10.0 tok/s",
                                  "this chat: 1 replies (1 stopped), 41 tokens, 10.0 tok/s"]


def test_the_chat_adds_finished_and_stopped_replies() -> None:
    tally = Tally()
    finished = output(21, first_token=0.5, finished=2.5, finish_reason="stop",
                      stats={"num_draft_tokens": 8, "num_accepted_tokens": 6})
    tally.add(Reply.of(finished, last_token_at=2.6))  # a finished reply's own finish time counts
    tally.add(Reply.of(output(11, first_token=1.0, finished=None, finish_reason=None), last_token_at=3.0))
    assert stats_lines(tally) == ["last reply (stopped): 11 tokens, 5.0 tok/s",
                                  "this chat: 2 replies (1 stopped), 32 tokens, 7.5 tok/s, "
                                  "6/8 drafts accepted (75%)"]


def test_a_reply_stopped_before_its_first_token_counts_as_a_reply() -> None:
    tally = Tally()
    tally.add(Reply.of(output(5, first_token=0.0, finished=1.0, finish_reason="length"), last_token_at=1.0))
    tally.add(Reply.of(None, last_token_at=None))
    assert stats_lines(tally) == ["last reply (stopped): 0 tokens, (too short to time)",
                                  "this chat: 2 replies (1 stopped), 5 tokens, 4.0 tok/s"]


def test_no_reply_yet() -> None:
    assert stats_lines(Tally()) == ["no reply yet"]
