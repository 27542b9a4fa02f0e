"""`mpdl serve`'s HTTP side: an OpenAI-compatible API over a continuous-batching `Engine`.

    POST /v1/completions   prompt, max_tokens, temperature, top_k, top_p, stop, seed, stream
    GET  /v1/models        the served model
    GET  /health           200 when the engine runs
    GET  /metrics          requests, tokens/s, time to first token and per-token latency
                           percentiles, KV pages in use (JSON)

The app is a starlette ASGI application run by uvicorn in a thread of the replica's first rank:
starlette is small and its `StreamingResponse` gives server-sent events without a framework
around it; uvicorn is the reference ASGI server. The handlers check a request and put it in the
`Frontend`'s inbox; the main thread runs the engine loop (`run_replica`) on every rank of the
replica and hands each new piece of text back to the handler's event loop. A bad request gets
400 with an OpenAI-style error naming the field (an unknown field, NaN or Infinity anywhere,
`max_tokens` above the server's cap), a model it does not serve 404 `model_not_found`; a client
that goes away is cancelled in the engine before its next token, which frees its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from mpdl.inference.engine import Engine, SamplingParams
from mpdl.inference.generation import check_prompt

_TAG = 52
#: the /v1/completions fields the server reads; any other is refused, as OpenAI's API does
FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed",
                    "n", "stop", "stream", "user"})
#: the default of `mpdl serve --max-tokens`: the most tokens one request may ask for
MAX_TOKENS = 4096


class BadRequest(ValueError):
    """A request field that is missing, unknown or out of range (`status` 400), or a model the
    server does not serve (404, `code` model_not_found)."""

    def __init__(self, param: str | None, message: str, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _non_finite(value: Any) -> bool:
    """Whether value holds a NaN or an infinity (at any depth)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def parse_request(body: Any, vocab: str, block_size: int, model: str | None = None,
                  max_tokens_cap: int = MAX_TOKENS) -> tuple[list[int], SamplingParams, bool]:
    """The prompt's token ids, the sampling parameters and whether to stream, from a
    /v1/completions body; BadRequest naming the first field that is wrong (or the model, when
    `model` is given and the body names another)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    for name, value in body.items():
        if _non_finite(value):
            raise BadRequest(name, f"{name}: expected finite numbers, got NaN or Infinity")
    if model is not None and body.get("model") is not None and body["model"] != model:
        raise BadRequest("model", f"The model `{body['model']}` does not exist (this server "
                                  f"serves `{model}`)", 404, "model_not_found")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt", "expected a string")
    try:
        check_prompt(vocab, prompt)
    except ValueError as exc:
        raise BadRequest("prompt", str(exc)) from None
    if len(prompt) > block_size:
        raise BadRequest("prompt", f"prompt: {len(prompt)} characters, longer than the model's "
                                   f"block of {block_size}")

    def number(name: str, default: Any, kind: type, low: float, high: float = float("inf"),
               low_open: bool = False) -> Any:
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise BadRequest(name, f"{name}: expected {'a number' if kind is float else 'an integer'}"
                                   f", got {value!r}")
        if value < low or value > high or (low_open and value == low):
            bound = f"> {low}" if low_open else f">= {low}"
            raise BadRequest(name, f"{name}: expected a value {bound}"
                                   f"{'' if high == float('inf') else f' and <= {high}'}, got {value}")
        return kind(value)

    max_tokens = number("max_tokens", 16, int, 1, max_tokens_cap)
    temperature = number("temperature", 1.0, float, 0.0, 2.0)
    top_k = number("top_k", None, int, 1)
    top_p = number("top_p", 1.0, float, 0.0, 1.0, low_open=True)
    seed = number("seed", 0, int, 0)
    if number("n", 1, int, 1, 1) != 1:
        raise BadRequest("n", "n: only 1 completion per request")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop", "stop: expected a non-empty string or a list of them")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"stream: expected true or false, got {stream!r}")
    ids = [vocab.index(ch) for ch in prompt]
    return ids, SamplingParams(max_tokens, temperature, top_k, top_p, tuple(stop), seed), stream


class Metrics:
    """What the server has done: requests, new tokens, time to first token and gaps between
    tokens (the last 10,000 of each)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.requests = self.finished = self.rejected = self.cancelled = self.tokens = 0
        self.ttft: deque[float] = deque(maxlen=10_000)
        self.gaps: deque[float] = deque(maxlen=10_000)
        self.lock = threading.Lock()

    def summary(self, engine: Engine) -> dict[str, Any]:
        def pct(values: deque[float], q: float) -> float | None:
            with self.lock:  # the engine's thread appends meanwhile
                values = list(values)
            return float(np.percentile(values, q)) if values else None

        wall = time.perf_counter() - self.start
        return {"requests": self.requests, "finished": self.finished, "rejected": self.rejected,
                "cancelled": self.cancelled, "running": len(engine.running),
                "waiting": len(engine.waiting), "tokens": self.tokens,
                "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
                "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
                "latency_p50_s": pct(self.gaps, 50), "latency_p99_s": pct(self.gaps, 99),
                "kv_pages_in_use": engine.pool.in_use, "kv_pages": engine.pool.pages,
                "kv_page_bytes": engine.pool.page_bytes, "engine_steps": engine.steps}


