"""OpenAI's API as plain functions: request bodies to checked requests, engine events to
replies and stream chunks, and the error body. No HTTP and no event loop here: the server
(``ferrolm.app.serve``) reads a body, calls ``parse_completion`` (or ``chat_turns``, renders
the turns, then ``parse_chat``), submits each choice with ``sampling_params``, and writes what
``Reply`` or the ``*_chunk`` functions make of the engine's events.

A caller's mistake is an ``ApiError``: its HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field at fault.

Log-probabilities (completions' ``logprobs``: N and ``echo``; chat's ``logprobs`` and
``top_logprobs``) are the model's own distribution, log_softmax of its logits at temperature
1, whatever temperature, top_k or top_p the tokens were drawn with (as vLLM reports them by
default). A token shows as its text, or as ``bytes:\\xNN...`` when its bytes are not whole
UTF-8 characters (OpenAI's notation), so that distinct tokens have distinct strings.

Fields OpenAI defines and ferrolm does not implement are refused by name (400) away from
their neutral value; fields OpenAI does not define are ignored, and named in one log line.

This module imports neither torch nor Starlette at its top (the command line reads the
server's defaults without them); the engine's event classes load when first needed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = [
    "ApiError",
    "ModelInfo",
    "Request",
    "Reply",
    "parse_json",
    "COMPLETION_FIELDS",
    "CHAT_FIELDS",
    "check_body",
    "parse_completion",
    "chat_turns",
    "parse_chat",
    "sampling_params",
    "usage",
    "token_string",
    "echo_text",
    "prompt_entries",
    "completion_logprobs",
    "chat_logprobs",
    "response_head",
    "stream_head",
    "role_chunk",
    "event_chunk",
    "stream_bunch",
    "bunch_ends",
    "usage_chunk",
    "error_chunk",
    "http_error",
    "DONE",
]

MAX_STOP_STRINGS = 4
MAX_N = 64
MAX_CHOICES = 256  # n times the number of prompts, per request
MAX_JSON_DEPTH = 64  # nesting of a request body: OpenAI's shapes need a handful
TEMPERATURE_MAX = 2.0
TOP_K_MAX = 1 << 30
MAX_LOGPROBS = 20  # most likely tokens listed beside each token (OpenAI's limit for top_logprobs)
ROLES = ("system", "developer", "user", "assistant")
# OpenAI parameters accepted only at their neutral value (ferrolm does not implement them).
NEUTRAL = {
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "verbosity": (None,),
}
# OpenAI's fields that only label a request (no effect on its reply here): taken as they are.
LABELS = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls")
_SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream")
COMPLETION_FIELDS = frozenset((*_SAMPLING_FIELDS, *NEUTRAL, *LABELS, "prompt", "logprobs", "echo", "stream_options"))
CHAT_FIELDS = frozenset(
    (
        *_SAMPLING_FIELDS,
        *NEUTRAL,
        *LABELS,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream_options",
    )
)
log = logging.getLogger("ferrolm.serve")
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """A caller's mistake: an HTTP status and OpenAI's error body."""

    def __init__(
        self, message: str, param: Optional[str] = None, *, status: int = 400, code: Optional[str] = None, kind=None
    ):
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "message": message,
                "type": kind or ("invalid_request_error" if status < 500 else "server_error"),
                "param": param,
                "code": code,
            }
        }


def http_error(status: int, detail: str) -> ApiError:
    """The error for a route or method that does not exist (404, 405) or another HTTP failure."""
    return ApiError(detail, status=status, code={404: "not_found", 405: "method_not_allowed"}.get(status))


@dataclass(frozen=True)
class ModelInfo:
    """What checking a request needs to know of the served model."""

    name: str
    encode: Callable[[str], list[int]]
    eos_id: Optional[int]
    vocab_size: int
    context_length: int
    max_tokens_limit: int = 4096
    token_bytes: Optional[Callable[[int], bytes]] = None  # a token's bytes: for log-probabilities and echo


@dataclass
class Request:
    """A checked request: token-id prompts and how to sample each of their n choices."""

    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    seed: Optional[int]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: a usage chunk before DONE
    logprobs: Optional[int] = None  # None: none; else each token's and the N most likely
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the reply
    prompt_texts: Optional[list[Optional[str]]] = None  # each prompt as given, when a string
    token_bytes: Optional[Callable[[int], bytes]] = None
    offsets: list[int] = field(default_factory=list)  # a stream's text offset per choice, for logprobs

    def __post_init__(self) -> None:
        self.offsets = [0] * self.choices

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


# --------------------------------------------------------------------------------------
# The body
# --------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> Any:
    """The body's JSON; ApiError (400) when it is not JSON or nests past MAX_JSON_DEPTH (the
    parser recurses once per level, and so would the code that walks the value)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        depth = 0
        for token in _JSON_TOKENS.finditer(raw):
            run = token.group()
            if run[0] in b"[{":
                depth += len(run)
                if depth > MAX_JSON_DEPTH:
                    raise ApiError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            elif run[0] != ord('"'):
                depth -= len(run)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


