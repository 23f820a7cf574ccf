"""`ferrolm serve`: the OpenAI HTTP API over a ferrolm model, with continuous batching.

Routes (the shapes of OpenAI's API):

    POST /v1/completions         prompt: a string, a list of strings, a list of ids, a list of lists of ids
    POST /v1/chat/completions    messages, rendered to one prompt by the chat template (or the chat tokens)
    GET  /v1/models              the one model served, under its name
    GET  /health                 {"status": "ok", "running": N, "waiting": M}
    GET  /metrics                Prometheus's text format (``ferrolm.app.serve_metrics``)

Both POST routes take model, max_tokens (chat also max_completion_tokens), temperature
(0 to 2; 0 is greedy), top_p (0 < p <= 1), top_k (an extension: a positive int), n, stop
(a string or up to 4), seed, stream, stream_options, and log-probabilities (completions:
logprobs and echo; chat: logprobs and top_logprobs; see ``openai_api``). Every whole reply
carries usage counts; a stream sends them only when ``stream_options.include_usage`` asks
(then in a last chunk with no choices, before ``data: [DONE]``, as OpenAI does), so that
every chunk of a plain stream has a choice. Choice j of a prompt is sampled with seed + j,
so a request's first choice is what ``ferrolm generate --seed S`` prints.

A caller's mistake gets a 4xx with ``{"error": {"message", "type", "param", "code"}}`` and the
server keeps serving (a body nested past ``openai_api.MAX_JSON_DEPTH`` is one). The decoding
itself is ``ferrolm.lm.engine``; checking a body and shaping replies and stream chunks are
plain functions in ``ferrolm.app.openai_api``; this module is the transport between them:
it reads bodies, renders chat turns, submits each request's choices, and carries the
engine's events to the client. A client that goes away (streaming or not) has its sequences
cancelled at once, which frees their batch rows.

No client can hold the server: each request's sequences form one group of the engine, which
shares the batch rows fairly between groups; at most ``--max-queue`` requests wait for a row
(one more gets 429, code "queue_full"); a stream whose send waits ``--write-timeout``
seconds for a client that stopped reading is ended and its connection dropped; Ctrl-C or
SIGTERM gives the running requests ``--shutdown-grace`` seconds, then cancels them, and a
second signal exits at once. ``--api-key`` (or FERROLM_API_KEY) makes the /v1 routes want
``Authorization: Bearer KEY``; ``--host`` beyond this machine with no key gets a warning at
start. ``--allowed-origins`` enables CORS for browser pages on those origins.

Chat messages become one prompt through the chat template (``ferrolm.app.chat_template``:
which template, its sandbox, and the worker processes that render it within limits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ferrolm.app import openai_api, serve_metrics
from ferrolm.app.chat_template import (
    PLAIN_CHAT_STOP,
    PLAIN_CHAT_TEMPLATE,
    ChatTemplate,
    RenderWorkers,
    chat_prompt_ids,
    missing_serve_extra,
    uses_chat_tokens,
)
from ferrolm.app.openai_api import ApiError
from ferrolm.app.serve_metrics import ServeMetrics

__all__ = ["ApiError", "ChatTemplate", "PLAIN_CHAT_TEMPLATE", "PLAIN_CHAT_STOP", "load_served_model", "create_app"]

STREAM_INTERVAL = 0.05  # seconds between two hand-overs of a stream's tokens (the first goes at once)
WRITE_TIMEOUT = 30.0  # seconds a stream waits for a client that stopped reading
SHUTDOWN_GRACE = 30.0  # seconds the running requests have to finish after Ctrl-C or SIGTERM
MAX_QUEUE = 64  # requests that may wait for a batch row
PREFILL_CHUNK = 64  # prompt tokens prefilled per engine turn, between the running streams' steps
MAX_BODY_BYTES = 8 << 20
API_KEY_ENV = "FERROLM_API_KEY"  # the key --api-key takes when not given


# --------------------------------------------------------------------------------------
# The served model: weights, tokenizer, chat template
# --------------------------------------------------------------------------------------


@dataclass
class ServedModel:
    name: str
    model: Any
    tokenizer: Any
    chat_template: ChatTemplate
    chat_end_id: Optional[int] = None  # set when chats render on the tokenizer's chat tokens

    @property
    def context_length(self) -> int:
        return int(self.model.config.context_length)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def token_bytes(self, t: int) -> bytes:
        # A model may have more ids than its tokenizer (a rounded-up vocab_size): such an
        # id has no text; it shows as U+FFFD, as in `ferrolm generate`.
        return self.tokenizer.token_bytes(t) if t < self.tokenizer.vocab_size else "\ufffd".encode()


def load_served_model(
    path: Union[str, os.PathLike],
    tokenizer: Optional[Union[str, os.PathLike]] = None,
    *,
    device: str = "cpu",
    name: Optional[str] = None,
    chat_template: Optional[Union[str, os.PathLike]] = None,
) -> ServedModel:
    """What ``ferrolm.lm.checkpoint.load_model`` reads (a run folder, a checkpoint, a
    ``.safetensors`` file, a folder of ``ferrolm export``), with its tokenizer and chat
    template, ready to serve. The default name is RUN/FILE for a checkpoint, the folder's
    name for an export."""
    import torch

    from ferrolm.lm.checkpoint import load_model
    from ferrolm.lm.device import resolve_device

    dev = resolve_device(device)
    # float32 on a CPU whatever the file holds: bf16 matmuls crawl on CPUs without AMX.
    dtype = torch.float32 if dev.type == "cpu" else None
    model, tok, info = load_model(path, dev, dtype, tokenizer=tokenizer, require_tokenizer=True)
    source = Path(info["source"]).resolve()
    if source.is_dir():
        default_name = source.name
    else:
        run = source.parent
        default_name = (run.parent if run.name == "checkpoints" else run).name + "/" + source.stem
    tok_dir = info.get("tokenizer_source")
    tok_dir = Path(tok_dir) if tok_dir is not None and Path(tok_dir).is_dir() else None
    template = ChatTemplate.find(tok_dir, chat_template)
    if not uses_chat_tokens(tok, template, chat_template):
        return ServedModel(name or default_name, model, tok, template)
    from ferrolm.bpe.chat_format import CHAT_TEMPLATE, END_TOKEN

    native = ChatTemplate(CHAT_TEMPLATE, "the tokenizer's chat tokens")
    return ServedModel(name or default_name, model, tok, native, tok.special_token_ids[END_TOKEN])


# --------------------------------------------------------------------------------------
# The HTTP application
# --------------------------------------------------------------------------------------


def create_app(
    served: ServedModel,
    engine: Any,
    *,
    max_tokens_limit: int = 4096,
    stream_interval: float = STREAM_INTERVAL,
    write_timeout: float = WRITE_TIMEOUT,
    api_key: Optional[str] = None,
    allowed_origins: Optional[list[str]] = None,
):
    """The Starlette application serving ``served`` through ``engine`` (a started or
    unstarted ``ferrolm.lm.engine.Engine``; the app's lifespan starts and closes it).
    ``api_key``: every /v1 route wants ``Authorization: Bearer API_KEY`` (401 otherwise;
    /health and /metrics stay open). ``allowed_origins``: browsers on these origins (["*"]:
    any) may call the API (CORS, preflight answered).
    ``stream_interval``: the least time, in seconds, between two hand-overs of a stream's
    new tokens to the event loop (``_Outbox``); 0 hands over every token at once.
    ``write_timeout``: seconds a stream may wait for its client to take more (then it ends,
    its sequences cancelled; ``app.state.abort_client(address)``, when set, drops the
    connection)."""
    if not (stream_interval >= 0 and math.isfinite(stream_interval)):
        raise ValueError(f"stream_interval must be a number of seconds >= 0, got {stream_interval!r}")
    if not (write_timeout > 0 and math.isfinite(write_timeout)):
        raise ValueError(f"write_timeout must be a number of seconds > 0, got {write_timeout!r}")
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key must not be empty")
    try:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route
    except ImportError as e:
        raise missing_serve_extra(e) from None

    routes = _Routes(served, engine, max_tokens_limit, stream_interval, write_timeout)
    app = Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        middleware=_middleware(routes.counters, api_key, allowed_origins),
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=routes.lifespan,
    )
    app.state.close_renderer = routes.renderer.close  # for `serve` after a forced exit, which skips the lifespan's end
    return app


def _middleware(counters, api_key: Optional[str], allowed_origins: Optional[list[str]]) -> list:
    """Outermost first: CORS (a preflight is answered before the key is asked for, and a 401
    carries its headers), the request counter, the API key."""
    from starlette.middleware import Middleware

    stack = []
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        stack.append(
            Middleware(
                CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
            )
        )
    stack.append(Middleware(counters.middleware))
    if api_key is not None:
        stack.append(Middleware(_require_key, api_key))
    return stack


def _require_key(app, key: str):
    """An ASGI app around ``app`` whose /v1 routes want ``Authorization: Bearer KEY``."""
    import hmac

    want = key.strip().encode()

    async def guarded(scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # compare_digest: the time taken does not tell how much of the key a guess got right.
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), want)):
                error = ApiError(
                    "a valid API key is needed: send the header Authorization: Bearer KEY",
                    status=401,
                    code="invalid_api_key",
                )
                return await _json_response(error.body, 401)(scope, receive, send)
        return await app(scope, receive, send)

    return guarded


def _json_response(body: Any, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


async def _api_error(request, exc: ApiError):
    return _json_response(exc.body, exc.status)


async def _http_error(request, exc):
    return _json_response(openai_api.http_error(exc.status_code, str(exc.detail)).body, exc.status_code)


async def _server_error(request, exc: Exception):
    return _json_response(ApiError(f"internal error: {exc}", status=500).body, 500)


class _Routes:
    """The routes' handlers over one served model and engine: each reads its body, checks it
    with ``openai_api``, submits the choices, and writes what ``openai_api`` makes of the
    engine's events; the transport (outbox, disconnects, write timeouts, the 429 of a full
    queue, chat rendering in worker processes) is here."""

    def __init__(self, served: ServedModel, engine: Any, max_tokens_limit: int, interval: float, write_timeout: float):
        self.served, self.engine = served, engine
        self.interval, self.write_timeout = interval, write_timeout
        self.created = int(time.time())
        tok = served.tokenizer
        self.info = openai_api.ModelInfo(
            served.name,
            tok.encode,
            tok.eos_id,
            served.vocab_size,
            served.context_length,
            max_tokens_limit,
            served.token_bytes,
        )
        self.eos_text = next((s for s in tok.special_tokens if s == "<|endoftext|>"), "")
        self.renderer = RenderWorkers()
        paths = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
        self.counters = ServeMetrics(engine.counts, paths)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.engine.start()
        warming = asyncio.ensure_future(self.renderer.warm())
        try:
            yield
        finally:
            # uvicorn has let the open requests finish, or cancelled those past the shutdown's
            # grace: nobody waits for what is left.
            warming.cancel()
            self.renderer.close()
            close = functools.partial(self.engine.close, 10.0, cancel=True)
            await asyncio.get_running_loop().run_in_executor(None, close)

    async def completions(self, request):
        req = openai_api.parse_completion(await _read_body(request), self.info)
        return await self._run(request, req, chat=False)

    async def chat_completions(self, request):
        body = await _read_body(request)
        turns = openai_api.chat_turns(body, self.info)
        template, end = self.served.chat_template, self.served.chat_end_id
        if end is not None:  # ferrolm's chat tokens: straight to ids, the reply ends at the end token
            prompt = chat_prompt_ids(self.served.tokenizer, turns)
        else:
            prompt = await self.renderer.render(template.source, turns, self.eos_text)
        req = openai_api.parse_chat(body, prompt, self.info, template.default_stop, () if end is None else (end,))
        return await self._run(request, req, chat=True)

    async def models(self, request):
        card = {"id": self.served.name, "object": "model", "created": self.created, "owned_by": "ferrolm"}
        return _json_response({"object": "list", "data": [card]})

    async def health(self, request):
        running, waiting = self.engine.counts()
        return _json_response({"status": "ok", "model": self.served.name, "running": running, "waiting": waiting})

    async def metrics(self, request):
        from starlette.responses import Response

        out = self.counters.exposition()
        if out is None:
            raise ApiError(serve_metrics.MISSING, status=501, code="not_implemented")
        return Response(out[0], media_type=out[1])

    def _submit(self, req: openai_api.Request, outbox: _Outbox) -> list:
        """Every choice of ``req`` into the engine as one group (its rows shared fairly with
        other requests'); its events go to ``outbox`` as (choice index, event)."""
        from ferrolm.lm.engine import Finished, Piece, QueueFull

        handles = []
        group = object()
        counters, arrived, started = self.counters, time.monotonic(), [False] * req.choices
        try:
            for p, ids in enumerate(req.prompts):
                for j in range(req.n):

                    def on_event(event, index=p * req.n + j):
                        if not started[index] and isinstance(event, (Piece, Finished)):  # not the prompt's
                            started[index] = True
                            counters.first_token(time.monotonic() - arrived)
                        if isinstance(event, Finished):
                            counters.generated(event.completion_tokens)
                        outbox.put((index, event), urgent=not isinstance(event, Piece))

                    handles.append(self.engine.submit(ids, openai_api.sampling_params(req, j), on_event, group=group))
        except QueueFull as e:  # refused whole, before any of its sequences was queued
            raise ApiError(
                f"the server is busy: {e}; retry later", status=429, kind="rate_limit_error", code="queue_full"
            ) from None
        except RuntimeError as e:  # the engine is shutting down
            for h in handles:
                self.engine.cancel(h)
            raise ApiError(str(e), status=503, kind="server_error") from None
        counters.prompt_tokens(openai_api.usage(req, 0)["prompt_tokens"])
        return handles

    async def _run(self, request, req: openai_api.Request, chat: bool):
        # A stream's text goes out as it comes (the first piece at once, then at most every
        # interval); a whole reply needs only the end of each choice.
        outbox = _Outbox(asyncio.get_running_loop(), self.interval if req.stream else math.inf)
        handles = self._submit(req, outbox)

        def cancel_all() -> None:
            for h in handles:
                if not h.done:
                    self.engine.cancel(h)

        head = openai_api.response_head(self.served.name, chat)
        if req.stream:

            def abort() -> None:  # the client stopped reading: drop its connection
                hook = getattr(request.app.state, "abort_client", None)
                if hook is not None and request.client is not None:
                    hook(tuple(request.client))

            chunks = _stream(req, outbox, openai_api.stream_head(head, chat, req), chat)
            return _event_stream_class()(chunks, on_close=cancel_all, write_timeout=self.write_timeout, on_stall=abort)
        reply = openai_api.Reply(req)

        async def collect() -> None:
            async for bunch in _bunches(req, outbox):
                for index, event in bunch:
                    reply.add(index, event)

        try:
            if await _until_disconnect(request, collect()):
                return _json_response({}, 499)  # nobody is listening
        finally:
            cancel_all()
        return _json_response(reply.body(head, chat))


async def _read_body(request) -> Any:
    """The request's parsed JSON, its size capped at MAX_BODY_BYTES (413)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", status=413)
    raw = b""
    async for part in request.stream():  # counted as it comes: a body without a length is capped too
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", status=413)
    # A large body is parsed off the event loop: /health and the streams go on meanwhile.
    return openai_api.parse_json(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(openai_api.parse_json, raw)


async def _bunches(req: openai_api.Request, outbox: _Outbox) -> AsyncIterator[list[tuple[int, Any]]]:
    """The (choice index, event) pairs handed over together, until every choice has finished."""
    left = req.choices
    while left:
        bunch = await outbox.get()
        left -= openai_api.bunch_ends(bunch)
        yield bunch


async def _stream(req: openai_api.Request, outbox: _Outbox, head: dict, chat: bool) -> AsyncIterator[bytes]:
    """A stream's server-sent events: one write per bunch, then the usage (when asked for)
    and DONE."""
    opening = openai_api.role_chunk(head, req, chat)
    if opening:
        yield opening
    completion_tokens = 0
    try:
        async for bunch in _bunches(req, outbox):
            data, tokens = openai_api.stream_bunch(head, bunch, chat, req)
            completion_tokens += tokens
            yield data
    except ApiError as e:
        yield openai_api.error_chunk(e)
        return
    if req.include_usage:
        yield openai_api.usage_chunk(head, req, completion_tokens)
    yield openai_api.DONE


class _Outbox:
    """One request's events, from the engine's thread to its handler on the event loop.

    Each hand-over wakes the event loop, and on a CPU that wake takes a core from the
    engine's threads in the middle of a step; so a bunch goes over at most every
    ``interval`` seconds, except that an urgent event (a choice's end) and the first
    event go at once. Nothing waits for long: a running choice brings an event (or its
    end) every step, and the first of them past the interval takes the bunch along.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float):
        self._loop = loop
        self._interval = interval
        self._lock = threading.Lock()
        self._pending: list = []
        self._scheduled = False  # a hand-over is on its way to the loop
        self._last = -math.inf  # when the last one was sent
        self._bunches: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any, *, urgent: bool) -> None:
        """On the engine's thread."""
        with self._lock:
            self._pending.append(item)
            now = time.monotonic()
            if self._scheduled or not (urgent or now - self._last >= self._interval):
                return
            self._scheduled, self._last = True, now
        with contextlib.suppress(RuntimeError):  # the loop has closed: no one is listening
            self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            bunch, self._pending, self._scheduled = self._pending, [], False
        if bunch:
            self._bunches.put_nowait(bunch)

    async def get(self) -> list:
        """The next bunch of events, in the order they came."""
        return await self._bunches.get()


