"""AsyncEngine: the embedder's handle, living in the caller's event loop.

    async with AsyncEngine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.delta_text, end="")

Each request gets its own stream of deltas. Leaving the iteration early or cancelling the
caller aborts the request in the core, which frees its KV blocks at once.

The core knows a request only by an integer key, fresh for every generate() call; the caller's
request id stays here (and in logs). Deltas and aborts travel by key, so a caller that reuses
the id of a request it just left can never receive that earlier request's late deltas.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectSendStream

from .. import errors
from ..config import EngineConfig
from ..engine.check import check
from ..models.checkpoint import load_tokenizer
from ..models.tokenizer import Tokenizer
from ..outputs import RequestOutput, Timing, TokenLogprobs
from ..sampling_params import SamplingParams, check_text, prompt_token_ids, sampling_params
from ..wire.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    RequestDelta,
    UtilityCall,
    UtilityResult,
)
from .client import CoreClient, InprocClient, ProcessClient
from .detokenizer import IncrementalDetokenizer
from .dp_client import DataParallelClient

OFF_LOOP_CHARS = 4096
"""Prompts longer than this are tokenized (and chat templates rendered) in a worker thread, so a
multi-MB prompt never stalls the event loop and every other stream on it."""


def error_from_wire(text: str) -> errors.SpeckernelError:
    """'PromptTooLongError: ...' from the core → the same typed exception here; any other error
    of a running request ('IndexError: ...') → EngineRequestError with that text."""
    name, _, message = text.partition(": ")
    return errors.rebuild(name, message) or errors.EngineRequestError(text)


@dataclass
class _Pending:
    request_id: str
    send: MemoryObjectSendStream[RequestDelta | BaseException]


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig()
        if overrides:
            config = msgspec.structs.replace(config, **overrides)
        self.config = config.validate()
        self.tokenizer: Tokenizer
        self.info: CoreReady
        self._client: CoreClient | None = None
        self._stack = AsyncExitStack()
        self._keys = itertools.count()
        self._requests: dict[int, _Pending] = {}
        """Live requests by key; a delta whose key is not here belongs to a request that is over."""
        self._live_ids: dict[str, int] = {}
        """The caller's request id -> key, while that request is live (ids are unique among them)."""
        self._calls: dict[int, tuple[anyio.Event, list[UtilityResult]]] = {}
        self._call_ids = itertools.count()
        self._dead: errors.EngineDeadError | None = None
        self._died = anyio.Event()
        self._tokenizing = anyio.CapacityLimiter(2)
        """Big prompts tokenized at once (each holds a thread of anyio's pool while it runs)."""

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        # Everything knowable without weights fails here, before a process is spawned; a thread,
        # since a built-in model may be fetched.
        path = (await anyio.to_thread.run_sync(check, self.config)).path
        client = self._make_client()
        # Unwinds in reverse: stop the pump, wait for the task group, then free the sockets.
        self._stack.callback(client.release)
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.push_async_callback(self._stop_pump, tg)
        try:
            # The tokenizer loads in a thread while the core starts (a process importing torch
            # and loading weights): start-up pays for the longer of the two, not their sum.
            loader = ThreadPoolExecutor(1, thread_name_prefix="speckernel-tokenizer")
            tokenizer = loader.submit(load_tokenizer, path)
            loader.shutdown(wait=False)
            self.info = await client.start(tg)
            self.tokenizer = await anyio.to_thread.run_sync(tokenizer.result)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await client.close()
            await self._stack.aclose()
            raise
        self._client = client
        tg.start_soon(self._pump, client)
        return self

    def _make_client(self) -> CoreClient:
        """The client of the engine core: in this process or another, one core or a group of ranks."""
        kind = InprocClient if self.config.in_process else ProcessClient
        return kind(self.config) if self.config.data_parallel_size == 1 \
            else DataParallelClient(self.config, kind)  # type: ignore[return-value]

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.close()
            await self._stack.aclose()  # task groups must exit in their own scope, not a shield
        self._fail_all(errors.EngineDeadError("engine shut down"))

    async def _stop_pump(self, tg: anyio.abc.TaskGroup) -> None:
        tg.cancel_scope.cancel()

    # --- receiving -----------------------------------------------------------------------------

    async def _pump(self, client: CoreClient) -> None:
        while True:
            msg = await client.recv()
            match msg:
                case CoreOutputs(deltas=deltas):
                    for delta in deltas:
                        pending = self._requests.get(delta.key)
                        if pending is not None:
                            pending.send.send_nowait(delta)
                case UtilityResult(call_id=cid):
                    waiter = self._calls.pop(cid, None)
                    if waiter is not None:
                        waiter[1].append(msg)
                        waiter[0].set()
                case CoreFailed(error_type=kind, message=message):
                    self._fail_all(errors.EngineDeadError(f"engine core failed: {kind}: {message}"))
                    return
                case None:
                    self._fail_all(errors.EngineDeadError(f"engine core died: {client.death_reason()}"))
                    return

    async def wait_dead(self) -> errors.EngineDeadError:
        """Returns once the core is gone (died, failed or shut down), with the error that says why;
        every pending request has failed with it by then."""
        await self._died.wait()
        assert self._dead is not None
        return self._dead

    def _fail_all(self, error: errors.EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            self._died.set()
        for pending in self._requests.values():
            pending.send.send_nowait(error)
        for event, _ in self._calls.values():
            event.set()

    def _live_client(self) -> CoreClient:
        if self._dead is not None:
            raise errors.EngineDeadError(str(self._dead))
        if self._client is None:
            raise errors.EngineDeadError("engine is not started (use `async with AsyncEngine(...)`)")
        return self._client

    # --- requests ------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The templated conversation's ids; control-token text in message content stays text
        unless the config allows special tokens (`EngineConfig.allow_special_tokens`). An empty
        conversation is refused: the template would render a prompt of its own making."""
        if isinstance(messages, list | tuple) and not messages:
            raise errors.InvalidInputError("messages: expected at least one message")
        return self.tokenizer.encode_chat(messages, allow_special_tokens=self.config.allow_special_tokens)

    async def tokenize(self, prompt: str) -> list[int]:
        """`tokenizer.encode(prompt)`, in a worker thread when the prompt is long."""
        check_text(prompt, "prompt")
        if len(prompt) <= OFF_LOOP_CHARS:
            return self.tokenizer.encode(prompt)
        return await anyio.to_thread.run_sync(self.tokenizer.encode, prompt, limiter=self._tokenizing)

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """`encode_chat(messages)`, in a worker thread when the conversation is long."""
        size = 0
        for i, m in enumerate(messages if isinstance(messages, list | tuple) else ()):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                check_text(content, f"messages[{i}].content")
                size += len(content)
        if size <= OFF_LOOP_CHARS:
            return self.encode_chat(messages)
        return await anyio.to_thread.run_sync(self.encode_chat, messages, limiter=self._tokenizing)

    async def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        async for out in self.generate(await self.tokenize_chat(messages), params, request_id=request_id):
            yield out

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams one RequestOutput per delta; a str prompt is tokenized as-is (no template)."""
        client = self._live_client()
        # Everything the core could not take fails here, typed, before anything is sent.
        params = sampling_params(params, self.info.vocab_size, pipeline=self.config.pipeline_parallel_size > 1)
        prompt_ids = await self.tokenize(prompt) if isinstance(prompt, str) \
            else prompt_token_ids(prompt, self.info.vocab_size)
        if not prompt_ids:
            raise errors.InvalidInputError("prompt is empty")
        if len(prompt_ids) >= self.info.max_model_len:
            raise errors.PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.info.max_model_len} "
                "(prompt plus at least one generated token)")
        if request_id is not None and not isinstance(request_id, str):
            raise errors.InvalidInputError(f"request_id: expected a str, got {request_id!r}")
        req_id = request_id or uuid.uuid4().hex
        if req_id in self._live_ids:
            raise errors.InvalidInputError(f"request id {req_id!r} is already running")
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        logprobs: list[TokenLogprobs] = []
        """Every token's logprobs so far; each output carries those of its delta_token_ids."""
        released = 0
        timing = Timing(arrival=time.monotonic())
        key = next(self._keys)
        send, recv = anyio.create_memory_object_stream[RequestDelta | BaseException](math.inf)
        self._requests[key] = _Pending(req_id, send)
        self._live_ids[req_id] = key
        try:
            client.send(AddRequest(key, np.asarray(prompt_ids, dtype=np.int64), params, req_id))
            async for item in recv:
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    self._forget(key)  # the core is done with it: nothing to abort
                    raise error_from_wire(item.error)
                now = time.monotonic()
                if timing.first_token is None and item.new_token_ids:
                    timing.first_token = now
                if item.logprobs is not None:
                    logprobs.extend(item.logprobs)
                step = detok.add(item.new_token_ids, item.finish_reason)
                if item.finish_reason is not None:
                    self._forget(key)
                elif step.stopped:
                    self._abort_key(key)  # before yielding: the caller may not ask for more soon
                if step.finish_reason is not None:
                    timing.finished = now
                yield RequestOutput(
                    request_id=req_id, delta_text=step.text, delta_token_ids=step.token_ids,
                    text=detok.text, token_ids=detok.token_ids, prompt_token_ids=prompt_ids,
                    finished=step.finish_reason is not None, finish_reason=step.finish_reason,
                    timing=timing, stats=item.stats,
                    logprobs=None if params.logprobs is None else logprobs[released : released + len(step.token_ids)],
                )
                released += len(step.token_ids)
                if step.finish_reason is not None:
                    return
        finally:
            # Still live here means the caller left early: the core stops it and frees its blocks.
            self._abort_key(key)
            send.close()
            recv.close()

    def _forget(self, key: int) -> _Pending | None:
        """Drops a request from the routing tables; later deltas for its key are ignored."""
        pending = self._requests.pop(key, None)
        if pending is not None and self._live_ids.get(pending.request_id) == key:
            del self._live_ids[pending.request_id]
        return pending

    def _send(self, msg: AbortRequests | UtilityCall) -> None:
        """Sends to the core; a core found gone fails every pending request and call at once."""
        try:
            self._live_client().send(msg)
        except errors.EngineDeadError as e:
            self._fail_all(e)
            raise

    def _abort_key(self, key: int) -> _Pending | None:
        """Forgets a live request and tells the core to stop it (if the core is still there)."""
        pending = self._forget(key)
        if pending is not None and self._dead is None and self._client is not None:
            try:
                self._send(AbortRequests([key]))
            except errors.EngineDeadError:  # nothing left to stop; the caller's own error stands
                pass
        return pending

    async def abort(self, request_id: str) -> None:
        """Stops a live request: its stream ends with a final output, finish_reason "abort".

        Ids of requests that are not live (unknown, finished, or already aborted) are ignored;
        EngineDeadError when the core is gone (the stream then ends with that error).
        """
        self._live_client()
        key = self._live_ids.get(request_id)
        if key is None:
            return
        pending = self._forget(key)
        assert pending is not None
        try:
            self._send(AbortRequests([key]))
        except errors.EngineDeadError as e:
            pending.send.send_nowait(e)
            raise
        # Deltas the core sent before it saw the abort are already queued ahead of this one.
        pending.send.send_nowait(RequestDelta(key, [], "abort"))

    async def stats(self) -> dict[str, Any]:
        """Engine-wide counters from the core (steps, tokens, KV blocks, speculative counters)."""
        self._live_client()
        call_id = next(self._call_ids)
        event, box = anyio.Event(), list[UtilityResult]()
        self._calls[call_id] = (event, box)
        try:
            self._send(UtilityCall(call_id, "stats"))
        except errors.EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        await event.wait()
        if not box:
            raise errors.EngineDeadError(str(self._dead))
        if box[0].error is not None:
            raise errors.SpeckernelError(box[0].error)
        return box[0].result
