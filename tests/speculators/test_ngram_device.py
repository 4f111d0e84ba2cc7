"""The in-step ngram speculator: its propose matches the host reference `lookup` row by
row, reads only DeviceStates, and never synchronises with the device."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from speckernel.plugin import DeviceStates, drafting_kind
from speckernel.speculators.ngram import NgramOptions, NgramSpeculator, lookup

POISON = 99  # a token the histories below never use


def make_states(histories, samples, width, tails=None, spare=2, device="cpu"):
    """DeviceStates of a step. Row r's history sits at a scrambled slot of a buffer with `spare`
    extra rows; what follows it in the buffer is tails[r] (then POISON), never read. A row
    whose history is None is a padding row: slot on a spare row, seq_len 0, does not sample."""
    rows = len(histories)
    slots = list(reversed(range(spare, rows + spare)))  # row r -> slot rows + spare - 1 - r
    buf = torch.full((rows + spare, width), POISON, dtype=torch.int64)
    buf[:spare] = 7  # spare rows: garbage
    lens = []
    for r, h in enumerate(histories):
        if h is None:
            slots[r] = r % spare
            lens.append(0)
            continue
        row = list(h) + list(tails[r] if tails else [])
        buf[slots[r], : min(len(row), width)] = torch.tensor(row[:width], dtype=torch.int64)
        lens.append(len(h))
    samples = [s and h is not None for s, h in zip(samples, histories, strict=True)]
    return DeviceStates(
        tokens=buf.to(device), slot_index=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.zeros(0, dtype=torch.int64, device=device),
        accepted=torch.zeros(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        samples=torch.tensor(samples, dtype=torch.bool, device=device), hidden={})


def speculator(max_n=4, min_n=1, device="cpu"):
    ctx = SimpleNamespace(device=torch.device(device), options=NgramOptions(prompt_lookup_max=max_n,
                                                                            prompt_lookup_min=min_n))
    return NgramSpeculator(ctx)  # its __init__ reads only ctx.device and ctx.options


def expected(histories, samples, k, max_n, min_n):
    out = []
    for h, s in zip(histories, samples, strict=True):
        found = lookup(np.array(h, dtype=np.int64), k, max_n, min_n) if s and h is not None else []
        out.append(found + [-1] * (k - len(found)))
    return out


def check(histories, samples, k, max_n=4, min_n=1, width=None, tails=None):
    width = width or max(len(h) for h in histories if h is not None) + 3
    states = make_states(histories, samples, width, tails)
    drafts = speculator(max_n, min_n).propose(states, k).token_ids
    assert drafts.dtype == torch.int64 and drafts.shape == (len(histories), k)
    assert drafts.tolist() == expected(histories, samples, k, max_n, min_n)
    return drafts.tolist()


def test_capabilities():
    caps = NgramSpeculator.capabilities
    assert drafting_kind(NgramSpeculator) == "in_step"
    assert caps.draft_width == "variable" and caps.supports_k0 and caps.max_k == 16


def test_known_answers():
    rows = [
        [1, 2, 3, 1, 2, 4, 1, 2],  # latest [1, 2] at 3: drafts 4 1 2, cut by the end
        [5, 6, 7],  # no match of any length
        [3],  # length 1: nothing to look up
        [3, 3],  # length 2: [3] matches at 0
        [1, 2, 9, 1, 2, 8, 2],  # [8, 2] absent, [2] latest at 4 -> 8 2
    ]
    got = check(rows, [True] * 5, k=4)
    assert got == [[4, 1, 2, -1], [-1] * 4, [-1] * 4, [3, -1, -1, -1], [8, 2, -1, -1]]


def test_longest_suffix_wins_over_a_later_shorter_match():
    # [4, 5] matches at 0 (-> 6); the later [5] at 4 (-> 0) is shorter and loses.
    h = [4, 5, 6, 1, 5, 0, 4, 5]
    assert check([h], [True], k=2) == [[6, 1]]
    assert check([h], [True], k=2, max_n=1) == [[0, 4]]
    assert check([h], [True], k=2, min_n=3) == [[-1, -1]]  # no match of 3 or more


def test_rows_that_do_not_sample_and_padding_rows():
    h = [1, 2, 1, 2, 1, 2]
    got = check([h, h, None, h], [True, False, False, True], k=3)
    assert got[0] == got[3] == [1, 2, -1] and got[1] == got[2] == [-1, -1, -1]


def test_tokens_past_seq_len_are_ignored():
    # Were the window allowed to reach past the history (or onto its last token), the tail
    # [7, 8, 8, 8] would match the suffix [7] and draft 8s; the drafts would also run on
    # into the tail if the end of the history did not cut them.
    assert check([[5, 6, 7]], [True], k=4, tails=[[7, 8, 8, 8]], width=7) == [[-1] * 4]
    got = check([[1, 2, 3, 1, 2]], [True], k=8, tails=[[1, 2, 3, 1, 2, 3, 4]], width=16)
    assert got == [[3, 1, 2, -1, -1, -1, -1, -1]]
    # The latest match right before the end: a single draft.
    assert check([[9, 4, 4]], [True], k=5, tails=[[4, 4, 4]], width=6) == [[4, -1, -1, -1, -1]]


def test_history_filling_the_buffer_and_max_n_beyond_width():
    h = [2, 1, 2, 1, 2, 1]
    for max_n in (1, 4, 6, 50):
        check([h, [1, 1]], [True, True], k=3, max_n=max_n, width=len(h))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_matches_lookup(data):
    vocab = data.draw(st.integers(1, 4), label="vocab")
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24)
    histories = data.draw(st.lists(st.one_of(tokens, st.none()), min_size=1, max_size=6), label="histories")
    if all(h is None for h in histories):
        histories[0] = [0]
    samples = data.draw(st.lists(st.booleans(), min_size=len(histories), max_size=len(histories)), label="samples")
    min_n = data.draw(st.integers(1, 4), label="min_n")
    max_n = data.draw(st.integers(min_n, 7), label="max_n")
    k = data.draw(st.integers(1, 8), label="k")
    # Tails from the same vocabulary: tokens past seq_len that would often match if read.
    tails = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=8), label="tail") for _ in histories]
    width = max(len(h) for h in histories if h is not None) + data.draw(st.integers(0, 8), label="extra")
    check(histories, samples, k, max_n, min_n, width, tails)


def test_shapes_only_on_the_meta_device():
    """On the meta device a tensor has no data: .item(), .tolist(), .cpu(), bool(tensor),
    nonzero and boolean-mask indexing all raise, so propose running there shows it uses none."""
    states = make_states([[1, 2, 1, 2], None, [3]], [True, False, True], width=8, device="meta")
    drafts = speculator(device="meta").propose(states, 5).token_ids
    assert drafts.device.type == "meta" and drafts.shape == (3, 5) and drafts.dtype == torch.int64


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (2, 2)])
def test_no_host_sync_or_data_dependent_shapes(max_n, min_n):
    states = make_states([[1, 2, 1, 2, 3, 1, 2], None, [4, 4]], [True, False, True], width=10)
    with _Ops() as ops:
        drafts = speculator(max_n, min_n).propose(states, 4).token_ids
    assert ops.names and not ops.names & {"_local_scalar_dense", "nonzero", "masked_select", "unique",
                                          "_unique2", "masked_scatter"}
    assert drafts.tolist() == expected([[1, 2, 1, 2, 3, 1, 2], None, [4, 4]], [True, False, True], 4, max_n, min_n)


def test_sync_does_nothing():
    states = make_states([[1, 2]], [True], width=4)
    assert speculator().sync(states) is None
