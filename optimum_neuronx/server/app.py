"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

It tokenizes, checks and forwards requests to the engine process (worker.py), and turns each step's outputs into
responses or server-sent events. Admission is bounded: past the engine's slots plus its waiting queue a request gets
429 with Retry-After. A client that goes away cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from ..scheduler import InvalidRequest, Output, Request, check_request
from .metrics import ServerMetrics
from .protocol import (MAX_BODY_BYTES, RequestError, chat_body, check_fields, completion_body, error_body, new_id,
                       now, to_request, usage)
from .worker import EngineProcess

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class EngineClient:
    """The app's side of the engine: one asyncio queue per request in flight, fed by the engine's outputs."""

    def __init__(self, model: str, options: Optional[dict] = None, max_waiting: Optional[int] = None,
                 prefill_budget: Optional[int] = None):
        self.process = EngineProcess(model, options or {}, self._on_message, max_waiting=max_waiting,
                                     prefill_budget=prefill_budget)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.capacity = 0
        self.failed: Optional[str] = None
        self.metrics = ServerMetrics()

    def start(self) -> dict:
        info = self.process.start()
        self.capacity = info["slots"] + info["max_waiting"]
        return info

    def _on_message(self, message: tuple) -> None:  # the reader thread
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: tuple) -> None:  # the event loop
        kind = message[0]
        if kind == "outputs":
            outputs, (running, waiting) = message[1], message[2]
            self.metrics.running.set(running)
            self.metrics.waiting.set(waiting)
            for output in outputs:
                stream = self.streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)
        elif kind == "rejected":
            stream = self.streams.get(message[1])
            if stream is not None:
                busy = message[2] == "busy"
                stream.put_nowait(RequestError(message[3], message[4], 429 if busy else 400))
        elif kind == "failed":
            self.failed = message[1]
            logger.error("engine failed: %s", message[1])
            for stream in self.streams.values():
                stream.put_nowait(RuntimeError(f"the engine failed: {message[1]}"))

    async def generate(self, request: Request, http_request: Optional[HttpRequest] = None
                       ) -> AsyncIterator[Output]:
        """The outputs of `request` as the engine steps; cancelled if the client disconnects or the caller stops."""
        if self.loop is None:  # the loop the outputs are handed to (nothing is sent before the first request)
            self.loop = asyncio.get_running_loop()
        if self.failed:
            raise RequestError(f"the engine failed: {self.failed}", status=503)
        if len(self.streams) >= self.capacity:
            raise RequestError(f"{len(self.streams)} requests are running or waiting, this server's limit "
                               f"({self.capacity}: its slots plus its waiting queue); retry later.", status=429)
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request.request_id] = stream
        self.metrics.requests_in_flight.set(len(self.streams))
        arrived = previous = time.monotonic()
        finished = False
        self.process.add(request)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if http_request is not None and await http_request.is_disconnected():
                        return
                    continue
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.token_ids:
                    moment = time.monotonic()
                    if item.completion_tokens == len(item.token_ids):
                        self.metrics.time_to_first_token.observe(moment - arrived)
                    else:
                        self.metrics.inter_token_latency.observe(moment - previous)
                    previous = moment
                    self.metrics.generation_tokens.inc(len(item.token_ids))
                if item.finish_reason is not None:
                    finished = True
                    self.metrics.prompt_tokens.inc(item.prompt_tokens)
                    self.metrics.e2e_latency.observe(time.monotonic() - arrived)
                yield item
                if finished:
                    return
        finally:
            del self.streams[request.request_id]
            self.metrics.requests_in_flight.set(len(self.streams))
            if not finished:  # the client left, or the caller stopped reading: free the slot
                self.process.cancel(request.request_id)


