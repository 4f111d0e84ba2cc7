"""The ASGI app of `speckernel serve`: OpenAI-compatible endpoints over one AsyncEngine.

The engine lives in the server's event loop (started and stopped by the app's lifespan), so a
request is a coroutine streaming the engine's deltas; nothing crosses a thread. A client that
disconnects cancels its handler, which leaves `engine.generate(...)` and so aborts the request in
the core (its KV blocks are freed at once). Errors come back in OpenAI's JSON shape: bad input
400, a missing or wrong API key 401, a dead engine core 503. Once the server begins to shut down,
open streams end with an error event and `[DONE]`, and requests still waiting answer 503. Every
request is one key-value line on the access logger (method, path, status, duration).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ... import log
from ...config import EngineConfig
from ...errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    InvalidInputError,
    InvalidSamplingParamsError,
    SpeckernelError,
)
from ...frontend.async_engine import AsyncEngine
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams
from .access import AccessLog
from .limits import (
    Admission,
    BodyTimeout,
    BodyTooLarge,
    ServeLimits,
    check_prompt_chars,
    check_prompt_tokens,
    check_stop,
    read_body,
)
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import (
    AssistantMessage,
    BadRequest,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    ModelNotFound,
    R,
    TextChoice,
    Usage,
    decode,
    new_id,
    param_of,
)
from .supervisor import RestartPolicy, Supervisor

logger = log.get("serve")
HEALTH_TIMEOUT_S = 10.0
T = TypeVar("T")


class Unauthorized(Exception):
    pass


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


class ShuttingDown(Exception):
    """The server began to shut down before this request's answer was ready."""


SHUTTING_DOWN = "server is shutting down; the request was stopped"


def json_response(body: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None) -> Response:
    return json_response(ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code)), status)


def sse(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]],
                              closing: anyio.Event | None = None) -> T:
    """Runs `work`, cancelling it the moment the client disconnects (then raises ClientLeft) or
    the server begins to shut down (then ShuttingDown)."""
    box: list[T] = []
    failure: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await until_disconnect(receive)
            tg.cancel_scope.cancel()

        async def watch_closing(event: anyio.Event) -> None:
            await event.wait()
            failure.append(ShuttingDown(SHUTTING_DOWN))
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        if closing is not None:
            tg.start_soon(watch_closing, closing)
        try:
            box.append(await work())
        except Exception as e:  # re-raised below, outside the task group (no exception group)
            failure.append(e)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not box:
        raise ClientLeft
    return box[0]


