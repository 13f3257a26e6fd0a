"""OpenAI-compatible HTTP API over the mesh (aiohttp): what ``meshinfer serve`` runs.

Endpoints (see docs/api.md): ``POST /v1/chat/completions`` (JSON or server-sent events),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /v1/mesh`` (peers, coverage, routes: the
page's mesh view, :mod:`meshinfer.app.meshview`) and the page itself at ``/`` (``meshinfer/web/``). Each completion is one conversation on a
route planned through :mod:`meshinfer.app.reply`, the same path as ``meshinfer chat``; it is
closed on every hop when the reply ends, fails, or its HTTP client goes away.

A model's id is the name of a known model (``meshinfer pull`` names) whose sha256 equals the
weights hash peers advertise, else ``sha256-`` and the first 16 hex digits of that hash.
Requests may also name a model by its full weights hash.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
nothing a request sends stops the server.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from meshinfer.core.errors import (CacheFull, ContextOverflow, IncompatibleDraft, IncompatiblePeer,
    InvalidInput, MeshError, NoRoute, PeerUnavailable, RateLimited, Unauthenticated)
from meshinfer.app.meshview import MeshView
from meshinfer.app.reply import check_prompt_fits, model_id, plan_for, reply
from meshinfer.client.routing import Route, complete_routes_summary
from meshinfer.core.sampling_params import SEED_MODULUS, SamplingParams
from meshinfer.client.conversation import Conversation
from meshinfer.client.mesh import MeshClient
from meshinfer.wire.discovery import host_key
from meshinfer.text.template import CHAT_ROLES, ROLE_ALIASES
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.text.toolcalls import ToolCallStream

log = logging.getLogger(__name__)

#: Tokens generated at most when a request gives neither ``max_tokens`` nor ``max_completion_tokens``.
DEFAULT_MAX_TOKENS = 512
#: Largest ``max_tokens`` accepted; the model's context (checked by the peers) is usually smaller.
MAX_TOKENS_LIMIT = 1 << 20
#: Default most chat requests in flight from one client address (``serve --max-requests-per-client``):
#: each holds a conversation on every hop, and a peer allows 64 per client host (the server's),
#: so a few HTTP users cannot take them all.
DEFAULT_MAX_REQUESTS_PER_CLIENT = 8
#: Seconds a planned route (and the peer table behind ``/v1/models``) is reused before replanning.
ROUTE_TTL_S = 30.0
#: Largest request body, bytes; a larger one gets 413 ``request_too_large`` naming the limit.
MAX_BODY_BYTES = 4 << 20
#: Most bytes of chat request bodies (by ``Content-Length``) one client address may have in flight
#: at once: one body as large as :data:`MAX_BODY_BYTES`. Beyond it, 429 ``too_many_requests``. A
#: 4 MB prompt costs hundreds of MB and seconds of a core to encode; eight at once cost GBs.
MAX_BODY_BYTES_IN_FLIGHT = MAX_BODY_BYTES
#: After a request whose body held at least this many bytes, the C heap is trimmed
#: (``malloc_trim``, glibc): encoding a 4 MB prompt takes hundreds of MB in the tokenizer's
#: worker thread, which glibc would otherwise keep in that thread's arena for good.
TRIM_AFTER_BODY_BYTES = 1 << 20
#: Seconds a request body may take to arrive once its headers have; then 408.
BODY_TIMEOUT_S = 30.0
#: Seconds a connection has to send complete request headers, which is also how long an idle
#: keep-alive connection is kept (aiohttp's ``keepalive_timeout``, whose own default is an hour):
#: a connection that never finishes its headers (slowloris) is closed after it.
HEADERS_TIMEOUT_S = 15.0
#: Default most connections one client address may hold open at once (``serve
#: --max-connections-per-client``); more are answered 503 and closed. Browsers open up to 6; the
#: default leaves room for a few dozen users behind one NAT and keeps one address far below the
#: 1,024 open files a process often gets.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
#: Seconds a refused connection is kept (reading and dropping what it sends) so that its client
#: reads the 503 instead of a reset.
REFUSED_LINGER_S = 1.0
#: Most stop sequences per request (OpenAI's limit).
MAX_STOP_SEQUENCES = 4
#: Roles a message may have: the chat roles and their OpenAI aliases (``developer``, OpenAI's newer
#: name for ``system``, is sent as ``system``).
ROLES = (*CHAT_ROLES, *ROLE_ALIASES)
#: Most tool definitions per request (OpenAI's limit).
MAX_TOOLS = 128
#: What a function's name may be (OpenAI's rule): letters, digits, ``_`` and ``-``, 1 to 64 of them.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The page's files (``meshinfer/web/``, shipped as package data) by URL path, with their types.
PAGE_FILES = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
              "/style.css": ("style.css", "text/css")}
#: Headers of the page's files: nothing but this server's own scripts, styles and requests runs
#: (a reply or a peer address that slipped past escaping still cannot run script), no framing.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class ApiError(Exception):
    """An HTTP error in OpenAI's format.

    Args:
        status: the HTTP status (400, 401, 404, 429, 500, 502, 503).
        message: one line saying what is wrong and what to do.
        type: OpenAI error type (``invalid_request_error``, ``server_error`` ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        retry_after_s: seconds to send as ``Retry-After`` (RFC 9110, 10.2.3), or None.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def mesh_error(exc: MeshError) -> ApiError:
    """The HTTP error for a mesh failure: 400 for the request's fault, 429, 503 or 502 otherwise."""
    if isinstance(exc, ContextOverflow):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, IncompatibleDraft):  # the server's --draft-model, not the request, is at fault
        return ApiError(500, str(exc), type="server_error", code=exc.code)
    if isinstance(exc, InvalidInput):
        return ApiError(400, str(exc), param="messages", code=exc.code)
    if isinstance(exc, RateLimited):
        return ApiError(429, str(exc), type="rate_limit_error", code=exc.code)
    if isinstance(exc, (NoRoute, PeerUnavailable, CacheFull, Unauthenticated, IncompatiblePeer)):
        return ApiError(503, f"the mesh cannot serve this request now: {exc}", type="server_error",
                        code=exc.code)
    return ApiError(502, f"a peer failed: {exc}", type="server_error", code=getattr(exc, "code", "mesh_error"))


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body.

    Attributes:
        model: the model id asked for.
        messages: ``[{"role", "content"}]`` with text content only; an assistant message may add
            ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``
            with ``arguments`` decoded to a dict, the form chat templates expect), a ``tool``
            message adds ``tool_call_id``.
        max_tokens: tokens to generate at most, or None (the server's default).
        sampling: None for greedy (temperature absent or 0), else the parameters with a seed.
        stop: stop sequences (non-empty), at most :data:`MAX_STOP_SEQUENCES`.
        stream: answer with server-sent events.
        include_usage: (streaming) send a last chunk with ``usage``.
        tools: the tool definitions as sent (``[{"type": "function", "function": {...}}]``), or
            None (absent or empty).
        tool_choice: ``"auto"`` (the model may call tools; its calls are parsed) or ``"none"``
            (the tools are not rendered and the reply is plain text).
        parallel_tool_calls: False keeps only the first call of a reply.
        tool_field: the first request field that needs the template's tool support
            (``tools``, ``messages[i].tool_calls``, ``messages[i].role``), or None.
    """

    model: str
    messages: list[dict]
    max_tokens: int | None
    sampling: SamplingParams | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: list[dict] | None = None
    tool_choice: str = "none"
    parallel_tool_calls: bool = True
    tool_field: str | None = None

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools the template renders: None with ``tool_choice`` "none"."""
        return self.tools if self.tool_choice == "auto" else None


def _number(body: dict, key: str, *, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {what} in [{lo:g}, {hi:g}], got {json.dumps(value)[:40]}",
                       param=key, code="invalid_value")
    return value


def _content(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if isinstance(content, str):
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON may spell a lone surrogate ("\ud800"); no tokenizer takes it
            raise ApiError(400, f"messages[{i}].content is not valid Unicode: {exc.reason} at character {exc.start}",
                           param=f"messages[{i}].content", code="invalid_value") from None
        return content
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts "
                        f"(images, audio and files are not supported)", param=f"messages[{i}].content")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        if m.get("function_call"):  # refused, never silently dropped
            raise ApiError(400, f"messages[{i}].function_call is the deprecated form of tool calls, which "
                                f"meshinfer does not read; send tool_calls (see docs/api.md)",
                           param=f"messages[{i}].function_call", code="unsupported_parameter")
        role = ROLE_ALIASES.get(m["role"], m["role"])
        message = {"role": role, "content": _content(m, i)}
        if m.get("tool_calls"):  # [] is no calls
            if role != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls: only an assistant message may have tool calls",
                               param=f"messages[{i}].tool_calls")
            message["tool_calls"] = _history_calls(m["tool_calls"], i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(400, f"messages[{i}].tool_call_id must be the id of the tool call this message "
                                    f"answers", param=f"messages[{i}].tool_call_id")
            _check_unicode(call_id, f"messages[{i}].tool_call_id")
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def _check_unicode(value: Any, param: str) -> None:
    """Refuse JSON data holding a lone surrogate (JSON may spell "\\ud800"; no tokenizer takes it).

    Raises:
        ApiError: 400 ``invalid_value`` naming ``param``.
    """
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid Unicode: {exc.reason}", param=param, code="invalid_value") from None


def _history_calls(value: Any, i: int) -> list[dict]:
    """An assistant message's ``tool_calls``, with each call's ``arguments`` (JSON text) decoded
    to the object chat templates render (``tool_call.arguments | tojson`` in Qwen2.5's)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise ApiError(400, f"{where} must be a list of tool calls", param=where)
    _check_unicode(value, where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                                f"{{\"name\", \"arguments\"}}}}", param=f"{where}[{j}]")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{where}[{j}].function.arguments must be a JSON object encoded as a string, "
                                f"got {json.dumps(fn.get('arguments'))[:60]}", param=f"{where}[{j}].function.arguments",
                           code="invalid_value")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _tools(value: Any) -> list[dict] | None:
    """The request's ``tools``, as sent (the template renders them as they are), or None when absent or empty."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    _check_unicode(value, "tools")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                f"\"description\", \"parameters\"}}}}", param=f"tools[{j}]")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ApiError(400, f"tools[{j}].function.name must be 1 to 64 letters, digits, '_' or '-', got "
                                f"{json.dumps(name)[:80]}", param=f"tools[{j}].function.name", code="invalid_value")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object")):
            if key in fn and not isinstance(fn[key], kind):
                raise ApiError(400, f"tools[{j}].function.{key} must be {what}", param=f"tools[{j}].function.{key}")
    return value