class Frontend:
    """The replica's first rank's side of the engine: the inbox of commands, the handlers'
    queues, the metrics."""

    def __init__(self, engine: Engine, model: str, max_tokens: int = MAX_TOKENS) -> None:
        self.engine, self.model, self.max_tokens = engine, model, max_tokens
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[float]]] = {}
        self.metrics = Metrics()
        self.ids = itertools.count()
        self.running = True

    def submit(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
               ) -> tuple[int, asyncio.Queue]:
        rid, events = next(self.ids), asyncio.Queue()
        self.streams[rid] = (loop, events, [time.perf_counter()])
        self.metrics.requests += 1
        self.inbox.put(("add", rid, prompt, params))
        return rid, events

    def cancel(self, rid: int) -> None:
        if self.streams.pop(rid, None) is not None:
            self.metrics.cancelled += 1
            self.inbox.put(("cancel", rid))

    def deliver(self, out: list[tuple[Any, str]]) -> None:
        """Hand each sequence's new text to its handler (from the engine's thread)."""
        now = time.perf_counter()
        for s, piece in out:
            self.metrics.tokens += 1
            entry = self.streams.get(s.rid)
            if entry is None:
                continue
            loop, events, times = entry
            with self.metrics.lock:
                (self.metrics.ttft if len(times) == 1 else self.metrics.gaps).append(now - times[-1])
            times.append(now)
            if s.finish is not None:
                self.metrics.finished += 1
                self.streams.pop(s.rid, None)
            loop.call_soon_threadsafe(events.put_nowait, (piece, s.finish, s.new))

    def commands(self, block: bool) -> list[tuple]:
        """The inbox's commands (waiting up to 0.1 s for one when `block`)."""
        got = []
        try:
            if block:
                got.append(self.inbox.get(timeout=0.1))
            while True:
                got.append(self.inbox.get_nowait())
        except queue.Empty:
            return got


def run_replica(engine: Engine, group: Any, frontend: Frontend | None,
                stop: threading.Event) -> None:
    """The engine loop on every rank of a replica (`group`: its mpi4py communicator, None for one
    rank; `frontend` on its first rank only): each step the first rank sends the new commands to
    the others, every rank applies them and steps the engine."""
    root = frontend is not None
    while True:
        if root:
            commands = frontend.commands(block=engine.idle)
            if stop.is_set():
                commands.append(("stop",))
            if group is not None:
                for rank in range(1, group.Get_size()):
                    group.send(commands, dest=rank, tag=_TAG)
        else:
            while not group.Iprobe(source=0, tag=_TAG):
                time.sleep(0.0005)
            commands = group.recv(source=0, tag=_TAG)
        for command in commands:
            if command[0] == "stop":
                return
            if command[0] == "add":
                engine.add(*command[1:])
            else:
                engine.cancel(command[1])
        if not engine.idle:
            out = engine.step()
            if root:
                frontend.deliver(out)


def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
           code: str | None = None) -> Any:
    from starlette.responses import JSONResponse  # noqa: PLC0415

    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


async def _disconnected(request: Any) -> None:
    """Return when the client of request (whose body was read) goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(frontend: Frontend) -> Any:
    """The starlette app of the API over `frontend`."""
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse, StreamingResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    engine = frontend.engine
    created = int(time.time())

    def completion(rid: int, text: str, finish: str | None, usage: dict | None = None) -> dict:
        body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
                "model": frontend.model, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                      "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return body

    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            frontend.metrics.rejected += 1
            return _error(400, "the body is not JSON", "body")
        try:
            prompt, params, stream = parse_request(body, engine.vocab, engine.decoder.block_size,
                                                   frontend.model, frontend.max_tokens)
        except BadRequest as exc:
            frontend.metrics.rejected += 1
            return _error(exc.status, str(exc), exc.param, code=exc.code)
        rid, events = frontend.submit(prompt, params, asyncio.get_running_loop())

        def usage(new: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": new,
                    "total_tokens": len(prompt) + new}

        if stream:
            async def sse() -> Any:
                try:
                    while True:
                        piece, finish, new = await events.get()
                        data = completion(rid, piece, finish, usage(new) if finish else None)
                        yield f"data: {json.dumps(data)}\n\n"
                        if finish is not None:
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    frontend.cancel(rid)  # a no-op once finished

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, finish, new = [], None, 0
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while finish is None:
                token = asyncio.ensure_future(events.get())
                await asyncio.wait((token, gone), return_when=asyncio.FIRST_COMPLETED)
                if gone.done():  # looked at before every token the engine hands over
                    token.cancel()
                    frontend.cancel(rid)
                    return JSONResponse({}, status_code=499)
                piece, finish, new = token.result()
                text.append(piece)
        finally:
            gone.cancel()
        return JSONResponse(completion(rid, "".join(text), finish, usage(new)))

    async def models(request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [
            {"id": frontend.model, "object": "model", "created": created, "owned_by": "mpdl"}]})

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok" if frontend.running else "stopping"})

    async def metrics(request: Request) -> Any:
        return JSONResponse(frontend.metrics.summary(engine))

    async def not_found(request: Request, exc: Exception) -> Any:
        return _error(404, f"no route {request.method} {request.url.path}", None, "not_found")

    async def bad_method(request: Request, exc: Exception) -> Any:
        return _error(405, f"{request.method} is not allowed on {request.url.path}", None,
                      "invalid_request_error")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"]),
                             Route("/metrics", metrics, methods=["GET"])],
                     exception_handlers={404: not_found, 405: bad_method})


def start_http(frontend: Frontend, host: str, port: int) -> Any:
    """Run the app with uvicorn in a daemon thread; returns the uvicorn server once it listens
    (RuntimeError when it could not)."""
    import uvicorn  # noqa: PLC0415

    server = uvicorn.Server(uvicorn.Config(make_app(frontend), host=host, port=port,
                                           log_level="critical", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"--port: cannot listen on {host}:{port} (in use, or --host is "
                               f"not an address of this machine)")
        time.sleep(0.01)
    return server
