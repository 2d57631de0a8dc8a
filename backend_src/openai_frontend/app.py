"""FastAPI routes: /v1/models, /v1/completions, /v1/chat/completions (streaming and not), /health, and vLLM's
/tokenize, /detokenize and /version."""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.config import EngineConfig

from .chat import ChatTemplates
from .errors import APIError, bad_request
from .protocol import GenerationRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from .reasoning import REASONING, ReasoningStream, prompt_ends_reasoning, split as split_reasoning
from .responses import DONE, ResponseBuilder, reasoning_fields, sse, usage
from .triton_client import TritonBackend
from .tools import ToolStream, finish_reason, parse_output
from .triton_io import Delta, TokenLogprob, openai_finish_reason

log = logging.getLogger(__name__)

# The engine's max_model_len for a model whose config does not set it.
DEFAULT_MAX_MODEL_LEN = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_model_len")


class ClientGone(Exception):
    """The HTTP client disconnected while we waited on the model."""


class Accumulated:
    """Running totals over one choice's deltas. We always stream from Triton, and a streamed response's
    num_output_tokens counts the tokens it carries (they add up to the total, as in vLLM's backend);
    num_input_tokens repeats the prompt length, so the latest one is kept."""

    def __init__(self, prefix: str = ""):
        self.parts = [prefix] if prefix else []
        self.finish_reason: str | None = None
        self.num_input: int | None = None
        self.num_output: int | None = None
        self.num_cached: int | None = None
        self.logprobs: list[TokenLogprob] | None = None  # every token's, when the request asked for logprobs
        self.offset = 0  # characters of the tokens before this delta's (completions' text_offset)

    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_input = delta.num_input_tokens if delta.num_input_tokens is not None else self.num_input
        self.num_cached = delta.num_cached_tokens if delta.num_cached_tokens is not None else self.num_cached
        if delta.num_output_tokens is not None:
            self.num_output = (self.num_output or 0) + delta.num_output_tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Choices:
    """The request's n choices, by index."""

    def __init__(self, n: int, prefix: str = ""):
        self.all = [Accumulated(prefix) for _ in range(n)]

    def add(self, deltas: list[Delta]) -> list[Delta]:
        """Take one Triton response; returns its deltas for choices still open. The model repeats a finished
        sample in every later response (an element per sample, vLLM's layout): those repeats are dropped, so each
        choice finishes, and is counted, once."""
        fresh = [d for d in deltas if self.all[d.index].finish_reason is None]
        for delta in fresh:
            self.all[delta.index].add(delta)
        return fresh

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.all)

    def usage(self, before: list[Delta] | None = None) -> dict[str, Any]:
        """Totals so far; `before`: a response not added yet, for the prompt's counts before any choice has one."""
        first = self.all[0]
        num_input, num_cached = first.num_input, first.num_cached
        if num_input is None and before:
            num_input, num_cached = before[0].num_input_tokens, before[0].num_cached_tokens
        return usage(num_input, sum(c.num_output or 0 for c in self.all), num_cached)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable) -> Any:
    """Await `work`, cancelling it if the client goes away first. Cancelling the task that drives the delta
    generator runs the generator's cleanup, which cancels the Triton request."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is left to tell
        pass
    raise ClientGone()


async def _stream_body(builder: ResponseBuilder, req: GenerationRequest, first: list[Delta],
                       deltas: AsyncIterator[list[Delta]]) -> AsyncIterator[str]:
    # Starlette cancels this generator when the client disconnects (its listen_for_disconnect task);
    # aclosing then closes `deltas`, whose cleanup cancels the gRPC call of an unfinished request.
    async with aclosing(deltas):
        choices = Choices(req.n)

        def event(chunk: dict[str, Any]) -> str:
            if req.continuous_usage:  # vLLM's continuous_usage_stats: the totals so far on every chunk
                chunk["usage"] = choices.usage(first)
            return sse(chunk)

        try:
            if req.is_chat:
                for i in range(req.n):
                    yield event(builder.role_chunk(i))
            step, prefix = first, (req.prompt if req.echo else "")
            echoed = set()
            # Chat with tools or a reasoning parser: each choice's text goes through its reader (content, tool_calls
            # and reasoning deltas).
            readers = [ChatReader(req) for _ in range(req.n)] \
                if req.is_chat and (req.tools.active or req.reasoning_parser) else None
            while True:
                for delta in choices.add(step):
                    head = prefix if delta.index not in echoed else ""
                    echoed.add(delta.index)
                    text = head + delta.text
                    choice = choices.all[delta.index]
                    logprobs = builder.logprobs(delta.logprobs, choice.offset)
                    choice.offset += sum(len(t.token) for t in delta.logprobs or [])
                    if readers is not None:
                        for chunk in _tool_chunks(builder, readers[delta.index], text, delta, logprobs):
                            yield event(chunk)
                    elif delta.finish_reason:
                        yield event(builder.chunk(text, openai_finish_reason(delta.finish_reason), delta.index,
                                                  logprobs))
                    elif text or logprobs is not None and delta.logprobs:
                        yield event(builder.chunk(text, index=delta.index, logprobs=logprobs))
                if choices.finished:
                    if req.include_usage:
                        yield sse(builder.usage_chunk(choices.usage()))
                    break
                step = await anext(deltas)
        except APIError as e:
            # Headers (200) are gone already; OpenAI's clients raise on an event that carries "error".
            log.warning("stream %s failed: %s", builder.id, e.message)
            yield sse(e.body())
        yield DONE


class ChatReader:
    """One chat choice's streamed text -> delta objects: the reasoning parser's reasoning (when the model has one
    and the request includes it), its content through the tool-call reader (which passes text through without
    tools), so tool calls are read only after the reasoning, as vLLM reads them."""

    def __init__(self, req: GenerationRequest):
        self.tools = ToolStream(req.tools)
        self.reasoning = ReasoningStream(req.reasoning_ended) if req.reasoning_parser else None
        self.include_reasoning = req.include_reasoning

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self.tools.feed(text)
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        held = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        return held + self.tools.finish()

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == REASONING:
                if self.include_reasoning:
                    out.append(reasoning_fields(text))
            else:
                out += self.tools.feed(text)
        return out


def _tool_chunks(builder: ResponseBuilder, reader: ChatReader, text: str, delta: Delta,
                 logprobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One model delta of a chat choice with tools or reasoning -> its chunks; the finish chunk says tool_calls when
    the choice made calls. The delta's logprobs ride on its first chunk, or on an empty one while the reader holds
    its text back."""
    parts = reader.feed(text)
    if delta.finish_reason:
        parts += reader.finish()
    chunks = [builder.delta_chunk(p, index=delta.index, logprobs=logprobs if i == 0 else None)
              for i, p in enumerate(parts)]
    if delta.finish_reason:
        reason = finish_reason(openai_finish_reason(delta.finish_reason), range(reader.num_calls))
        chunks.append(builder.delta_chunk({}, reason, delta.index, None if parts else logprobs))
    elif not parts and logprobs is not None and delta.logprobs:
        chunks.append(builder.delta_chunk({}, index=delta.index, logprobs=logprobs))
    return chunks


