"""The server's engine, kept alive: a core that dies is replaced, within bounds.

Without this a dead core leaves a zombie server, answering 503 forever. The supervisor owns the
AsyncEngine (entered and left in its one task): when the core dies, every pending request has
already failed with EngineDeadError; the supervisor waits a backoff (doubling per restart in the
window), starts a new engine and serves again. More than `max_restarts` restarts within
`window_s` (0: none at all) and it gives up: the server exits non-zero.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Annotated, Generic, Literal, Protocol, TypeVar

import anyio
import anyio.abc
import msgspec

from ... import log
from ...errors import EngineDeadError, SpeckernelError

logger = log.get("serve")
State = Literal["starting", "ok", "restarting", "failed"]
E = TypeVar("E", bound="Supervised")


class Supervised(Protocol):
    """What the supervisor needs of an engine (AsyncEngine; the app's factory makes one), so that
    the CLI reads RestartPolicy without importing the engine."""

    async def __aenter__(self: E) -> E: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def wait_dead(self) -> EngineDeadError: ...


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 5
    """Restarts allowed within `window_s`; one more death and the server exits (code 1)."""
    window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    """The wait before the first restart in the window; doubled for each further one."""
    max_backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0


class Supervisor(Generic[E]):
    def __init__(self, new_engine: Callable[[], E], policy: RestartPolicy, on_restart: Callable[[], None],
                 on_give_up: Callable[[str], None]) -> None:
        self.new_engine = new_engine
        self.policy = policy
        self.on_restart = on_restart
        self.on_give_up = on_give_up
        self.engine: E | None = None
        self.state: State = "starting"
        self.reason = "engine is starting"
        """Why there is no engine now (what a 503 says)."""
        self._restarts: deque[float] = deque()

    def live(self) -> E:
        if self.engine is None:
            raise EngineDeadError(self.reason)
        return self.engine

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Starts the engine (a failure of the first start is raised: the server does not start),
        reports started, then replaces it each time its core dies, until the policy gives up."""
        started = False
        while True:
            try:
                async with self.new_engine() as engine:
                    self.engine, self.state = engine, "ok"
                    if not started:
                        started = True
                        task_status.started()
                    else:
                        logger.info("engine_core_restarted", restarts=len(self._restarts))
                    try:
                        death = await engine.wait_dead()
                    finally:
                        self.engine = None
                    self.reason = f"{death}; restarting it"
                    logger.error("engine_core_died", error=str(death))
            except SpeckernelError as e:
                if not started:
                    raise
                self.reason = f"engine core failed to restart: {e}"
                logger.error("engine_core_restart_failed", error=str(e))
            if not self._may_restart():
                self.state = "failed"
                self.reason = self.reason.removesuffix("; restarting it") + \
                    f"; not restarted ({self.policy.max_restarts} restarts within {self.policy.window_s:g} s)"
                logger.error("engine_core_given_up", reason=self.reason)
                self.on_give_up(self.reason)
                return
            self.state = "restarting"
            delay = min(self.policy.backoff_s * 2 ** (len(self._restarts) - 1), self.policy.max_backoff_s)
            self.on_restart()
            await anyio.sleep(delay)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.policy.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.policy.max_restarts:
            return False
        self._restarts.append(now)
        return True
