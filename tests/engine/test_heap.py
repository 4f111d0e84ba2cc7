"""The heap start-up built is frozen while a core serves, and thawed when the last one stops."""

from __future__ import annotations

import gc

from speckernel.engine.heap import frozen_while_serving
from speckernel.frontend.sync_engine import Engine
from speckernel.sampling_params import SamplingParams


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_a_full_collection_while_serving_walks_only_what_serving_made() -> None:
    kept = cycle()
    assert gc.get_freeze_count() == 0
    with frozen_while_serving():
        frozen = gc.get_freeze_count()
        assert frozen > 1000, "start-up's objects are out of the collector's view"
        assert len(gc.get_objects()) < frozen / 10
        late: list[object] = []  # made while serving: in the collector's view
        with frozen_while_serving():  # a second core in the process (data parallel, in-process)
            assert any(o is late for o in gc.get_objects()), "the second core froze the heap again"
        # Not an exact count: another thread (pytest-xdist's) may free a few frozen objects meanwhile.
        assert gc.get_freeze_count() > 0.99 * frozen, "thawed while the first core serves"
        del late
        del kept  # garbage now, but frozen: no collection frees it while serving
        assert not any(isinstance(o, Node) for o in gc.get_objects())
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert not any(isinstance(o, Node) for o in gc.get_objects()), "collected once thawed"


def test_an_in_process_core_freezes_the_heap_while_it_serves() -> None:
    with Engine(model="random:tiny", platform="cpu", dtype="float32", max_model_len=64, in_process=True) as engine:
        out = list(engine.stream([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        assert out and gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0
