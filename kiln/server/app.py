"""`kiln serve`'s HTTP side: OpenAI's routes and shapes on FastAPI, SSE streaming, API key, errors.

GET /health, GET /metrics, GET /v1/models[/{id}], POST /v1/chat/completions, POST /v1/completions. Handlers
validate the whole request, build the prompt, and check it against the context before anything is
queued or any byte of a stream is sent, so a client mistake is always a 4xx and never a broken stream.
One engine worker (worker.py) runs the requests in order; the engine reuses the previous request's
state for a shared prompt prefix.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..api import LLM
from ..errors import KilnError
from ..sampling import SamplingParams
from . import protocol, tools
from .protocol import ApiError, bad
from .worker import EngineDead, Job, Outcome, QueueFull, Worker, fatal

MAX_BODY = 16 * 2**20  # bytes: far more than any prompt that fits a context
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Service:
    """What the routes share: the model and its id, the API key, the worker."""

    def __init__(self, llm: LLM, model_id: str, api_key: str | None, queue_limit: int, max_batch: int = 1):
        self.llm, self.model_id, self.api_key = llm, model_id, api_key
        self.worker = Worker(llm, queue_limit, max_batch)
        self.created = int(time.time())
        tok = llm.tokenizer
        # NOTE: a tokenizer may carry a separate "tool_use" template; tools are rendered with it.
        source = (tok.templates.get("tool_use") or tok.chat_template) if tok is not None else None
        # A template that takes no tools gets the generic format; with no template there is no chat.
        self.tool_format = tools.detect(source) or (tools.GENERIC if source else None)
        llm.engine.reuse_prefix = True

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_id!r}",
                           "model", "model_not_found")

    def chat_prompt(self, req: protocol.ChatRequest) -> tuple[list[int], tools.ToolFormat | None, str]:
        """Prompt ids, the tool-call format to parse the answer with, and the forced call opening."""
        tok = self.llm.tokenizer
        if tok is None or tok.chat_template is None:
            raise bad("this model has no chat template, so it cannot chat; use /v1/completions", "messages",
                      "no_chat_template")
        fmt = self.tool_format if req.tools and req.tool_choice != "none" else None
        prefix = fmt.prefix(req.tool_name) if fmt and req.tool_choice in ("required", "function") else ""
        messages, template_tools = req.messages, req.tools if fmt else None
        if not self.tool_format.in_template:  # the generic format: tools and tool history written as text
            messages, template_tools = self.tool_format.render(messages, template_tools, req.tool_name), None
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=template_tools)
        return tok.encode(text + prefix, add_special_tokens=False), fmt, prefix

    def completion_prompts(self, req: protocol.CompletionRequest) -> list[list[int]]:
        """Each prompt's ids; in a batch an error names the prompt (prompt[i]) at fault."""
        out = []
        for i, prompt in enumerate(req.prompts):
            try:
                out.append(self.llm.encode(prompt))
            except KilnError as e:
                raise bad(_which(req.prompts, i) + str(e), "prompt") from None
        return out

    def sampling(self, req: protocol.Request, ids: list[int], default: int | None, stops: tuple[str, ...],
                 param: str, which: str = "") -> SamplingParams:
        """The settings for one prompt, checked against the context; `which` ("prompt[i]: ") names
        the prompt of a batch in the error."""
        engine = self.llm.engine
        try:
            engine.check_prompt(ids)
        except KilnError as e:
            raise bad(which + str(e), param, "context_length_exceeded") from None
        room = engine.max_context - len(ids)
        if req.max_tokens is not None and req.max_tokens > room:
            raise bad(f"{which}max_tokens is {req.max_tokens}, but the prompt has {len(ids)} tokens of the "
                      f"{engine.max_context}-token context, so at most {room} can be generated",
                      "max_tokens", "context_length_exceeded")
        n = req.max_tokens or min(default or room, room)
        params = SamplingParams(max_new_tokens=n, stop=req.stop + stops, **req.sampling)
        params.validate()
        return params


def _which(prompts: list, i: int) -> str:
    return f"prompt[{i}]: " if len(prompts) > 1 else ""


# ------------------------------------------------------------------------------------------------
# Response shapes: the same per-piece code builds streamed chunks and whole responses. `index` is the
# prompt's place in the request (always 0 for a chat); a whole response gets (pieces, Outcome) per prompt.


