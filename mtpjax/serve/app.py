"""The OpenAI-compatible ASGI app (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming), /v1/models, /health, /metrics.

Why FastAPI + uvicorn: the de facto stack for OpenAI-compatible servers (vLLM, SGLang, TGI's
router use it), well kept, with SSE through Starlette's StreamingResponse and client-disconnect
detection built in; the handlers here are plain async functions over raw JSON (see protocol.py
for why not pydantic models).

One engine sits behind the app (serve/engine_loop.py). Per request: the body is checked
(400 naming the field), submitted to the engine thread, and the handler waits for admission --
a full engine queue answers 429 (Retry-After), a stopped engine 503 -- then turns token updates
into text (serve/detokenize.py; stop strings: serve/stop_strings.py). A client that goes away
(stream closed, or the connection dropped while a non-streamed answer is computed) has its
request aborted in the engine at once, freeing its batch slot and KV blocks.
"""


import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from mtpjax.serve import engine_loop as el
from mtpjax.serve.detokenize import IncrementalDetokenizer
from mtpjax.serve.protocol import (GenerationRequest, RequestError, ServeContext,
                                   parse_chat, parse_completion)
from mtpjax.serve.stop_strings import StopStrings

DISCONNECT_POLL_S = 0.2      # a non-streamed request checks its connection this often


class _Request:
    """One admitted engine request seen from the event loop: its updates as text."""

    def __init__(self, loop: el.EngineLoop, gen: GenerationRequest, decode):
        self.engine, self.gen = loop, gen
        self.queue: asyncio.Queue[el.Update] = asyncio.Queue()
        self.detok = IncrementalDetokenizer(decode, gen.prompt_ids)
        self.stops = StopStrings(gen.stop)
        self.finished = False
        self.finish_reason: str | None = None
        self.spec_counts = (0, 0, 0)
        self.handle = -1

    async def admit(self) -> None:
        aloop = asyncio.get_running_loop()

        def sink(update: el.Update) -> None:         # engine thread -> event loop
            aloop.call_soon_threadsafe(self.queue.put_nowait, update)

        self.handle = self.engine.submit(self.gen.prompt_ids, self.gen.sampling_params, sink)
        first = await self.queue.get()
        if first.kind == el.ADMITTED:
            return
        from mtpjax.engine.llm import QueueFullError
        if isinstance(first.error, QueueFullError):
            raise RequestError(f"the server is busy: {first.error}", status=429,
                               type_="rate_limit_error", code="queue_full")
        if first.kind == el.REJECTED:
            raise RequestError(str(first.error), _param_of(str(first.error)))
        raise RequestError(f"the engine is unavailable: {first.error}", status=503,
                           type_="server_error")

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.handle)

    async def deltas(self, request=None) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """(text delta, its token ids, finish_reason or None) until the request ends. request:
        the HTTP request whose disconnection aborts this one (non-streamed answers; a stream is
        cancelled by Starlette instead, and `abort` runs from the caller's `finally`)."""
        checked = time.monotonic()
        while not self.finished:
            if request is None:
                update = await self.queue.get()
            else:
                # checked on a clock, not only when idle: updates arrive every engine step
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self.abort()
                        self.finished = True
                        return
                try:
                    update = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
            if update.kind == el.FAILED:
                self.finished = True
                raise RequestError(f"the engine failed this request: {update.error}", status=503,
                                   type_="server_error")
            text = self.detok.push(update.token_ids)
            if update.finished:
                self.finished = True
                self.spec_counts = update.spec_counts
                reason = update.finish_reason
                text += self.detok.finish()
            out, stopped = self.stops.feed(text)
            if stopped and not update.finished:
                self.engine.abort(self.handle)     # a stop string: the rest is not wanted
                self.finished = True
            if self.finished:
                out += self.stops.flush()
                self.finish_reason = "stop" if stopped else (
                    reason if reason in ("stop", "length") else "abort")
            yield out, list(update.token_ids), self.finish_reason if self.finished else None

    def usage(self) -> dict:
        n_out = len(self.detok.token_ids)
        n_in = len(self.gen.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def mtp(self) -> dict:
        v, d, a = self.spec_counts
        return {"verify_steps": v, "draft_tokens": d, "accepted_draft_tokens": a,
                "acceptance_rate": a / max(d, 1)}


def _param_of(message: str) -> str | None:
    """The request field an engine ValueError names (its messages start with `name must ...`),
    or None when it names none."""
    from mtpjax.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS
    word = message.split(" ", 1)[0].strip(":")
    return word if word in COMPLETION_FIELDS | CHAT_FIELDS else None


def create_app(engine: el.EngineLoop, ctx: ServeContext, decode, *, max_model_len: int):
    """engine: a started EngineLoop; ctx: request checking (protocol.ServeContext); decode:
    ids -> text (the tokenizer's decode)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="mtpjax", docs_url=None, redoc_url=None)
    app.state.engine, app.state.ctx = engine, ctx
    created = int(time.time())

    def error(e: RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": created, "owned_by": "mtpjax",
            "max_model_len": max_model_len,
            "num_speculative_tokens": ctx.num_speculative_tokens}]}

    async def body_of(request: Request):
        try:
            return json.loads(await request.body())
        except ValueError as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None

    async def handle(request: Request, chat: bool):
        try:
            body = await body_of(request)
            gen = (parse_chat if chat else parse_completion)(body, ctx)
            req = _Request(engine, gen, decode)
            await req.admit()
        except RequestError as e:
            return error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        model, now = ctx.model_name, int(time.time())
        if gen.stream:
            return StreamingResponse(_sse(req, rid, model, now, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, ids = [], []
        try:
            async for delta, toks, _ in req.deltas(request):
                text.append(delta)
                ids += toks
        except RequestError as e:
            return error(e)
        finally:
            req.abort()                          # a no-op unless the handler was cancelled
        if req.finish_reason is None:           # client gone: nobody reads this
            return JSONResponse({}, status_code=499)
        choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if gen.return_token_ids:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = gen.prompt_ids
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": now, "model": model, "choices": [choice], "usage": req.usage(),
                "mtp": req.mtp()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(req: _Request, rid: str, model: str, created: int, chat: bool):
    """The SSE stream of one request: OpenAI's chunk objects, then `data: [DONE]`. Closing it
    (the client went away: Starlette cancels this generator) aborts the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str, toks, reason, first=False):
        if chat:
            d = {"role": "assistant", "content": delta} if first else (
                {"content": delta} if delta or not reason else {})
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
        if req.gen.return_token_ids:
            choice["token_ids"] = toks
        out = {"id": rid, "object": kind, "created": created, "model": model,
               "choices": [choice]}
        if req.gen.include_usage:
            out["usage"] = None
        return out

    try:
        if chat:
            yield _sse_line(chunk("", [], None, first=True))
        try:
            async for delta, toks, reason in req.deltas():
                if delta or toks or reason:
                    yield _sse_line(chunk(delta, toks, reason))
        except RequestError as e:
            yield _sse_line(e.body())
            return
        if req.gen.include_usage:
            yield _sse_line({"id": rid, "object": kind, "created": created, "model": model,
                             "choices": [], "usage": req.usage(), "mtp": req.mtp()})
        yield "data: [DONE]\n\n"
    finally:
        req.abort()
