"""The OpenAI API's request fields this server takes, checked into scheduler Requests, and its response bodies."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Optional

from ..scheduler import MAX_SEED, Request


class RequestError(ValueError):
    """A request this server refuses: the HTTP status, the field (OpenAI's `param`) and a message naming the limit."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# Fields a client may send that change nothing here at their default (None, or the value given), else a 400.
_ONLY_AT_DEFAULT = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                    "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0, "tools": None,
                    "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
                    "parallel_tool_calls": None, "repetition_penalty": 1, "min_tokens": 0, "min_p": 0,
                    "use_beam_search": False, "guided_json": None, "guided_regex": None, "guided_choice": None,
                    "prompt_logprobs": None}
# Fields that change nothing in what is generated.
_IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "include_stop_str_in_output",
            "skip_special_tokens", "spaces_between_special_tokens", "add_generation_prompt", "chat_template_kwargs"}
_TAKEN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stop", "temperature",
          "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"}


# Limits on what a request may carry: a request body, one stop string, the extra stop token ids.
MAX_BODY_BYTES = 8 << 20
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)) \
            or not math.isfinite(value):
        raise RequestError(f"{name}: {value!r} is not {'an integer' if kind is int else 'a finite number'}.", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{name}: {value!r}; it must be {bounds}.", name)
    return kind(value)


def check_fields(body: Any, chat: bool) -> dict:
    """The request body as a dict, refusing fields this server cannot honour (named in the error)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object.")
    for name, value in body.items():
        if name in _TAKEN or name in _IGNORED:
            continue
        if name in _ONLY_AT_DEFAULT:
            default = _ONLY_AT_DEFAULT[name]
            if value is not None and value != default and not (value is False and name == "logprobs"):
                if default is None:
                    raise RequestError(f"{name}: {value!r} is not supported by this server.", name)
                raise RequestError(f"{name}: {value!r} is not supported; this server takes {name}={default!r} only "
                                   f"(one completion per request, tokens only).", name)
            continue
        raise RequestError(f"{name}: unknown field for {'chat completions' if chat else 'completions'}.", name)
    return body


def to_request(body: dict, prompt_ids: list[int], eos_token_ids: tuple[int, ...], default_max_tokens: int,
               request_id: str) -> Request:
    """A scheduler Request from a checked body and its prompt's token ids."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, int, low=1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4 or any(len(s) > MAX_STOP_CHARS for s in stop)):
        raise RequestError(f"stop: {str(stop)[:100]!r}; give a string or a list of up to 4 non-empty strings of at "
                           f"most {MAX_STOP_CHARS} characters.", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError(f"stop_token_ids: {str(stop_ids)[:100]}; give a list of at most {MAX_STOP_TOKEN_IDS} "
                           f"token ids.", "stop_token_ids")
    top_k = _number(body, "top_k", 0, int, low=-1)
    seed = _number(body, "seed", None, int, low=0, high=MAX_SEED)
    eos = () if body.get("ignore_eos") else tuple(eos_token_ids)
    return Request(prompt=prompt_ids, max_tokens=max_tokens, request_id=request_id,
                   temperature=_number(body, "temperature", 1.0, low=0, high=2),
                   top_p=_number(body, "top_p", 1.0, low=0, high=1), top_k=max(top_k, 0), seed=seed,
                   stop_token_ids=eos + tuple(stop_ids), stop=tuple(stop or ()))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, text: str, finish: Optional[str], created: int,
                    chunk: bool = False) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_body(request_id: str, model: str, text: str, finish: Optional[str], created: int, chunk: bool = False,
              first: bool = False) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}]}


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError", 429: "RateLimitError",
             503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kinds.get(status, "InternalServerError"), "param": param,
                      "code": status}}


def now() -> int:
    return int(time.time())