class _Shape:
    object = ""

    def __init__(self, service: Service, prefix: str):
        self.service, self.id = service, f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.service.model_id,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def start(self) -> list[dict]:
        return []

    def text(self, index: int, piece: str) -> list[dict]:
        raise NotImplementedError

    def token(self, index: int, token_id: int) -> list[dict]:
        """The chunks of one token of a model without a tokenizer (none: chat needs a tokenizer)."""
        return []

    def end(self, index: int, outcome: Outcome) -> list[dict]:
        raise NotImplementedError

    def whole(self, results: list[tuple[list[str], Outcome]]) -> dict:
        raise NotImplementedError


def _usage(outcomes: list[Outcome]) -> dict:
    """The token counts of a request, summed over its prompts."""
    prompt = sum(o.prompt_tokens for o in outcomes)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outcomes)}}


class _Chat(_Shape):
    object = "chat.completion.chunk"

    def __init__(self, service, fmt: tools.ToolFormat | None, prefix: str, parallel: bool):
        super().__init__(service, "chatcmpl")
        self.tools = fmt.stream(parallel) if fmt else None
        if prefix:
            self.tools.push(prefix)  # the forced opening of a call: part of the call, never content
        self.calls: list[dict] = []

    def _choice(self, delta: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self):
        return [self.chunk([self._choice({"role": "assistant", "content": ""})])]

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for kind, value in events:
            if kind == "content":
                deltas.append({"content": value})
                continue
            call = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": value.name, "arguments": value.arguments}}
            self.calls.append(call)
            deltas.append({"tool_calls": [call]})
        return deltas

    def _text_deltas(self, piece: str) -> list[dict]:
        if self.tools is None:
            return [{"content": piece}] if piece else []
        return self._deltas(self.tools.push(piece))

    def _end_deltas(self) -> list[dict]:
        return self._deltas(self.tools.finish()) if self.tools is not None else []

    def _finish(self, outcome: Outcome) -> str:
        return "tool_calls" if self.calls else outcome.finish_reason

    def text(self, index, piece):
        return [self.chunk([self._choice(d)]) for d in self._text_deltas(piece)]

    def end(self, index, outcome):
        chunks = [self.chunk([self._choice(d)]) for d in self._end_deltas()]
        return chunks + [self.chunk([self._choice({}, self._finish(outcome))])]

    def whole(self, results):
        ((pieces, outcome),) = results
        deltas = [d for p in pieces for d in self._text_deltas(p)] + self._end_deltas()
        content = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish(outcome)}
        return {**self.chunk([choice], _usage([outcome])), "object": "chat.completion"}


class _Completion(_Shape):
    object = "text_completion"

    def __init__(self, service):
        super().__init__(service, "cmpl")

    def _choice(self, index: int, text: str, finish: str | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def text(self, index, piece):
        return [self.chunk([self._choice(index, piece)])] if piece else []

    def token(self, index, token_id):
        """A model without a tokenizer: its token ids streamed one a chunk (vLLM's `token_ids` field)."""
        return [self.chunk([{**self._choice(index, ""), "token_ids": [token_id]}])]

    def end(self, index, outcome):
        return [self.chunk([self._choice(index, "", outcome.finish_reason)])]

    def whole(self, results):
        choices = [self._choice(i, "".join(pieces), o.finish_reason) for i, (pieces, o) in enumerate(results)]
        return self.chunk(choices, _usage([o for _, o in results]))


# ------------------------------------------------------------------------------------------------
# Running a job: streamed as SSE, or collected whole


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def _failure(e: Exception) -> ApiError:
    if isinstance(e, EngineDead) or fatal(e):
        return _dead(e)
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


def _dead(e: Exception) -> ApiError:
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return ApiError(503, f"the server's GPU failed ({why}); it must be restarted", code="engine_dead",
                    type="server_error")


async def _stream(job: Job, shape: _Shape, include_usage: bool):
    # With include_usage every chunk has a "usage" key, null until the last chunk (as OpenAI sends).
    sse = (lambda c: _sse({**c, "usage": None})) if include_usage else _sse
    outcomes: list[Outcome] = []
    try:
        for c in shape.start():
            yield sse(c)
        while len(outcomes) < len(job.prompts):
            kind, value = await job.events.get()
            if kind == "error":
                yield _sse(_failure(value).body())
                break
            index, value = value
            chunks = {"text": shape.text, "token": shape.token}.get(kind, shape.end)(index, value)
            for c in chunks:
                yield sse(c)
            if kind == "done":
                outcomes.append(value)
        if include_usage and len(outcomes) == len(job.prompts):
            yield _sse(shape.chunk([], _usage(outcomes)))
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (the task is cancelled) or the stream ended
        job.cancelled.set()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job: Job, request: Request) -> list[tuple[list[str], Outcome]] | None:
    """Each prompt's whole answer (its pieces and outcome), or None when the client disconnected first
    (its generation is stopped)."""
    gone = asyncio.ensure_future(_disconnected(request))
    pieces: list[list[str]] = [[] for _ in job.prompts]
    outcomes: dict[int, Outcome] = {}      # by index: batched prompts of one job may finish in any order
    try:
        while len(outcomes) < len(job.prompts):
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                return None
            kind, value = event.result()
            if kind == "error":
                raise _failure(value)
            index, value = value
            if kind == "text":
                pieces[index].append(value)
            elif kind == "done":
                outcomes[index] = value
        return [(pieces[i], outcomes[i]) for i in range(len(job.prompts))]
    finally:
        gone.cancel()
        job.cancelled.set()