# A string (to its closing quote, or the end of an unterminated one: each byte is scanned
# once), or a run of opening or of closing brackets.
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[{]+|[\]}]+', re.DOTALL)


def check_body(body: Any, model_name: str, fields: Optional[frozenset] = None) -> dict:
    """The parsed body, checked as an object naming the served model and asking for nothing
    this server does not do (the NEUTRAL parameters away from their neutral value). Names
    outside ``fields`` (OpenAI's for the route) are ignored and logged."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError("model must be a string naming the served model (see GET /v1/models)", "model")
    if model != model_name:
        raise ApiError(
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    for name, allowed in NEUTRAL.items():
        if name in body and body[name] not in allowed:
            raise ApiError(f"{name} is not supported by this server", name, code="unsupported_parameter")
    unknown = [name for name in body if name not in fields] if fields is not None else []
    if unknown:
        # Names cut short and escaped (repr): a body's keys must not make the log huge or forge lines.
        names = ", ".join(repr(name[:64]) for name in unknown[:20]) + (", ..." if len(unknown) > 20 else "")
        log.warning("ignored fields that OpenAI's API does not define: %s", names)
    return body


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    x = body.get(name)
    if x is None:
        return default
    finite = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not finite or x > high or x < low or (low_open and x == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ApiError(f"{name} must be a number in {interval}, got {json.dumps(x)}", name)
    return float(x)


def _int(body: dict, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    x = body.get(name)
    if x is None:
        return default
    if not _is_int(x) or not low <= x <= high:
        raise ApiError(f"{name} must be an integer in [{low}, {high}], got {json.dumps(x)}", name)
    return x


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in stop if s)


# --------------------------------------------------------------------------------------
# Prompts and sampling settings
# --------------------------------------------------------------------------------------


def _encode(text: str, param: str, info: ModelInfo) -> list[int]:
    ids = info.encode(text)
    if not ids:
        if info.eos_id is None:
            raise ApiError("an empty prompt starts from the end-of-text token, which this tokenizer lacks", param)
        ids = [info.eos_id]  # a new document, as `ferrolm generate --prompt ''` starts
    return ids


def _check_ids(ids: list, param: str, info: ModelInfo) -> list[int]:
    if not ids:
        raise ApiError("a prompt of token ids must hold at least one id", param)
    for t in ids:
        if not _is_int(t) or not 0 <= t < info.vocab_size:
            raise ApiError(
                f"token id {json.dumps(t)} is outside the model's vocabulary [0, {info.vocab_size})",
                param,
                code="invalid_token_id",
            )
    return ids


def _completion_prompts(prompt: Any, info: ModelInfo) -> tuple[list[list[int]], list[Optional[str]]]:
    """The four shapes of ``prompt``: a string, strings, ids, lists of ids; and each prompt's
    string (None for ids)."""
    if isinstance(prompt, str):
        return [_encode(prompt, "prompt", info)], [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_encode(p, "prompt", info) for p in prompt], list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [_check_ids(p, "prompt", info) for p in prompt], [None] * len(prompt)
        if all(not isinstance(p, (list, str)) for p in prompt):
            return [_check_ids(prompt, "prompt", info)], [None]
    raise ApiError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of ids", "prompt"
    )


def _sampling(
    body: dict, prompts: list[list[int]], param: str, default_max: int, info: ModelInfo, template_stop=(), *, echo=False
) -> Request:
    for ids in prompts:
        if len(ids) > info.context_length:
            raise ApiError(
                f"the prompt is {len(ids)} tokens; the model's context is {info.context_length}",
                param,
                code="context_length_exceeded",
            )
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, default_max, 0 if echo else 1, info.max_tokens_limit)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError("stream must be a boolean", "stream")
    include_usage = _include_usage(body.get("stream_options"), bool(stream))
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(f"seed must be an integer, got {json.dumps(seed)}", "seed")
    stop = _stop_strings(body)
    top_k = _int(body, "top_k", None, 1, TOP_K_MAX)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    n = _int(body, "n", 1, 1, MAX_N)
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(f"n times the number of prompts must be at most {MAX_CHOICES}", "n")
    return Request(
        prompts=prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX),
        top_k=top_k,
        top_p=None if top_p >= 1.0 else top_p,
        seed=None if seed is None else seed % (1 << 63),
        stop=tuple(dict.fromkeys((*stop, *template_stop))),  # the caller's, then the template's
        stream=bool(stream),
        include_usage=include_usage,
        echo=echo,
        token_bytes=info.token_bytes,
    )


def _include_usage(options: Any, stream: bool) -> bool:
    """``stream_options.include_usage``, as OpenAI checks it: options only with a stream;
    other keys of the object are left alone."""
    if options is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return include


def parse_completion(body: Any, info: ModelInfo) -> Request:
    """A /v1/completions body, checked (max_tokens defaults to 16, as OpenAI's; 0 with echo:
    the prompt alone, how lm-eval's local-completions scores log-likelihoods)."""
    body = check_body(body, info.name, COMPLETION_FIELDS)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(f"echo must be a boolean, got {json.dumps(echo)}", "echo")
    prompts, texts = _completion_prompts(body.get("prompt"), info)
    req = _sampling(body, prompts, "prompt", 16, info, echo=bool(echo))
    req.logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    req.prompt_texts = texts
    return req


def _chat_logprobs(body: dict) -> Optional[int]:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0 to MAX_LOGPROBS, with logprobs
    only) as one count: None when not asked."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise ApiError(f"logprobs must be a boolean, got {json.dumps(on)}", "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not on:
        raise ApiError("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if on else None


def chat_turns(body: Any, info: ModelInfo) -> list[dict[str, str]]:
    """A /v1/chat/completions body's messages as the chat template takes them: {role, content}
    strings, text parts joined, "developer" as "system"."""
    body = check_body(body, info.name, CHAT_FIELDS)
    _chat_logprobs(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] must be an object with a role among {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", "messages")
        turns.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return turns


def parse_chat(body: dict, prompt: str, info: ModelInfo, template_stop: tuple[str, ...] = ()) -> Request:
    """A chat body (checked by ``chat_turns``) whose turns rendered to ``prompt``; the reply may
    run to the model's context by default, and also ends at the template's own stop strings."""
    req = _sampling(body, [_encode(prompt, "messages", info)], "messages", info.context_length, info, template_stop)
    req.logprobs = _chat_logprobs(body)
    return req


def sampling_params(req: Request, j: int):
    """The engine's settings for choice ``j`` of each prompt: choice j is sampled with seed + j."""
    from ferrolm.lm.engine import SamplingParams

    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=None if req.seed is None else (req.seed + j) % (1 << 63),
        stop=req.stop,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if req.echo else None,
    )


# --------------------------------------------------------------------------------------
# Replies and stream chunks
# --------------------------------------------------------------------------------------


@functools.cache
def _event_classes() -> tuple[type, type, type, type]:
    """The engine's events (Piece, Finished, Failed, PromptLogprobs), imported at the first
    one: the engine's module needs torch."""
    from ferrolm.lm.engine import Failed, Finished, Piece, PromptLogprobs

    return Piece, Finished, Failed, PromptLogprobs


def usage(req: Request, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(ids) for ids in req.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_head(model_name: str, chat: bool) -> dict:
    """The fields every reply and chunk of one request share (a fresh id)."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    return {"id": rid, "object": "", "created": int(time.time()), "model": model_name}


# --------------------------------------------------------------------------------------
# Log-probabilities and echo
# --------------------------------------------------------------------------------------


def _token_bytes(req: Request, token: int) -> bytes:
    return req.token_bytes(token) if req.token_bytes is not None else b""


def token_string(raw: bytes) -> str:
    """A token as the API shows it: its text, or OpenAI's ``bytes:\\xNN`` form for bytes
    that are not whole UTF-8 characters (so two tokens never share a string)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def echo_text(req: Request, index: int) -> str:
    """What echo puts before choice ``index``'s text: its prompt as given, or its ids' text."""
    p = index // req.n
    given = req.prompt_texts[p] if req.prompt_texts else None
    if given is not None:
        return given
    return b"".join(_token_bytes(req, t) for t in req.prompts[p]).decode("utf-8", errors="replace")


def prompt_entries(req: Request, index: int, event: Any) -> list:
    """A PromptLogprobs event of choice ``index`` as log-probability entries: the prompt's
    first token (None: nothing predicts it), then the event's."""
    return [req.prompts[index // req.n][0], *event.logprobs]


def completion_logprobs(req: Request, entries: list, offset: int = 0) -> tuple[dict, int]:
    """Completions' ``logprobs`` object for ``entries`` (TokenLogprob, or a bare token id that
    has none), its text offsets from ``offset``; and the offset after them. Each token's top
    holds the N most likely and the token itself, as OpenAI lists them."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        token = e if isinstance(e, int) else e.token
        raw = _token_bytes(req, token)
        text = token_string(raw)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(raw.decode("utf-8", errors="replace"))
        if isinstance(e, int):
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(e.logprob)
        top: dict = {}
        for t, lp in (*e.top, (e.token, e.logprob)):
            top.setdefault(token_string(_token_bytes(req, t)), lp)  # the likelier of two that read the same
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(req: Request, entries: list) -> dict:
    """Chat's ``logprobs`` object: ``content``, one entry a token with its top_logprobs."""

    def one(token: int, lp: float) -> dict:
        raw = _token_bytes(req, token)
        return {"token": token_string(raw), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


# --------------------------------------------------------------------------------------
# Replies and stream chunks
# --------------------------------------------------------------------------------------


class Reply:
    """A whole (not streamed) reply, built up from the engine's (choice index, event) pairs."""

    def __init__(self, req: Request):
        self.req = req
        self.texts = [""] * req.choices
        self.reasons: list[Optional[str]] = [None] * req.choices
        self.logprobs: list[list] = [[] for _ in range(req.choices)]
        self.completion_tokens = 0

    def add(self, index: int, event: Any) -> None:
        piece, _, _, prompt = _event_classes()
        if isinstance(event, piece):
            self.texts[index] += event.text
            self.logprobs[index] += event.logprobs
        elif isinstance(event, prompt):
            self.logprobs[index][:0] = prompt_entries(self.req, index, event)
        else:
            self.reasons[index] = event.reason
            self.completion_tokens += event.completion_tokens

    def _choice(self, i: int, chat: bool) -> dict:
        text, reason, want = self.texts[i], self.reasons[i], self.req.logprobs is not None
        if chat:
            lp = chat_logprobs(self.req, self.logprobs[i]) if want else None
            return {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": reason,
            }
        if self.req.echo:
            text = echo_text(self.req, i) + text
        lp = completion_logprobs(self.req, self.logprobs[i])[0] if want else None
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    def body(self, head: dict, chat: bool) -> dict:
        choices = [self._choice(i, chat) for i in range(self.req.choices)]
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": choices, "usage": usage(self.req, self.completion_tokens)}


def stream_head(head: dict, chat: bool, req: Optional[Request] = None) -> dict:
    """The fields every chunk of a stream carries; with ``include_usage``, ``"usage": null``
    (the last chunk before DONE holds the counts), as OpenAI sends them."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    return {**head, "usage": None} if req is not None and req.include_usage else head


def _chunk(head: dict, choices: list, **extra) -> bytes:
    return b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n"


def _choice(
    chat: bool, index: int, text: Optional[str], reason: Optional[str] = None, first: bool = False, logprobs=None
) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}


def role_chunk(head: dict, req: Request, chat: bool) -> bytes:
    """What a stream opens with: for chat, each choice's role; for completions that echo
    without log-probabilities, each choice's prompt (with them, the prompt goes out with its
    log-probabilities when the engine has them)."""
    if chat:
        return _chunk(head, [_choice(True, i, None, first=True) for i in range(req.choices)])
    if req.echo and req.logprobs is None:
        return b"".join(_chunk(head, [_choice(False, i, echo_text(req, i))]) for i in range(req.choices))
    return b""


def event_chunk(head: dict, index: int, event: Any, chat: bool, req: Optional[Request] = None) -> bytes:
    """One chunk for one engine event of choice ``index``: a piece of text (with its tokens'
    log-probabilities when ``req`` asks), an echoed prompt, or its end (the finish reason and
    no text). A failure is not a chunk: it raises ApiError (500)."""
    piece, _, failed, prompt = _event_classes()
    want = req is not None and req.logprobs is not None
    if isinstance(event, piece):
        lp = None
        if want and chat:
            lp = chat_logprobs(req, list(event.logprobs))
        elif want:
            lp, req.offsets[index] = completion_logprobs(req, list(event.logprobs), req.offsets[index])
        return _chunk(head, [_choice(chat, index, event.text, logprobs=lp)])
    if isinstance(event, prompt):
        lp, req.offsets[index] = completion_logprobs(req, prompt_entries(req, index, event))
        return _chunk(head, [_choice(chat, index, echo_text(req, index), logprobs=lp)])
    if isinstance(event, failed):
        raise ApiError(event.message, status=500, kind="server_error")
    return _chunk(head, [_choice(chat, index, None, event.reason)])


def stream_bunch(
    head: dict, bunch: list[tuple[int, Any]], chat: bool, req: Optional[Request] = None
) -> tuple[bytes, int]:
    """The chunks of a bunch of (choice index, event) pairs, one a piece as OpenAI sends them,
    joined for one write; and the completion tokens of the choices that ended in it."""
    finished = _event_classes()[1]
    tokens = 0
    chunks = []
    for index, event in bunch:
        chunks.append(event_chunk(head, index, event, chat, req))
        if isinstance(event, finished):
            tokens += event.completion_tokens
    return b"".join(chunks), tokens


def bunch_ends(bunch: list[tuple[int, Any]]) -> int:
    """How many choices end in a bunch of (choice index, event) pairs; ApiError (500) for a
    choice the engine failed, before any of the bunch goes out."""
    _, finished, failed, _ = _event_classes()
    ends = 0
    for _, event in bunch:
        if isinstance(event, failed):
            raise ApiError(event.message, status=500, kind="server_error")
        ends += isinstance(event, finished)
    return ends


def usage_chunk(head: dict, req: Request, completion_tokens: int) -> bytes:
    """The last chunk before DONE of a stream that asked for it (``include_usage``): no
    choices, the usage counts. A stream that did not ask ends without it, so every chunk it
    sends has a choice (clients read ``chunk.choices[0]``)."""
    return _chunk(head, [], usage=usage(req, completion_tokens))


def error_chunk(error: ApiError) -> bytes:
    """An error met mid-stream (the status has gone out): the error body as the last event."""
    return b"data: " + json.dumps(error.body).encode() + b"\n\n"