def _whole_choice(req: GenerationRequest, c: "Accumulated") \
        -> tuple[str | None, str, list[dict[str, Any]], str | None]:
    """(content, finish reason, tool calls, reasoning) of one whole choice."""
    reason = openai_finish_reason(c.finish_reason)
    text, reasoning = c.text, None
    if req.is_chat and req.reasoning_parser:
        reasoning, text = split_reasoning(text, req.reasoning_ended)
        if not req.include_reasoning:
            reasoning = None
    if not (req.is_chat and req.tools.active) or text is None:
        return text, reason, [], reasoning
    content, calls = parse_output(req.tools, text)
    return content, finish_reason(reason, calls), calls, reasoning


def apply_reasoning(req: GenerationRequest, parser: str | None, generation_prompt: str) -> None:
    """Set a chat request's reasoning parser (the served model's, None: off) and whether the generation prompt
    (what the chat template adds after the messages) already ended the reasoning; refuse what cannot be honoured."""
    if parser is None:
        if not req.include_reasoning:
            raise bad_request("include_reasoning=false needs a reasoning parser, and this model is served without "
                              "one (the frontend's --reasoning-parser): allowed true or null", "include_reasoning")
        return
    req.reasoning_parser = parser
    req.reasoning_ended = prompt_ends_reasoning(generation_prompt, req.chat_template_kwargs)
    if not req.reasoning_ended and "structured_outputs" in req.sampling:
        param = req.constraint_param or "structured_outputs"
        raise bad_request(f"{param} while the model reasons is not supported: this server constrains the reply from "
                          "its first token, the reasoning included (vLLM starts after </think>); allowed with "
                          'chat_template_kwargs {"enable_thinking": false}', param)


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e