def _tool_choice(body: dict, tools: list[dict] | None) -> str:
    """``"auto"`` or ``"none"``; the default is "auto" with tools, "none" without."""
    value = body.get("tool_choice")
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none"):
        return value if tools else "none"
    if value == "required" or isinstance(value, dict):
        raise ApiError(400, f"'tool_choice' = {json.dumps(value)[:80]} is not supported by meshinfer: it cannot force "
                            f"a call (no constrained decoding); send \"auto\" or \"none\" (see docs/api.md)",
                       param="tool_choice", code="unsupported_parameter")
    raise ApiError(400, f"'tool_choice' must be \"auto\" or \"none\", got {json.dumps(value)[:80]}",
                   param="tool_choice", code="invalid_value")


def _tool_field(messages: list[dict], tools: list[dict] | None) -> str | None:
    """The first field of the request that only a template with tool support can render."""
    if tools:
        return "tools"
    for i, m in enumerate(messages):
        if "tool_calls" in m:
            return f"messages[{i}].tool_calls"
        if m["role"] == "tool":
            return f"messages[{i}].role"
    return None


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} strings",
                       param="stop")
    return tuple(s for s in stops if s)


def _unsupported(body: dict) -> None:
    """Refuse fields whose meaning the mesh cannot honour (rather than silently ignore them)."""
    checks = [("n", lambda v: v in (None, 1)), ("logprobs", lambda v: not v), ("top_logprobs", lambda v: v is None),
              ("functions", lambda v: not v), ("logit_bias", lambda v: not v),
              ("presence_penalty", lambda v: v in (None, 0)), ("frequency_penalty", lambda v: v in (None, 0)),
              ("response_format", lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"))]
    for key, ok in checks:
        if not ok(body.get(key)):
            raise ApiError(400, f"'{key}' = {json.dumps(body.get(key))[:60]} is not supported by meshinfer "
                                f"(see docs/api.md)", param=key, code="unsupported_parameter")


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a decoded chat-completions body.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must name a model (GET /v1/models lists them)", param="model")
    messages = _messages(body.get("messages"))
    _unsupported(body)
    max_tokens = _number(body, "max_completion_tokens", lo=1, hi=MAX_TOKENS_LIMIT, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", lo=1, hi=MAX_TOKENS_LIMIT, integer=True)
    temperature = _number(body, "temperature", lo=0, hi=2) or 0.0
    top_p = _number(body, "top_p", lo=0, hi=1)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be above 0", param="top_p", code="invalid_value")
    seed = _number(body, "seed", lo=-(1 << 63), hi=(1 << 64) - 1, integer=True)
    sampling = None
    if temperature > 0:
        seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p or 1.0),
                                  seed=seed % SEED_MODULUS)
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(400, "'stream' must be true or false and 'stream_options' an object", param="stream")
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    return ChatRequest(model=model, messages=messages, max_tokens=max_tokens, sampling=sampling,
                       stop=_stop(body.get("stop")), stream=stream,
                       include_usage=bool(options.get("include_usage")), tools=tools,
                       tool_choice=_tool_choice(body, tools), parallel_tool_calls=parallel is not False,
                       tool_field=_tool_field(messages, tools))


# --------------------------------------------------------------------------- models and routes
class MeshModels:
    """The models a mesh serves and a cached route (with tokenizer) to each.

    Args:
        client: the :class:`MeshClient` (owned by the caller).
        route_ttl_s: seconds a route and the peer table are reused before planning again.
    """

    def __init__(self, client: MeshClient, *, route_ttl_s: float = ROUTE_TTL_S) -> None:
        self.client, self.route_ttl_s = client, route_ttl_s
        self._table_at = -float("inf")
        self._routes: dict[str, tuple[float, Route, Tokenizer]] = {}
        self._inflight: dict[str, asyncio.Future] = {}  # "table" or a weights hash -> its refresh or plan

    async def _once(self, key: str, work) -> Any:
        """``await work()``, or, while a call with the same ``key`` runs, its outcome. No lock is
        held across the dials: listing models never waits behind a route being planned.
        Cancelling the caller that runs ``work`` fails the callers sharing it (``PeerUnavailable``)."""
        fut = self._inflight.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self._inflight[key] = asyncio.get_running_loop().create_future()
        try:
            result = await work()
            fut.set_result(result)
            return result
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else PeerUnavailable("planning was cancelled"))
            fut.exception()  # retrieved: a caller may have gone
            raise
        finally:
            del self._inflight[key]

    async def _refresh(self) -> None:
        await self.client.refresh()
        self._table_at = time.monotonic()

    async def _plan(self, weights_hash: str) -> tuple[float, Route, Tokenizer]:
        route, tok = await plan_for(self.client, weights_hash=weights_hash)
        self._routes[weights_hash] = (time.monotonic(), route, tok)
        self._table_at = time.monotonic()
        return self._routes[weights_hash]

    async def models(self) -> list[dict]:
        """OpenAI model objects, one per weights identity in the peer table.

        Raises:
            PeerUnavailable, Unauthenticated: no bootstrap peer answered.
        """
        if time.monotonic() - self._table_at > self.route_ttl_s:
            await self._once("table", self._refresh)
        peers = list(self.client.table.values())
        complete = {g.route.compat_key[0] for g in complete_routes_summary(peers) if g.route is not None}
        out: dict[str, dict] = {}
        for ad in sorted(peers, key=lambda a: a.peer_id):
            m = out.setdefault(ad.weights_hash, {
                "id": model_id(ad.weights_hash), "object": "model", "created": 0, "owned_by": "meshinfer",
                "meshinfer": {"weights_hash": ad.weights_hash, "architecture": ad.architecture,
                              "num_layers": ad.num_layers, "peers": 0,
                              "complete_route": ad.weights_hash in complete}})
            m["meshinfer"]["peers"] += 1
        return list(out.values())

    async def find(self, name: str) -> dict:
        """The model object whose id (or full weights hash) is ``name``.

        Raises:
            ApiError: 404 ``model_not_found``.
        """
        for m in await self.models():
            if name in (m["id"], m["meshinfer"]["weights_hash"]):
                return m
        raise ApiError(404, f"the model '{name[:100]}' does not exist on this mesh; GET /v1/models lists "
                            f"the models it serves", param="model", code="model_not_found")

    async def route(self, weights_hash: str) -> tuple[Route, Tokenizer]:
        """A recent route to ``weights_hash`` and its tokenizer, planned when none is fresh or
        one of its hops has left the peer table or stopped answering pings since.

        Raises:
            NoRoute, PeerUnavailable, IncompatiblePeer: see :func:`meshinfer.app.reply.plan_for`.
        """
        cached = self._routes.get(weights_hash)
        if cached is not None and not all(p in self.client.table and p in self.client.rtts_ms
                                          for p in cached[1].peer_ids):
            cached = None  # a later refresh (the page's GET /v1/mesh) saw a hop leave or stop answering
        if cached is None or time.monotonic() - cached[0] > self.route_ttl_s:
            cached = await self._once(weights_hash, lambda: self._plan(weights_hash))
        return cached[1], cached[2]

    def forget(self, weights_hash: str) -> None:
        """Plan again next time (the route failed)."""
        self._routes.pop(weights_hash, None)


