"""Penalties: the batched device math against a per-row reference, counts from the token buffer,
counts per draft position, verification under penalties, validation, and rows without penalties
left exactly as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speckernel.errors import InvalidSamplingParamsError
from speckernel.runner.penalties import TokenCounts, apply_penalties, count_history
from speckernel.runner.sampler import SamplingTensors, sample_on_device
from speckernel.runner.verify import verify
from speckernel.sampling_params import RowSampling, SamplingParams

V = 40


def reference(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
              pres: float) -> list[float]:
    """One row, token by token, as vLLM's documentation states the rules."""
    out = []
    for v, x in enumerate(logits):
        if v in prompt or v in output:
            x = x / rep if x > 0 else x * rep
        x -= freq * output.count(v)
        x -= pres * (v in output)
        out.append(x)
    return out


def random_histories(rows: int, width: int, seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    rng = np.random.default_rng(seed)
    tokens = torch.full((rows + 1, width), -1, dtype=torch.int64)
    prompt_lens, lengths = [], []
    for r in range(rows):
        n = int(rng.integers(1, width - 2))
        p = int(rng.integers(1, n + 1))
        tokens[r, :n] = torch.from_numpy(rng.integers(0, V, n))
        tokens[r, n:] = torch.from_numpy(rng.integers(-1, V, width - n))  # stale drafts past the history
        prompt_lens.append(p)
        lengths.append(n)
    return tokens, prompt_lens, lengths


def test_penalties_match_the_per_row_reference() -> None:
    rows, width = 9, 30
    tokens, prompt_lens, lengths = random_histories(rows, width, seed=0)
    slots = torch.randperm(rows)  # rows read their slots in any order
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, V, generator=g) * 3
    rep = torch.tensor([1.0, 1.3, 0.7, 1.0, 1.0, 2.0, 1.1, 1.0, 0.5])
    freq = torch.tensor([0.0, 0.0, 0.0, 0.8, -0.4, 0.5, 2.0, 0.0, -2.0])
    pres = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.5, 0.6, 2.0])
    p_len = torch.tensor([prompt_lens[s] for s in slots])
    length = torch.tensor([lengths[s] for s in slots])
    counts = count_history(tokens, slots, p_len, length, V)
    got = apply_penalties(logits, counts, rep, freq, pres)
    for r, s in enumerate(slots.tolist()):
        history = tokens[s, : lengths[s]].tolist()
        want = reference(logits[r].tolist(), history[: prompt_lens[s]], history[prompt_lens[s]:],
                         float(rep[r]), float(freq[r]), float(pres[r]))
        torch.testing.assert_close(got[r], torch.tensor(want), rtol=1e-6, atol=1e-5)
    assert torch.equal(got[0], logits[0])  # no penalty: bit for bit the logits


def test_each_draft_position_counts_the_drafts_before_it() -> None:
    tokens, prompt_lens, lengths = random_histories(4, 20, seed=2)
    slots = torch.arange(4)
    counts = count_history(tokens, slots, torch.tensor(prompt_lens), torch.tensor(lengths), V)
    drafts = torch.tensor([[3, 3, 7], [5, -1, -1], [-1, -1, -1], [1, 2, 1]])
    cols = counts.with_drafts(drafts)
    for r in range(4):
        output = tokens[r, prompt_lens[r] : lengths[r]].tolist()
        for j in range(4):
            seen = output + [t for t in drafts[r, :j].tolist() if t >= 0]
            want = torch.tensor([float(seen.count(v)) for v in range(V)])
            assert torch.equal(cols.output[r * 4 + j], want), (r, j)
            assert torch.equal(cols.prompt[r * 4 + j], counts.prompt[r])


def rows_with(n: int, temperature: float, **penalties: float) -> list[RowSampling]:
    return [RowSampling(temperature, 0, 1.0, seed=11 + i, position=5, **penalties) for i in range(n)]


