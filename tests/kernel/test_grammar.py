"""The grammar state of a structured-output request on the built-in model's tokenizer: drafts cut
to their valid prefix with one bitmask row per verified position, rejected drafts rolled back,
the cache and the compile thread."""

from __future__ import annotations

import numpy as np
import pytest

from speckernel.errors import InvalidSamplingParamsError
from speckernel.kernel.grammars import Grammars
from speckernel.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    return Grammars(tokenizer.tok.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)


def allowed(mask: bytes, vocab_size: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer.encode(text, add_special_tokens=False)


def test_drafts_are_cut_to_the_valid_prefix_and_rolled_back(grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    g = grammars.matcher(grammars.compile(StructuredOutput(regex="[0-9]+ apples")))
    v, words = tokenizer.vocab_size, (tokenizer.vocab_size + 31) // 32
    good, bad = ids(tokenizer, "12"), ids(tokenizer, "x")
    kept, masks = g.plan(good + bad + good)
    assert kept == good
    assert len(masks) == 4 * words * (len(good) + 1)  # K+1 rows: one per verified position
    rows = [allowed(masks[4 * words * j : 4 * words * (j + 1)], v) for j in range(len(good) + 1)]
    assert good[0] in rows[0] and bad[0] not in rows[0]
    assert ids(tokenizer, " apples")[0] in rows[-1] and ids(tokenizer, " apples")[0] not in rows[0]
    # The step rejected every draft and sampled "7": the drafts leave the matcher.
    output = ids(tokenizer, "7")
    g.sync(output)
    assert g.matcher.try_consume_tokens(ids(tokenizer, " apples")) == len(ids(tokenizer, " apples"))
    assert g.matcher.is_accepting()


def test_a_stale_row_leaves_nothing_behind(grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    g = grammars.matcher(grammars.compile(StructuredOutput(choice=("yes", "no"))))
    kept, _ = g.plan(ids(tokenizer, "yes"))
    assert kept == ids(tokenizer, "yes")
    g.sync([])  # the row was dropped (preempted): nothing confirmed
    assert g.matcher.try_consume_tokens(ids(tokenizer, "no")) == len(ids(tokenizer, "no"))


def test_compiled_grammars_are_cached(grammars) -> None:  # type: ignore[no-untyped-def]
    s = StructuredOutput(json_object=True)
    first = grammars.compile(s)
    assert grammars.compile(StructuredOutput(json_object=True)) is first
    a, b = grammars.matcher(first), grammars.matcher(first)
    assert a.matcher is not b.matcher  # each request advances its own copy


@pytest.mark.parametrize("bad", [StructuredOutput(regex="[a-"), StructuredOutput(json_schema='{"type": "nope"}'),
                                 StructuredOutput(json_schema="{"), StructuredOutput(grammar="start: missing"),
                                 StructuredOutput(), StructuredOutput(regex="a", choice=("a",))])
def test_a_grammar_that_does_not_compile_is_refused_by_validate(bad: StructuredOutput) -> None:
    with pytest.raises(InvalidSamplingParamsError, match="structured"):
        SamplingParams(structured=bad).validate()


def test_validate_marks_the_request_for_host_drafts() -> None:
    assert SamplingParams(structured=StructuredOutput(regex="a+")).validate().structured_output


def serial_masks(g, drafts: list[int]) -> bytes:  # type: ignore[no-untyped-def]
    """The masks one position at a time, by consuming each draft: what `fill_masks` must equal."""
    masks = [g.matcher.compute_bitmask()[: 4 * g.words]]
    for token in drafts:
        assert g.matcher.consume_token(token)
        masks.append(g.matcher.compute_bitmask()[: 4 * g.words])
    g.matcher.rollback(len(drafts))
    return b"".join(masks)


def test_one_call_fills_every_rows_masks_as_one_at_a_time_would(grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from speckernel.kernel.grammar import fill_masks

    apples = grammars.matcher(grammars.compile(StructuredOutput(regex="[0-9]+ apples")))
    choice = grammars.matcher(grammars.compile(StructuredOutput(choice=("yes", "no"))))
    schema = grammars.matcher(grammars.compile(StructuredOutput(json_object=True)))
    rows = [(apples, apples.valid(ids(tokenizer, "12 app"))), (choice, []),
            (schema, schema.valid(ids(tokenizer, '{"a')))]
    assert rows[0][1] and rows[2][1]  # drafts to mask after, and a row without
    want = [serial_masks(g, d) for g, d in rows]
    assert fill_masks(rows) == want
    assert [len(m) for m in want] == [4 * g.words * (len(d) + 1) for g, d in rows]
    assert apples.matcher.try_consume_tokens(ids(tokenizer, "7 apples")) == len(ids(tokenizer, "7 apples"))  # unmoved


def test_forced_tokens_lead_a_rows_drafts_and_the_speculators_fill_the_rest(grammars, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The grammar's forced tokens take the positions they force; the speculator's drafts at those
    positions are dropped (they guess what is known), its later drafts follow, so both kinds count."""
    from speckernel.kernel.block_manager import BlockManager
    from speckernel.kernel.request import Request
    from speckernel.kernel.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100, grammar_drafts=4)
    params = SamplingParams(max_tokens=32, structured=StructuredOutput(regex="The answer is: [0-9]+"))
    req = Request(1, ids(tokenizer, "Say it."), params, 0, (), 10_000)
    req.attach_grammar(grammars.matcher(grammars.compile(params.structured)))  # type: ignore[arg-type]
    sched.add(req)
    assert sched.schedule() is not None
    req.in_flight -= 1  # the prompt step landed and sampled "The", as the ledger would apply it
    req.num_placeholders -= 1
    req.output_token_ids.append(ids(tokenizer, "The")[0])
    req.grammar.sync(req.output_token_ids)  # type: ignore[union-attr]
    forced = req.grammar.forced(4)  # type: ignore[union-attr]
    digits = ids(tokenizer, "The answer is: 12")[len(forced) + 1 :]
    assert len(forced) == 4 and digits, (forced, digits)
    wrong = ids(tokenizer, "no idea at all")[: len(forced)]
    req.draft_token_ids = wrong + digits  # the speculator's guesses for the same positions, then more
    frame = sched.schedule()
    assert frame is not None
    (row,) = frame.rows
    assert row.num_forced == len(forced)
    assert row.draft_token_ids == forced + digits