# --------------------------------------------------------------------------- tool calls
def _check_tool_support(req: ChatRequest, tok: Tokenizer, model: str) -> None:
    """Refuse tools, tool calls and tool messages for a template that cannot render them.

    Raises:
        ApiError: 400 ``unsupported_parameter`` naming the first such field.
    """
    if req.tool_field is not None and not tok.supports_tools:
        raise ApiError(400, f"{req.tool_field}: the chat template of {model} does not support tools (it never uses "
                            f"a 'tools' variable, or does not ask for <tool_call> blocks, the one tool-call format "
                            f"meshinfer reads), so tools, tool calls and tool messages cannot be given to this model; "
                            f"use a model whose template supports them, such as qwen2.5-coder-0.5b-instruct-q4_k_m",
                       param=req.tool_field, code="unsupported_parameter")


def _tool_stream(req: ChatRequest) -> ToolCallStream | None:
    """The parser of the reply's tool calls, or None when the request offers no tools to call."""
    if req.prompt_tools is None:
        return None
    return ToolCallStream(names=frozenset(t["function"]["name"] for t in req.prompt_tools),
                          max_calls=None if req.parallel_tool_calls else 1)


def _finish_with_calls(finish: str) -> str:
    """The finish reason of a reply that made calls: ``tool_calls``, unless ``max_tokens`` cut it."""
    return "tool_calls" if finish == "stop" else finish