async def _until_disconnect(request, work) -> bool:
    """Run ``work``; True if the client disconnected first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        task.result()  # re-raises an ApiError from the engine
        return False
    return True


@functools.cache
def _event_stream_class():
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        """Server-sent events that stop, and call ``on_close``, as soon as the client leaves,
        or when a send waits over ``write_timeout`` seconds for a client that stopped reading
        (then ``on_stall`` drops its connection)."""

        def __init__(self, content, on_close: Callable[[], None], write_timeout: float, on_stall: Callable[[], None]):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.on_close = on_close
            self.write_timeout = write_timeout
            self.on_stall = on_stall

        async def __call__(self, scope, receive, send) -> None:
            import anyio

            stalled = False

            async def timed_send(message) -> None:
                nonlocal stalled
                try:
                    with anyio.fail_after(self.write_timeout):
                        await send(message)
                except TimeoutError:
                    stalled = True
                    raise

            try:
                async with anyio.create_task_group() as group:

                    async def stream() -> None:
                        with contextlib.suppress(OSError, TimeoutError):  # the client left, or stopped reading
                            await self.stream_response(timed_send)
                        group.cancel_scope.cancel()

                    async def listen() -> None:
                        await self.listen_for_disconnect(receive)
                        group.cancel_scope.cancel()

                    group.start_soon(stream)
                    group.start_soon(listen)
            finally:
                self.on_close()
                if stalled:
                    self.on_stall()

    return EventStream


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def serve(
    checkpoint: Union[str, os.PathLike],
    *,
    tokenizer=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    name: Optional[str] = None,
    chat_template=None,
    max_batch: int = 16,
    max_tokens_limit: int = 4096,
    threads: Optional[int] = None,
    log_level: str = "warning",
    stream_interval: float = STREAM_INTERVAL,
    max_queue: int = MAX_QUEUE,
    prefill_chunk: int = PREFILL_CHUNK,
    write_timeout: float = WRITE_TIMEOUT,
    shutdown_grace: float = SHUTDOWN_GRACE,
    api_key: Optional[str] = None,
    allowed_origins: Optional[Union[str, list[str]]] = None,
) -> int:
    """Load the model and serve it until Ctrl-C or SIGTERM, which give the running requests
    ``shutdown_grace`` seconds to finish (then they are cancelled) before the process exits;
    a second Ctrl-C or SIGTERM exits at once. ``api_key`` defaults to the environment's
    FERROLM_API_KEY; ``allowed_origins``: a list or a comma-separated string ("*": any)."""
    try:
        import uvicorn
    except ImportError as e:
        raise missing_serve_extra(e) from None
    import torch

    from ferrolm.lm.engine import Engine

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    _check_serve_options(max_batch, max_tokens_limit, stream_interval, port, max_queue, prefill_chunk)
    for flag, seconds in (("--write-timeout", write_timeout), ("--shutdown-grace", shutdown_grace)):
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds}")
    api_key = _api_key(api_key, host)
    origins = _origins(allowed_origins)

    def load() -> tuple[ServedModel, Engine]:
        served = load_served_model(checkpoint, tokenizer, device=device, name=name, chat_template=chat_template)
        engine = Engine(
            served.model,
            served.token_bytes,
            served.tokenizer.eos_id,
            max_batch=max_batch,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk or None,
        )
        return served, engine

    # Loaded on a thread that ends here, so that the engine's thread is the only one that has run
    # torch work. Under OpenMP (torch on a CPU) each such thread keeps a team of worker threads; one
    # idle team more puts the process over one OpenMP thread per core, and libgomp then stops
    # spinning: the engine's workers sleep after every parallel region and are woken for the next,
    # dozens of times a token (one stream decoded at 0.7x the speed of `ferrolm generate`).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ferrolm-load") as pool:
        served, engine = pool.submit(load).result()
    app = create_app(
        served,
        engine,
        max_tokens_limit=max_tokens_limit,
        stream_interval=stream_interval,
        write_timeout=write_timeout,
        api_key=api_key,
        allowed_origins=origins,
    )

    sock, address = _listen(host, port)
    print(
        f"serving {served.name} on http://{address}/v1 (chat template: {served.chat_template.origin}; "
        f"batch up to {max_batch}; Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=shutdown_grace)
    server = _server_class()(config)
    app.state.abort_client = server.abort_client
    server.run(sockets=[sock])
    # After a forced exit, which skips the app's own shutdown:
    app.state.close_renderer()
    engine.close(10.0, cancel=True)
    print("stopped", file=sys.stderr, flush=True)
    return 0


def _check_serve_options(
    max_batch: int, max_tokens_limit: int, stream_interval: float, port: int, max_queue: int, prefill_chunk: int
) -> None:
    """ValueError naming the first option out of its range."""
    if max_batch < 1 or max_tokens_limit < 1:
        raise ValueError("--max-batch and --max-tokens-limit must be >= 1")
    if not (stream_interval >= 0 and math.isfinite(stream_interval)):
        raise ValueError(f"--stream-interval must be a number of seconds >= 0, got {stream_interval}")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
    if prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 (0: each prompt whole), got {prefill_chunk}")


def _api_key(api_key: Optional[str], host: str) -> Optional[str]:
    """The key the /v1 routes require (--api-key, else FERROLM_API_KEY, else none), with a
    warning when a server without one listens beyond loopback."""
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise ValueError(f"--api-key (or {API_KEY_ENV}) must not be empty")
    if not _is_loopback(host) and api_key is None:
        print(
            f"warning: --host {host} serves anyone who can reach this machine, with no authentication "
            f"(--api-key or {API_KEY_ENV} sets a key); use 127.0.0.1 (the default) unless the network is yours",
            file=sys.stderr,
            flush=True,
        )
    return api_key


def _origins(allowed: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
    """--allowed-origins as a list: "*", or origins such as https://example.com."""
    if allowed is None:
        return None
    origins = [o.strip() for o in allowed.split(",")] if isinstance(allowed, str) else list(allowed)
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s,]+", o):
            raise ValueError(f"--allowed-origins takes * or origins such as https://example.com (no path), got {o!r}")
    return origins


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket listening on ``host:port``, and its address as a URL shows it (the port
    chosen when ``port`` is 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)  # before the address is announced: early clients wait in the backlog, never refused
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"{shown}:{sock.getsockname()[1]}"


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: localhost, 127.0.0.0/8, ::1."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a handled Ctrl-C or SIGTERM ends in a normal exit
        (uvicorn raises the signal again after its graceful shutdown), a second one of
        either forces the exit, and a connection can be dropped by its client's address."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        def abort_client(self, address: tuple) -> None:
            """Drop the connection from ``address`` at once, its unsent data with it (a
            plain close would wait for a client that does not read)."""
            for connection in list(self.server_state.connections):
                if tuple(getattr(connection, "client", None) or ()) == address:
                    connection.transport.abort()

        @contextlib.contextmanager
        def capture_signals(self):
            handled = (signal.SIGINT, signal.SIGTERM)
            before = {s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for s, handler in before.items():
                    signal.signal(s, handler)

    return Server
