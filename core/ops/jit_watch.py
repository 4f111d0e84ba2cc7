"""Counts Triton kernel variants built while the engine serves.

Triton builds a kernel the first time it is launched with a new specialization (constexprs,
dtypes, integer and alignment classes): up to a second of host time, all of it a stall for every
request in flight. The engine builds every variant a request can need at start; this watch
(Triton's post-compile hook) counts and logs any that is built after `seal()`, so a gap in the
warm-up shows in the stats and the log instead of as an unexplained slow step."""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

from .. import log as logmod

log = logmod.get("jit")


class JitWatch:
    def __init__(self) -> None:
        self.num_compiles = 0
        self.num_after_seal = 0
        self.sealed = False
        self._lock = threading.Lock()
        self._chained: Any = None

    def install(self) -> bool:
        """Hooks Triton's compiler (once per process); False where Triton has no such hook."""
        if importlib.util.find_spec("triton") is None:
            return False
        from triton import knobs  # triton is optional (Linux x86-64)

        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        if runtime.jit_post_compile_hook != self._hook:  # a bound method is a new object each time: ==
            self._chained = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self._hook
        return True

    def seal(self) -> None:
        """Warm-up is over: every build from now on is one too many."""
        self.sealed = True

    def _hook(self, **kwargs: Any) -> Any:
        with self._lock:
            self.num_compiles += 1
            if self.sealed:
                self.num_after_seal += 1
                fn = kwargs.get("fn")
                log.warning("kernel_built_while_serving", kernel=getattr(fn, "name", "?"),
                            variant=str(kwargs.get("repr", ""))[:300])
        return self._chained(**kwargs) if self._chained is not None else None


WATCH = JitWatch()
"""One per process: Triton's hook is process-wide."""
