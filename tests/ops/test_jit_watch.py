"""The kernel-build watch chains itself into Triton's post-compile hook once per watch, however
often engines in one process install it (a second chain recursed on the first build)."""

from __future__ import annotations

import pytest

from speckernel.ops.jit_watch import JitWatch


def test_installing_twice_counts_each_build_once() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_post_compile_hook
    watch = JitWatch()
    try:
        if not watch.install():
            pytest.skip("this Triton has no post-compile hook")
        assert watch.install()
        knobs.runtime.jit_post_compile_hook(fn=None, repr="a variant")
        watch.seal()
        knobs.runtime.jit_post_compile_hook(fn=None, repr="another")
        assert (watch.num_compiles, watch.num_after_seal) == (2, 1)
    finally:
        knobs.runtime.jit_post_compile_hook = before
