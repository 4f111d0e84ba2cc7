"""N engine-core ranks behind one frontend (`--data-parallel-size N`).

Each rank is an ordinary core client (in process or its own process) with its rank and the
ranks' meeting port in its config; the cores agree among themselves every step
(`engine.data_parallel`). Here a request goes to the rank with the fewest requests in flight,
an abort to the rank that holds the request, a utility call to rank 0, Shutdown to all; the
ranks' messages merge into one stream. A rank that is gone ends the stream, so every pending
request fails as for a single core.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from ..config import EngineConfig
from ..wire.messages import AbortRequests, AddRequest, CoreMessage, CoreOutputs, CoreReady, FrontendMessage, Shutdown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DataParallelClient:
    """A CoreClient (by its methods) over one client per rank, made by `make` (the frontend's
    in-process or process client)."""

    def __init__(self, config: EngineConfig, make: Callable[[EngineConfig], Any]) -> None:
        port = config.data_parallel_port or free_port()
        self.ranks: list[Any] = [
            make(msgspec.structs.replace(config, data_parallel_rank=r, data_parallel_port=port))
            for r in range(config.data_parallel_size)]
        self.owner: dict[int, int] = {}
        """Request key -> the rank that serves it, while it runs."""
        self.load = [0] * len(self.ranks)
        self.tx, self.rx = anyio.create_memory_object_stream[CoreMessage | None](math.inf)

    async def start(self, tg: TaskGroup) -> CoreReady:
        readies: list[CoreReady | None] = [None] * len(self.ranks)

        async def start_one(r: int) -> None:
            readies[r] = await self.ranks[r].start(tg)

        async with anyio.create_task_group() as starting:  # the ranks meet while they start
            for r in range(len(self.ranks)):
                starting.start_soon(start_one, r)
        for r in range(len(self.ranks)):
            tg.start_soon(self._pump, r)
        first = readies[0]
        assert first is not None
        return first

    async def _pump(self, r: int) -> None:
        while (msg := await self.ranks[r].recv()) is not None:
            if isinstance(msg, CoreOutputs):
                for d in msg.deltas:
                    if d.finish_reason is not None and self.owner.pop(d.key, None) is not None:
                        self.load[r] -= 1
            await self.tx.send(msg)
        await self.tx.send(None)  # one rank gone: the engine is

    def send(self, msg: FrontendMessage) -> None:
        match msg:
            case AddRequest(key=key):
                r = min(range(len(self.ranks)), key=lambda i: (self.load[i], i))
                self.owner[key] = r
                self.load[r] += 1
                self.ranks[r].send(msg)
            case AbortRequests(keys=keys):
                by_rank: dict[int, list[int]] = {}
                for key in keys:
                    if key in self.owner:
                        by_rank.setdefault(self.owner[key], []).append(key)
                for r, ks in by_rank.items():
                    self.ranks[r].send(AbortRequests(ks))
            case Shutdown():
                for rank in self.ranks:
                    rank.send(msg)
            case _:
                self.ranks[0].send(msg)

    async def recv(self) -> CoreMessage | None:
        try:
            return await self.rx.receive()
        except anyio.EndOfStream:
            return None

    async def close(self) -> None:
        for rank in self.ranks:
            await rank.close()

    def release(self) -> None:
        for rank in self.ranks:
            rank.release()

    def death_reason(self) -> str:
        return "; ".join(f"rank {r}: {c.death_reason()}" for r, c in enumerate(self.ranks))