async def _respond(service: Service, request: Request, req: protocol.Request,
                   prompts: list[tuple[list[int], SamplingParams]], shape: _Shape) -> Response:
    job = Job(prompts)
    try:
        service.worker.submit(job)
    except EngineDead as e:
        raise _dead(e) from None
    except QueueFull:
        raise ApiError(429, f"the server is busy ({service.worker.jobs.maxsize} requests are waiting); retry later",
                       code="queue_full", type="rate_limit_error") from None
    if req.stream:
        return StreamingResponse(_stream(job, shape, req.include_usage), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    result = await _collect(job, request)
    if result is None:
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(shape.whole(result))


async def _read_body(request: Request) -> dict:
    size = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body is larger than {MAX_BODY} bytes", code="request_too_large")
    if size.isdigit() and int(size) > MAX_BODY:
        raise too_big
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise too_big
    except ClientDisconnect:
        raise bad("the client disconnected while sending the request") from None
    return protocol.parse_json(bytes(data))


# ------------------------------------------------------------------------------------------------
# The app


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _on_api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error(e)


async def _on_kiln_error(request: Request, e: KilnError) -> JSONResponse:
    return _error(bad(str(e)))


async def _on_http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    elif e.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(e.detail), None
    return JSONResponse(ApiError(e.status_code, message, code=code).body(), status_code=e.status_code,
                        headers=e.headers)


async def _on_bug(request: Request, e: Exception) -> JSONResponse:
    return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


def create_app(llm: LLM, model_id: str, api_key: str | None = None, queue_limit: int = 64,
               max_batch: int = 1) -> FastAPI:
    service = Service(llm, model_id, api_key, queue_limit, max_batch)

    @asynccontextmanager
    async def lifespan(app):
        service.worker.start()
        yield
        service.worker.stop()

    app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(KilnError, _on_kiln_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_bug)

    async def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), service.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send the header Authorization: Bearer KEY)",
                           code="invalid_api_key")

    @app.get("/metrics")
    async def metrics():
        """Prometheus' text format: running and waiting requests, tokens, prefix hits, state bytes."""
        stats = service.worker.stats
        stats.waiting = service.worker.jobs.qsize()
        return PlainTextResponse(stats.text(service.model_id), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        if service.worker.dead is not None:
            return JSONResponse(_dead(EngineDead(service.worker.dead)).body(), status_code=503)
        return {"status": "ok", "model": service.model_id, "running": service.worker.running,
                "queued": service.worker.jobs.qsize()}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card() -> dict:
        return {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "kiln",
                "max_model_len": llm.engine.max_context,     # vLLM's field
                "vocab_size": llm.model.cfg.vocab_size}      # token-id prompts must stay below it

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return model_card()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.parse_chat(await _read_body(request))
        service.check_model(req.model)
        ids, fmt, prefix = await asyncio.to_thread(service.chat_prompt, req)
        params = service.sampling(req, ids, None, fmt.stops if fmt else (), "messages")
        return await _respond(service, request, req, [(ids, params)],
                              _Chat(service, fmt, prefix, req.parallel_tool_calls))

    @v1.post("/completions")
    async def completions(request: Request):
        req = protocol.parse_completion(await _read_body(request))
        service.check_model(req.model)
        prompts = await asyncio.to_thread(service.completion_prompts, req)
        # Each prompt is answered in turn; OpenAI's default length is 16 tokens.
        answers = [(ids, service.sampling(req, ids, 16, (), "prompt", _which(prompts, i)))
                   for i, ids in enumerate(prompts)]
        return await _respond(service, request, req, answers, _Completion(service))

    app.include_router(v1)
    return app