def grammar_bitmask(rows: int, positions: int, seed: int) -> torch.Tensor:
    """[rows, positions, W] int32: a random half of the vocabulary allowed at each position (token
    7 always, so the penalty is what moves it), in the grammar engines' bit layout."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, positions, V)) < 0.5
    allowed[..., 7] = True
    words = np.zeros((rows, positions, (V + 31) // 32), np.uint32)
    for v in range(V):
        words[..., v // 32] |= allowed[..., v].astype(np.uint32) << np.uint32(v % 32)
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verification_under_penalties_emits_what_plain_sampling_emits(temperature: float, masked: bool) -> None:
    """Drafts that are plain decoding's own tokens are all accepted, position by position under
    the counts their predecessors left; the tokens equal plain sampling's, one step at a time.
    With a structured-output grammar's bitmask too, the two compose the same way in both."""
    g = torch.Generator().manual_seed(3)
    rows, k = 3, 4
    logits = torch.randn(rows, k + 1, V, generator=g)
    logits[:, :, 7] += 4.0  # a token every position likes: only the penalty moves it
    bitmask = grammar_bitmask(rows, k + 1, seed=5) if masked else None
    hist = torch.full((rows + 1, 16), -1, dtype=torch.int64)
    hist[:rows, :6] = torch.tensor([1, 2, 3, 7, 7, 9])
    params = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    samples = [RowSampling(temperature, 0, 1.0, seed=21 + r, position=2, **params) for r in range(rows)]
    st = SamplingTensors.from_rows(samples, "cpu")
    slots, length = torch.arange(rows), torch.full((rows,), 6)
    prompt_len = length - st.position
    # Plain decoding, one token at a time, each written back into the history.
    plain = []
    for j in range(k + 1):
        counts = count_history(hist, slots, prompt_len, length + j, V)
        step = [RowSampling(temperature, 0, 1.0, seed=21 + r, position=2 + j, **params) for r in range(rows)]
        tok = sample_on_device(logits[:, j], SamplingTensors.from_rows(step, "cpu"), counts=counts,
                               bitmask=None if bitmask is None else bitmask[:, j])
        hist[slots, 6 + j] = tok
        plain.append(tok)
    plain_t = torch.stack(plain, 1)
    counts = count_history(hist, slots, prompt_len, length, V)
    out, nacc = verify(logits, plain_t[:, :k], st, counts=counts, bitmask=bitmask)
    assert nacc.tolist() == [k] * rows
    assert torch.equal(out, plain_t)
    if bitmask is not None:
        allowed = ((bitmask[..., None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(-2)[..., :V]
        assert allowed.gather(-1, out[..., None]).all(), "a token the grammar forbids was emitted"


def test_rows_without_penalties_need_no_counts_and_keep_their_tokens() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=g)
    plain = rows_with(6, 0.9)
    st = SamplingTensors.from_rows(plain, "cpu")
    assert not st.any_penalty
    tokens = sample_on_device(logits, st)  # no counts given, none needed
    # The same rows in a batch that counts (a penalized row elsewhere) sample the same tokens.
    mixed = SamplingTensors.from_rows([*plain, *rows_with(1, 0.9, presence_penalty=1.0)], "cpu")
    assert mixed.any_penalty
    counts = TokenCounts(torch.ones(7, V), torch.ones(7, V, dtype=torch.bool))
    assert torch.equal(sample_on_device(torch.cat([logits, logits[:1]]), mixed, counts=counts)[:6], tokens)
    with pytest.raises(ValueError, match="counts"):
        sample_on_device(logits[:1], SamplingTensors.from_rows(rows_with(1, 0.9, frequency_penalty=0.1), "cpu"))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("repetition_penalty", 0.0, r"repetition_penalty: expected a number in \[0.01, 100.0\], got 0.0"),
    ("repetition_penalty", -1.0, r"repetition_penalty: expected a number in \[0.01, 100.0\]"),
    ("frequency_penalty", 2.5, r"frequency_penalty: expected a number in \[-2.0, 2.0\], got 2.5"),
    ("presence_penalty", -3, r"presence_penalty: expected a number in \[-2.0, 2.0\], got -3"),
    ("presence_penalty", True, r"presence_penalty: expected a number .*, got True"),
    ("frequency_penalty", float("nan"), r"frequency_penalty: expected a number"),
])
def test_penalties_are_validated_with_a_message_naming_them(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]


def test_penalized_flags_any_penalty() -> None:
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.2).penalized
    assert SamplingParams(frequency_penalty=-0.5).penalized
    assert SamplingParams(presence_penalty=0.1).validate().penalized