def _max_model_len(info: Any) -> int:
    """The model's max_model_len parameter, else the engine's default for it."""
    try:
        return int(info.parameters.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    except ValueError:
        return DEFAULT_MAX_MODEL_LEN


def _version() -> str:
    try:
        return importlib.metadata.version("inflight-triton")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def _generate(request: Request, parse: Callable[[dict], GenerationRequest]) -> Response:
    req = parse(await _json_body(request))
    backend: TritonBackend = request.app.state.backend
    info = await backend.model(req.model)
    if req.logprobs is not None and not {"logprobs", "output_ids"} <= info.outputs:
        raise bad_request(f"model {info.name!r} does not return per-token logprobs (its config has no 'logprobs' "
                          "and 'output_ids' outputs): allowed logprobs unset", "logprobs")
    if req.is_chat:
        templates: ChatTemplates = request.app.state.templates
        parsers: dict[str, str] = request.app.state.reasoning_parsers
        parser = parsers.get(info.name, parsers.get("*"))

        def render() -> tuple[str, str]:
            """The prompt, and with a reasoning parser the generation prompt (the prompt less the bare messages)."""
            prompt = templates.render(info.name, info.tokenizer_dir, req.messages, req.tools, req.chat_template_kwargs)
            if parser is None:
                return prompt, ""
            try:
                bare = templates.render(info.name, info.tokenizer_dir, req.messages, req.tools,
                                        req.chat_template_kwargs, add_generation_prompt=False)
            except APIError:  # a template that wants the generation prompt: read the whole prompt
                bare = ""
            return prompt, prompt[len(bare):] if prompt.startswith(bare) else prompt

        req.prompt, generation_prompt = await asyncio.to_thread(render)
        apply_reasoning(req, parser, generation_prompt)
    builder = ResponseBuilder(req)
    deltas = backend.generate(info, req.prompt, req.sampling, builder.id)
    try:
        # Wait for the model's first response before answering, so a refused request (bad value, queue
        # full) gets its own status code even when it asked to stream.
        first = await _unless_disconnected(request, anext(deltas))
        if req.stream:
            return StreamingResponse(_stream_body(builder, req, first, deltas), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def collect() -> Choices:
            choices = Choices(req.n, req.prompt if req.echo else "")
            choices.add(first)
            while not choices.finished:
                choices.add(await anext(deltas))
            return choices

        choices = await _unless_disconnected(request, collect())
        wholes = [_whole_choice(req, c) for c in choices.all]
        return JSONResponse(builder.full([w[:3] for w in wholes], choices.usage(),
                                         [c.logprobs or [] for c in choices.all],
                                         [w[3] for w in wholes] if req.reasoning_parser else None))
    except ClientGone:
        log.info("client left %s before its answer; request cancelled", builder.id)
        return Response(status_code=499)
    finally:
        if not req.stream:
            await deltas.aclose()


WARM_UP_TIMEOUT_S = 120.0


async def _warm_up(backend: TritonBackend, templates: ChatTemplates) -> None:
    """Load the served models' tokenizers before answering anything: loading one takes seconds of a core, which
    the first requests would otherwise wait for, OpenAI's and tritonserver's alike on a small machine (`make serve`
    says ready once /health answers). Best effort: a chat request loads whatever is missing."""
    try:
        for info in await backend.list_models():
            if info.tokenizer_dir:
                await asyncio.to_thread(templates.preload, info.tokenizer_dir)
    except Exception as e:  # noqa: BLE001 - Triton not up yet, a broken folder: the request path reports it
        log.info("tokenizer warm-up skipped: %s", e)


def _model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "triton"}


def create_app(triton_url: str, tokenizers: dict[str, str] | None = None,
               model_repository: str | None = None, admin_key: str | None = None,
               reasoning_parsers: dict[str, str] | None = None) -> FastAPI:
    """reasoning_parsers: model name ("*": any other model) -> reasoning parser for its chat replies."""
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.backend = TritonBackend(triton_url, tokenizers, model_repository, admin_key)
        app.state.templates = ChatTemplates()
        app.state.reasoning_parsers = dict(reasoning_parsers or {})
        try:
            await asyncio.wait_for(_warm_up(app.state.backend, app.state.templates), WARM_UP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("tokenizer warm-up took over %.0f s: serving without it", WARM_UP_TIMEOUT_S)
        yield
        await app.state.backend.close()

    app = FastAPI(title="OpenAI-compatible API for tritonserver", lifespan=lifespan, docs_url=None,
                  redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}").body(), status_code=500)

    @app.get("/health")
    async def health(request: Request) -> Response:
        ready = await request.app.state.backend.is_ready()
        return Response(status_code=200 if ready else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_tokenize(await _json_body(request))
        info = await request.app.state.backend.model(req.model)
        templates: ChatTemplates = request.app.state.templates

        def work() -> list[int]:
            text = req.prompt
            if text is None:
                text = templates.render(info.name, info.tokenizer_dir, req.messages, req.tools,
                                        req.chat_template_kwargs, req.add_generation_prompt)
            return templates.encode(info.name, info.tokenizer_dir, text)

        ids = await asyncio.to_thread(work)
        return {"count": len(ids), "max_model_len": _max_model_len(info), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        model, ids = parse_detokenize(await _json_body(request))
        info = await request.app.state.backend.model(model)
        templates: ChatTemplates = request.app.state.templates
        return {"prompt": await asyncio.to_thread(templates.decode, info.name, info.tokenizer_dir, ids)}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        models = await request.app.state.backend.list_models()
        return {"object": "list", "data": [_model_card(m.name, started) for m in models]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        return _model_card((await request.app.state.backend.model(name)).name, started)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, parse_chat)

    return app