# --------------------------------------------------------------------------- server
def _trim_heap() -> None:
    """Give free C heap memory back to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None  # glibc's malloc_trim once looked up; False where there is none


def _drop(counts: dict[str, int], key: str, n: int) -> None:
    """Take ``n`` off ``counts[key]``, forgetting the key at 0."""
    left = counts.pop(key) - n
    if left > 0:
        counts[key] = left


class _Doorman(asyncio.Protocol):
    """The protocol of one accepted connection: counts it against its address's limit
    (:meth:`ApiServer._admit`) and hands it to aiohttp's request handler, or answers 503 and
    closes it (after :data:`REFUSED_LINGER_S`, reading and dropping what it sends meanwhile, so that
    the client reads the answer rather than a reset)."""

    def __init__(self, api: "ApiServer", handlers) -> None:
        self.api, self.handlers = api, handlers
        self.inner: asyncio.Protocol | None = None
        self.addr = "?"

    def connection_made(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        self.addr = host_key(str(peer[0])) if peer else "?"
        if self.api._admit(self.addr):
            self.inner = self.handlers()
            self.inner.connection_made(transport)
            return
        limit = self.api.max_connections_per_client
        body = ApiError(503, f"{self.addr} already holds {limit} connections to this server, the most one client "
                             f"may hold; close some and retry", type="server_error",
                        code="too_many_connections").body()
        data = json.dumps(body).encode()
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.inner.connection_lost(exc)
            self.api._release(self.addr)


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _usage(result) -> dict:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-format error; unexpected ones are logged as 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:  # unknown path, wrong method, body too large
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        if exc.status == 413:
            return ApiError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes "
                                 f"({MAX_BODY_BYTES >> 20} MiB)", code=code).response()
        return ApiError(exc.status, f"{request.method} {request.path[:200]}: {exc.reason}", code=code).response()
    except MeshError as exc:
        return mesh_error(exc).response()
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, "internal server error (see the server log)", type="server_error").response()


class ApiServer:
    """The OpenAI-compatible HTTP server over a mesh.

    Args:
        client: an open :class:`MeshClient`; the server uses it and does not close it.
        host, port: where to listen (port 0: the OS picks; see :attr:`port` after :meth:`start`).
        api_key: when set, requests must send ``Authorization: Bearer <api_key>`` (else 401).
        default_max_tokens: tokens generated when a request gives no ``max_tokens``.
        route_ttl_s: see :class:`MeshModels`.
        max_requests_per_client: chat requests one client address may have in flight; beyond
            it, 429 ``too_many_requests`` (the others go on); 0 means no limit. Their bodies may
            hold :data:`MAX_BODY_BYTES_IN_FLIGHT` bytes together.
        max_connections_per_client: connections one client address may hold open at once;
            beyond it a new one is answered 503 and closed; 0 means no limit.

    Raises:
        ValueError: ``max_requests_per_client`` or ``max_connections_per_client`` is negative.
    """

    def __init__(self, client: MeshClient, *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 route_ttl_s: float = ROUTE_TTL_S,
                 max_requests_per_client: int = DEFAULT_MAX_REQUESTS_PER_CLIENT,
                 max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT) -> None:
        if max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be 0 (no limit) or more, got {max_requests_per_client}")
        if max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client must be 0 (no limit) or more, got "
                             f"{max_connections_per_client}")
        self.client, self.host, self.port = client, host, port
        self.api_key, self.default_max_tokens = api_key, default_max_tokens
        self.max_requests_per_client = max_requests_per_client
        self._in_flight: dict[str, int] = {}  # client address -> chat requests running
        self._body_bytes: dict[str, int] = {}  # client address -> bytes of their bodies (Content-Length)
        self.max_connections_per_client = max_connections_per_client
        self._connections: dict[str, int] = {}  # client address -> connections open
        self._listener: asyncio.Server | None = None
        self.models = MeshModels(client, route_ttl_s=route_ttl_s)
        self.mesh = MeshView(client, model_id=model_id)
        self._page: dict[str, bytes] = {}  # URL path -> file bytes, read on first request
        self.app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([web.post("/v1/chat/completions", self._chat), web.get("/v1/models", self._list),
                             web.get("/v1/models/{id}", self._model), web.get("/v1/mesh", self._mesh_view)]
                            + [web.get(path, self._page_file) for path in PAGE_FILES])
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The base URL clients use, ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        """Listen. A client that disconnects cancels its request (the conversation is closed).

        aiohttp has no limit of connections per address, so each connection first meets a
        :class:`_Doorman` that counts them and refuses the excess before aiohttp sees it."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     keepalive_timeout=HEADERS_TIMEOUT_S)
        await self._runner.setup()
        runner = self._runner
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Doorman(self, runner.server), self.host, self.port, reuse_address=True)
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("OpenAI-compatible API at %s", self.url)

    async def close(self) -> None:
        """Stop listening and cancel requests in flight (closing their conversations). Safe to call twice."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()  # shuts down the connections aiohttp handles
        if listener is not None:
            await listener.wait_closed()

    def _admit(self, addr: str) -> bool:
        """Count a new connection from ``addr``; False (nothing counted) when it holds its limit."""
        held, limit = self._connections.get(addr, 0), self.max_connections_per_client
        if limit and held >= limit:
            log.info("refusing a connection from %s: it holds %d, the most one client may hold", addr, held)
            return False
        self._connections[addr] = held + 1
        return True

    def _release(self, addr: str) -> None:
        left = self._connections.pop(addr, 1) - 1
        if left > 0:
            self._connections[addr] = left

    def _check_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _list(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response({"object": "list", "data": await self.models.models()})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response(await self.models.find(request.match_info["id"]))

    async def _mesh_view(self, request: web.Request) -> web.Response:
        """``GET /v1/mesh``: the peer table, coverage, routes and events (see :class:`MeshView`)."""
        self._check_key(request)
        return web.json_response(await self.mesh.snapshot(), dumps=lambda o: json.dumps(o, ensure_ascii=False))

    async def _page_file(self, request: web.Request) -> web.Response:
        """The page (``/``) and its script and style, without a key: the page asks for it.

        Raises:
            ApiError: 500 when the installed package lacks the files.
        """
        name, content_type = PAGE_FILES[request.path]
        if request.path not in self._page:
            try:
                self._page[request.path] = resources.files(__package__).joinpath("web", name).read_bytes()
            except OSError as exc:
                raise ApiError(500, f"the page's file {name} is missing from the installed meshinfer package "
                                    f"({exc.strerror or exc}); reinstall it", type="server_error") from exc
        return web.Response(body=self._page[request.path], content_type=content_type, charset="utf-8",
                            headers=PAGE_HEADERS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._check_key(request)
        addr = host_key(request.remote) if request.remote else "?"
        limit = self.max_requests_per_client
        if limit and self._in_flight.get(addr, 0) >= limit:
            raise ApiError(429, f"{addr} already has {limit} request{'s' if limit != 1 else ''} in flight, the most "
                                f"one client may have; retry when one finishes", type="rate_limit_error",
                           code="too_many_requests", retry_after_s=1)
        size = request.content_length if request.content_length is not None else MAX_BODY_BYTES
        held = self._body_bytes.get(addr, 0)
        if held and held + size > MAX_BODY_BYTES_IN_FLIGHT:
            raise ApiError(429, f"{addr} already has {held} bytes of request bodies in flight; {size} more would pass "
                                f"the limit of {MAX_BODY_BYTES_IN_FLIGHT} one client may have; retry when one "
                                f"finishes", type="rate_limit_error", code="too_many_requests", retry_after_s=1)
        self._in_flight[addr] = self._in_flight.get(addr, 0) + 1
        self._body_bytes[addr] = held + size
        try:
            return await self._chat_in_flight(request)
        finally:
            _drop(self._in_flight, addr, 1)
            _drop(self._body_bytes, addr, size)
            if size >= TRIM_AFTER_BODY_BYTES:
                _trim_heap()

    async def _chat_in_flight(self, request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                           code="request_timeout") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        req = parse_chat_request(body)
        model = await self.models.find(req.model)
        weights_hash = model["meshinfer"]["weights_hash"]
        try:
            route, tok = await self.models.route(weights_hash)
        except MeshError as exc:
            self.models.forget(weights_hash)
            raise mesh_error(exc) from exc
        _check_tool_support(req, tok, model["id"])
        max_tokens = req.max_tokens or self.default_max_tokens
        context_tokens = self.client.context_tokens(route)

        def encode() -> list[int]:  # refuses a prompt that cannot fit before rendering (ContextOverflow: 400)
            check_prompt_fits(tok, req.messages, context_tokens=context_tokens, max_tokens=max_tokens)
            return tok.encode_chat(req.messages, tools=req.prompt_tools)

        # seconds for 4 MB: in a worker thread, so the loop serves other requests meanwhile; a
        # template that refuses the messages is the request's fault (400)
        try:
            prompt_ids = await asyncio.to_thread(encode)
        except MeshError as exc:
            raise mesh_error(exc) from exc
        head = {"id": _completion_id(), "created": int(time.time()), "model": model["id"]}
        run = dict(max_tokens=max_tokens, sampling=req.sampling, stop=req.stop)
        conv = self.client.conversation(route, max_tokens_total=len(prompt_ids) + max_tokens)
        try:
            await self._open(conv, len(prompt_ids), max_tokens)  # failures here still get their HTTP status
            if req.stream:
                return await self._stream(request, req, head, conv, tok, prompt_ids, run)
            try:
                result = await reply(conv, tok, prompt_ids, **run)
            except MeshError as exc:
                self._failed(weights_hash, exc)
                raise mesh_error(exc) from exc
        finally:
            await conv.close()  # also when cancelled: the client went away
        message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
        calls = _tool_stream(req)
        if calls is not None:
            calls.push(result.text)
            calls.finish()
            message["content"] = calls.content
            if calls.calls:
                message = {"role": "assistant", "content": calls.content or None,
                           "tool_calls": [c.to_openai() for c in calls.calls]}
                finish = _finish_with_calls(finish)
        return web.json_response(dict(head, object="chat.completion", choices=[{
            "index": 0, "message": message, "logprobs": None, "finish_reason": finish}], usage=_usage(result),
            meshinfer=self.mesh.record_reply(model["id"], result)))

    async def _open(self, conv: Conversation, n_prompt: int, max_tokens: int) -> None:
        """Open ``conv`` on every hop (reserving prompt + ``max_tokens`` of KV cache).

        Raises:
            ApiError: 400 ``context_length_exceeded`` naming the numbers; 503/429/502 for the mesh.
        """
        try:
            await conv.open()
        except ContextOverflow as exc:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceed the "
                                f"model's context: {exc}", param="messages", code="context_length_exceeded") from exc
        except MeshError as exc:
            self._failed(conv.route.compat_key[0], exc)
            raise mesh_error(exc) from exc

    def _failed(self, weights_hash: str, exc: MeshError) -> None:
        if mesh_error(exc).status >= 500:
            self.models.forget(weights_hash)

    async def _stream(self, request: web.Request, req: ChatRequest, head: dict, conv: Conversation, tok: Tokenizer,
                      prompt_ids: list[int], run: dict) -> web.StreamResponse:
        """Server-sent events: a role chunk, content chunks (and ``tool_calls`` chunks, one a call,
        when the request offers tools), a finish chunk (with the ``meshinfer`` field of
        :func:`meshinfer.app.meshview.reply_json`), usage, ``[DONE]``.

        Cancelled (the client went away) or not, generation stops; the caller closes ``conv``.
        """
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        gen = asyncio.ensure_future(reply(conv, tok, prompt_ids, on_text=queue.put_nowait, **run))
        gen.add_done_callback(lambda _t: queue.put_nowait(None))
        usage = {"usage": None} if req.include_usage else {}

        async def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
            await resp.write(f"data: {data}\n\n".encode("utf-8"))

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return dict(head, object="chat.completion.chunk", choices=[
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **usage)

        calls = _tool_stream(req)

        async def release(content: str, new_calls: list) -> None:
            if content:
                await send(chunk({"content": content}))
            for call in new_calls:  # each call whole, in one delta: name and all its arguments
                await send(chunk({"tool_calls": [call.to_openai(index=calls.calls.index(call))]}))

        try:
            await send(chunk({"role": "assistant", "content": ""}))
            while (piece := await queue.get()) is not None:
                await (release(*calls.push(piece)) if calls is not None else send(chunk({"content": piece})))
            if calls is not None:
                await release(*calls.finish())
            await self._stream_end(send, chunk, gen, req, head, conv,
                                   with_calls=calls is not None and bool(calls.calls))
            await send("[DONE]")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:
            log.info("client of %s went away: %s", head["id"], exc)
        finally:
            if not gen.done():
                gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
        return resp

    async def _stream_end(self, send: Callable[[dict], Awaitable[None]], chunk: Callable[..., dict],
                          gen: asyncio.Future, req: ChatRequest, head: dict, conv: Conversation, *,
                          with_calls: bool) -> None:
        """The end of :meth:`_stream` once ``gen`` (the reply) is done: the finish chunk (finish
        reason ``tool_calls`` when ``with_calls``) and the usage chunk, or the error."""
        try:
            result = gen.result()
        except MeshError as exc:
            self._failed(conv.route.compat_key[0], exc)
            await send(mesh_error(exc).body())
        except Exception:
            log.exception("completion %s failed", head["id"])
            await send(ApiError(500, "internal server error (see the server log)", type="server_error").body())
        else:
            finish = _finish_with_calls(result.finish_reason) if with_calls else result.finish_reason
            await send(dict(chunk({}, finish), meshinfer=self.mesh.record_reply(head["model"], result)))
            if req.include_usage:
                await send(dict(head, object="chat.completion.chunk", choices=[], usage=_usage(result)))