class EventStream(StreamingResponse):
    """Server-sent events that stop the moment the client disconnects, whatever the ASGI
    version: the body iterator is cancelled then, not at the next write. When the server begins
    to shut down, the stream is cut between two events and ended with an error event and
    `[DONE]`, so the client knows its answer is incomplete."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 closing: anyio.Event | None = None) -> None:
        super().__init__(content)
        self.on_close = on_close
        """Runs once the stream is over, however it ended (even if it never started)."""
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = ended = left = False

        async def tracked(message: Any) -> None:
            nonlocal started, ended
            await send(message)
            started = started or message["type"] == "http.response.start"
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(tracked)
                    except OSError:  # the client left while a chunk was being written
                        pass
                    tg.cancel_scope.cancel()

                async def cut_on_closing(closing: anyio.Event) -> None:
                    await closing.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                if self.closing is not None:
                    tg.start_soon(cut_on_closing, self.closing)
                await until_disconnect(receive)
                left = True
                tg.cancel_scope.cancel()
            if self.closing is not None and self.closing.is_set() and not (ended or left):
                if not started:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                error = ErrorBody(message=SHUTTING_DOWN, type="service_unavailable", code="server_shutting_down")
                await send({"type": "http.response.body", "body": sse(ErrorResponse(error=error)) + DONE,
                            "more_body": False})
        except OSError:  # the client left meanwhile
            pass
        finally:
            self.on_close()


class Server:
    public_metrics = False
    """`/metrics` answers without the API key (`--public-metrics`); by default it needs the key when
    one is set, since the counters tell a stranger how much the server serves and what."""

    def __init__(self, config: EngineConfig, api_key: str | None = None, limits: ServeLimits | None = None,
                 restarts: RestartPolicy | None = None, on_give_up: Callable[[str], None] | None = None,
                 ignore_unknown_fields: bool = False) -> None:
        self.config = config
        self.ignore_unknown_fields = ignore_unknown_fields
        """A request key no request type has is ignored instead of refused (400): for clients that
        send extras (`--ignore-unknown-fields`)."""
        self.api_key = api_key
        self.limits = limits or ServeLimits()
        self.admission = Admission(self.limits)
        self.model_name = config.model
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self.on_give_up = on_give_up
        """Called once the supervisor stops replacing dead cores (the command exits non-zero)."""
        self.supervisor: Supervisor[AsyncEngine] = Supervisor(lambda: AsyncEngine(config), restarts or RestartPolicy(),
                                     self.metrics.restarts.inc, self._gave_up)
        self.closing: anyio.Event | None = None
        """Set once the server begins to shut down (made in the lifespan: an event needs the loop)."""
        self.open_streams = 0

    @property
    def engine(self) -> AsyncEngine:
        return self.supervisor.live()

    def _gave_up(self, reason: str) -> None:
        if self.on_give_up is not None:
            self.on_give_up(reason)

    def announce(self, url: str, started_s: float) -> None:
        """The ready line: where it listens and what it serves."""
        info = self.engine.info
        logger.info("ready", url=url, model=self.model_name, platform=info.platform, dtype=info.dtype,
                    max_model_len=info.max_model_len, speculator=self.config.speculator,
                    started_s=round(started_s, 2))

    def begin_shutdown(self, cause: str | None = None) -> None:
        """Ends every open stream (an error event, then `[DONE]`) and fails every request still
        waiting for its answer (503), instead of leaving them to be cut when the grace runs out.
        cause: the signal that stopped the server, if one did."""
        reason = cause or ("engine core lost" if self.supervisor.state == "failed" else "stopped")
        logger.info("shutting_down", reason=reason, open_streams=self.open_streams,
                    in_flight=self.admission.in_flight)
        if self.closing is not None:
            self.closing.set()

    def _stream_closed(self) -> None:
        self.open_streams -= 1
        self.admission.leave()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.closing = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(self.supervisor.run)
            info = self.engine.info
            logger.debug("engine_up", model=self.model_name, platform=info.platform,
                         max_model_len=info.max_model_len, speculator=self.config.speculator)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ]
        handlers: dict[Any, Any] = {
            InvalidInputError: self._bad_request,
            ModelNotFound: self._model_not_found,
            HTTPException: self._http_error,
            SpeckernelError: self._server_error,
            Exception: self._server_error,
            BodyTooLarge: self._too_large,
            BodyTimeout: self._body_timeout,
            EngineOverloadedError: self._overloaded,
            EngineDeadError: self._engine_dead,
            EngineRequestError: self._request_failed,
            Unauthorized: self._unauthorized,
            ClientLeft: self._client_left,
            ShuttingDown: self._shutting_down,
        }
        return Starlette(routes=routes, lifespan=self.lifespan, exception_handlers=handlers,
                         middleware=[Middleware(AccessLog)])

    # --- errors ------------------------------------------------------------------------------

    async def _bad_request(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("invalid").inc()
        param = exc.param if isinstance(exc, BadRequest) else param_of(str(exc))
        code = exc.code if isinstance(exc, BadRequest) else None
        return error_response(400, str(exc), "invalid_request_error", param, code)

    async def _model_not_found(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("invalid").inc()
        return error_response(404, str(exc), "invalid_request_error", "model", "model_not_found")

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Unknown routes (404) and methods (405) in the same JSON shape as every other error."""
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return Response(msgspec.json.encode(ErrorResponse(error=ErrorBody(
            message=message, type="invalid_request_error", code=code))), exc.status_code,
            headers=exc.headers, media_type="application/json")

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        """Whatever else failed a request (a runtime error in the core, a bug): 500 in OpenAI's
        shape, counted, logged with its traceback."""
        self.metrics.requests.labels("error").inc()
        logger.error("request_failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}",
                     exc_info=exc)
        return error_response(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")

    async def _request_failed(self, request: Request, exc: Exception) -> Response:
        """A request the engine failed while running it: 500 in OpenAI's shape with the core's
        own message, counted; the engine serves on."""
        self.metrics.requests.labels("error").inc()
        logger.error("request_failed", path=request.url.path, error=str(exc))
        return error_response(500, str(exc), "server_error", code="engine_error")

    async def _too_large(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("invalid").inc()
        return error_response(413, str(exc), "invalid_request_error", code="request_too_large")

    async def _body_timeout(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("invalid").inc()
        return error_response(408, str(exc), "invalid_request_error", code="request_timeout")

    async def _overloaded(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("overloaded").inc()
        return error_response(429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded")

    async def _engine_dead(self, request: Request, exc: Exception) -> Response:
        self.metrics.requests.labels("error").inc()
        logger.warning("engine_dead", path=request.url.path, error=str(exc))
        return error_response(503, str(exc), "service_unavailable", code="engine_dead")

    async def _unauthorized(self, request: Request, exc: Exception) -> Response:
        return error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                              "invalid_request_error", code="invalid_api_key")

    async def _client_left(self, request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    async def _shutting_down(self, request: Request, exc: Exception) -> Response:
        return error_response(503, str(exc), "service_unavailable", code="server_shutting_down")

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # As bytes: the header's as they arrived (Starlette decodes them as latin-1), the key's as
        # UTF-8; compare_digest refuses a str that is not ASCII, which would be a 500, not a 401.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode("latin-1"),
                                                                    self.api_key.encode()):
            raise Unauthorized

    # --- endpoints ---------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return json_response(ModelList(data=[ModelCard(id=self.model_name, created=self.created)]))

    async def health(self, request: Request) -> Response:
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                await self.engine.stats()
        except (EngineDeadError, TimeoutError) as e:
            state = self.supervisor.state
            status = ("dead" if state == "failed" else state) if isinstance(e, EngineDeadError) else "unresponsive"
            return Response(msgspec.json.encode({"status": status, "error": str(e) or status}), 503,
                            media_type="application/json")
        info = self.engine.info
        return Response(msgspec.json.encode({
            "status": "ok", "model": self.model_name, "platform": info.platform, "dtype": info.dtype,
            "max_model_len": info.max_model_len, "speculator": self.config.speculator,
            "num_speculative_tokens": self.config.num_speculative_tokens if self.config.speculator else 0,
        }), media_type="application/json")

    async def metrics_endpoint(self, request: Request) -> Response:
        if not self.public_metrics:
            self._authorize(request)
        stats: dict[str, Any] | None
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                stats = await self.engine.stats()
        except (EngineDeadError, TimeoutError):
            stats = None
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

    async def chat(self, request: Request) -> Response:
        self._authorize(request)
        req = self._decode(await read_body(request, self.limits), ChatCompletionRequest)
        self._check_model(req.model)
        check_stop(req.stop, self.limits)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        check_prompt_chars(sum(len(m["content"]) for m in messages), self.limits, "messages")
        ids = await self.engine.tokenize_chat(messages)
        check_prompt_tokens(len(ids), self.limits, "messages")
        return await self._serve(request, req, ids, chat=True)

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        req = self._decode(await read_body(request, self.limits), CompletionRequest)
        self._check_model(req.model)
        check_stop(req.stop, self.limits)
        engine = self.engine
        if isinstance(req.prompt, str):
            check_prompt_chars(len(req.prompt), self.limits, "prompt")
            ids = await engine.tokenize(req.prompt)
        else:
            vocab = engine.info.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = list(req.prompt)
        if not ids:
            raise BadRequest("prompt: expected a non-empty prompt", "prompt")
        check_prompt_tokens(len(ids), self.limits, "prompt")
        return await self._serve(request, req, ids, chat=False)

    def _decode(self, body: bytes, kind: type[R]) -> R:
        return decode(body, kind, max_depth=self.limits.max_json_depth, ignore_unknown=self.ignore_unknown_fields)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"model: unknown model {model!r}; this server serves {self.model_name!r}",
                                "model", "model_not_found")

    # --- generation --------------------------------------------------------------------------

    async def _serve(self, request: Request, req: ChatCompletionRequest | CompletionRequest, ids: list[int],
                     *, chat: bool) -> Response:
        """Admits the request (429 when the server is full), then answers it; the admission ends
        with the answer, or with the stream for a streaming request."""
        engine = self.engine
        params = req.sampling_params(len(ids), engine.info.max_model_len, engine.info.vocab_size)
        self.admission.enter()
        streaming = False
        try:
            response = await self._generate(request, req, ids, params, chat=chat)
            streaming = isinstance(response, EventStream)
            return response
        except InvalidSamplingParamsError as e:  # the core refused the grammar (it admits no output)
            raise req.named(e) from None
        finally:
            if not streaming:
                self.admission.leave()

    async def _first(self, request: Request, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The first output (or the error) before any header: bad input and a dead core get their
        status code, a client that leaves during prefill aborts at once, and a request that waits
        longer than max_queue_wait_s for its first token is refused (429)."""
        wait = self.limits.max_queue_wait_s
        with anyio.move_on_after(wait) as scope:
            return await unless_disconnected(request.receive, gen.__anext__, self.closing)
        assert scope.cancelled_caught
        raise EngineOverloadedError(f"no first token within {wait} s (--max-queue-wait): the engine is busy; "
                                    "retry later")

    async def _generate(self, request: Request, req: ChatCompletionRequest | CompletionRequest, ids: list[int],
                        params: SamplingParams, *, chat: bool) -> Response:
        engine = self.engine
        rid = new_id("chatcmpl" if chat else "cmpl")
        gen = engine.generate(ids, params, request_id=rid)
        try:
            first: RequestOutput | None = await self._first(request, gen)
        except StopAsyncIteration:  # pragma: no cover - generate always yields a final output
            first = None
        except BaseException as e:
            await gen.aclose()
            if isinstance(e, ClientLeft | ShuttingDown):
                self.metrics.finished("abort", len(ids), None)
            raise
        if req.stream:
            self.open_streams += 1
            return EventStream(self._events(gen, first, req, rid, len(ids), chat, params.logprobs is not None),
                               on_close=self._stream_closed,
                               closing=self.closing)
        logprobs = list(first.logprobs or ()) if first is not None else []
        """Every output's logprobs, in order: the whole answer's."""
        async with aclosing(gen):
            last = first

            async def rest() -> RequestOutput | None:
                out = first
                async for out in gen:
                    logprobs.extend(out.logprobs or ())
                return out

            try:
                if first is not None and not first.finished:
                    last = await unless_disconnected(request.receive, rest, self.closing)
            except (ClientLeft, ShuttingDown):
                self.metrics.finished("abort", len(ids), None)
                raise
        assert last is not None
        self.metrics.finished(last.finish_reason or "stop", len(ids), last)
        usage = Usage.of(len(ids), len(last.token_ids))
        tokenizer = engine.tokenizer
        if chat:
            choice = ChatChoice(index=0, message=AssistantMessage(content=last.text), finish_reason=last.finish_reason,
                                logprobs=None if params.logprobs is None else
                                chat_logprobs(tokenizer, last.token_ids, logprobs))
            return json_response(ChatCompletion(id=rid, model=self.model_name, choices=[choice], usage=usage,
                                                created=int(time.time())))
        text = TextChoice(index=0, text=last.text, finish_reason=last.finish_reason,
                          logprobs=None if params.logprobs is None else
                          completion_logprobs(tokenizer, last.token_ids, logprobs))
        return json_response(Completion(id=rid, model=self.model_name, created=int(time.time()),
                                        choices=[text], usage=usage))

    async def _events(self, gen: AsyncIterator[RequestOutput], first: RequestOutput | None,
                      req: ChatCompletionRequest | CompletionRequest, rid: str, prompt_len: int,
                      chat: bool, with_logprobs: bool = False) -> AsyncIterator[bytes]:
        """SSE chunks in OpenAI's shape; leaving early (the client disconnected) aborts the request.
        with_logprobs: each chunk carries the logprobs of the tokens behind its text."""
        created = int(time.time())
        last: RequestOutput | None = None
        outcome = "abort"
        tokenizer = self.engine.tokenizer
        offset = 0
        """Completions' text_offset: where the next token's text begins."""

        def chunk(text: str | None, finish: str | None, role: str | None = None,
                  out: RequestOutput | None = None) -> bytes:
            nonlocal offset
            lp = out.logprobs if with_logprobs and out is not None else None
            ids = out.delta_token_ids if out is not None else []
            if chat:
                delta = Delta(role=role, content=text)
                logprobs = None if lp is None else chat_logprobs(tokenizer, ids, lp)
                return sse(ChatCompletionChunk(id=rid, model=self.model_name, created=created, choices=[
                    ChatChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=logprobs)]))
            text_lp = None
            if lp is not None:
                text_lp = completion_logprobs(tokenizer, ids, lp, offset)
                offset += sum(map(len, text_lp.tokens))
            return sse(Completion(id=rid, model=self.model_name, created=created,
                                  choices=[TextChoice(index=0, text=text or "", finish_reason=finish,
                                                      logprobs=text_lp)]))

        async def outputs() -> AsyncIterator[RequestOutput]:
            if first is not None:
                yield first
            if first is None or not first.finished:
                async for out in gen:
                    yield out

        try:
            async with aclosing(gen):  # type: ignore[type-var]
                if chat:
                    yield chunk("", None, role="assistant")
                try:
                    async for out in outputs():
                        last = out
                        if out.delta_text or (with_logprobs and out.logprobs):
                            yield chunk(out.delta_text, None, out=out)
                        if out.finished:
                            yield chunk(None if chat else "", out.finish_reason)
                except Exception as e:  # the core died, or the request failed, mid-stream: say so, then end
                    outcome = "error"
                    dead = isinstance(e, EngineDeadError)
                    if not dead:
                        logger.error("request_failed", request_id=rid, error=f"{type(e).__name__}: {e}", exc_info=e)
                    yield sse(ErrorResponse(error=ErrorBody(
                        message=str(e) if isinstance(e, SpeckernelError) else f"{type(e).__name__}: {e}",
                        type="service_unavailable" if dead else "server_error",
                        code="engine_dead" if dead else
                        "engine_error" if isinstance(e, EngineRequestError) else "internal_error")))
                    yield DONE
                    return
            outcome = (last.finish_reason if last is not None else None) or "stop"
            if req.include_usage:
                usage = Usage.of(prompt_len, len(last.token_ids) if last is not None else 0)
                body = (ChatCompletionChunk(id=rid, model=self.model_name, created=created, choices=[], usage=usage)
                        if chat else Completion(id=rid, model=self.model_name, created=created, choices=[],
                                                usage=usage))
                yield sse(body)
            yield DONE
        finally:
            self.metrics.finished(outcome, prompt_len, last)


def build_app(config: EngineConfig, api_key: str | None = None, limits: ServeLimits | None = None,
              restarts: RestartPolicy | None = None, on_give_up: Callable[[str], None] | None = None,
              ignore_unknown_fields: bool = False) -> Starlette:
    return Server(config, api_key, limits, restarts, on_give_up, ignore_unknown_fields).app()