def build_app(client: EngineClient, served_model_name: str, info: dict) -> FastAPI:
    """The FastAPI app over a started `client` (`info`: what its engine reported, EngineProcess.start)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info["directory"])
    sequence_length, vocab_size, eos_token_ids = info["sequence_length"], info["vocab_size"], info["eos_token_ids"]

    app = FastAPI(title="optimum-neuronx")
    app.state.client = client

    @app.exception_handler(RequestError)
    async def _refused(_, err: RequestError):
        client.metrics.requests.labels(status=str(err.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
        return JSONResponse(error_body(str(err), err.status, err.param), status_code=err.status, headers=headers)

    @app.get("/health")
    async def health():
        if client.failed or not client.process.alive:
            return JSONResponse({"status": "engine failed", "detail": client.failed}, status_code=503)
        return {"status": "ok", "pid": client.process.pid}

    @app.get("/metrics")
    async def metrics():
        body, content_type = client.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": now(),
                                            "owned_by": "optimum-neuronx", "max_model_len": sequence_length}]}

    async def body_of(http_request: HttpRequest, chat: bool) -> dict:
        declared = http_request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
            raise RequestError(f"the request body ({declared} bytes) is larger than this server takes "
                               f"({MAX_BODY_BYTES} bytes).", status=413)
        raw = bytearray()
        async for part in http_request.stream():  # a body sent without its length is cut off at the limit too
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise RequestError(f"the request body is larger than this server takes ({MAX_BODY_BYTES} bytes).",
                                   status=413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not JSON.") from None
        body = check_fields(body, chat)
        model = body.get("model")
        if model != served_model_name:
            raise RequestError(f"model: {model!r} is not served here; this server serves {served_model_name!r} "
                               f"(GET /v1/models).", "model")
        return body

    def request_of(body: dict, prompt_ids: list[int], request_id: str) -> Request:
        request = to_request(body, prompt_ids, eos_token_ids, max(sequence_length - len(prompt_ids), 1), request_id)
        try:
            check_request(request, sequence_length, vocab_size)
        except InvalidRequest as err:
            raise RequestError(str(err), err.field) from None
        return request

    @app.post("/v1/completions")
    async def completions(http_request: HttpRequest):
        body = await body_of(http_request, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt_ids = prompt
        else:
            raise RequestError("prompt: give one string or one list of token ids (one prompt per request).", "prompt")
        request = request_of(body, list(prompt_ids), new_id("cmpl"))
        return await respond(http_request, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HttpRequest):
        body = await body_of(http_request, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError("messages: give a non-empty list of {role, content} objects.", "messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("messages: this model's tokenizer has no chat template; use /v1/completions.",
                               "messages")
        conversation = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise RequestError("messages: only text content parts are supported.", "messages")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise RequestError(f"messages: the content of a {message['role']!r} message must be text.",
                                   "messages")
            conversation.append({"role": message["role"], "content": content})
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        request = request_of(body, list(prompt_ids), new_id("chatcmpl"))
        return await respond(http_request, request, body, chat=True)

    async def respond(http_request: HttpRequest, request: Request, body: dict, chat: bool):
        created, shape = now(), chat_body if chat else completion_body
        outputs = client.generate(request, http_request)
        first = await anext(outputs, None)  # a refusal (429, 400) raises here, before any response starts
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events():
                item, opened = first, False
                try:
                    while item is not None:
                        if chat and not opened:
                            opened = True
                            yield json.dumps(shape(request.request_id, served_model_name, "", None, created, True,
                                                   first=True))
                        if item.text or item.finish_reason:
                            yield json.dumps(shape(request.request_id, served_model_name, item.text,
                                                   item.finish_reason, created, True))
                        if item.finish_reason is not None:
                            if include_usage:
                                yield json.dumps({"id": request.request_id, "object": "chat.completion.chunk" if chat
                                                  else "text_completion", "created": created,
                                                  "model": served_model_name, "choices": [],
                                                  "usage": usage(item.prompt_tokens, item.completion_tokens)})
                            break
                        item = await anext(outputs, None)
                    yield "[DONE]"
                finally:
                    await outputs.aclose()

            client.metrics.requests.labels(status="200").inc()
            return EventSourceResponse(events())
        if first is None:  # the client went away before the first token
            return Response(status_code=499)
        text, item = [], first
        while item is not None:
            text.append(item.text)
            last = item
            item = await anext(outputs, None)
        if last.finish_reason is None:  # the client went away
            return Response(status_code=499)
        client.metrics.requests.labels(status="200").inc()
        result = shape(request.request_id, served_model_name, "".join(text), last.finish_reason, created)
        result["usage"] = usage(last.prompt_tokens, last.completion_tokens)
        return result

    return app
