"""Tool calls in a model's reply: Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks into
OpenAI ``tool_calls``, one text piece at a time (no I/O).

Qwen2.5's chat template tells the model to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallStream` takes the reply's text as it is released and splits it into content
(the text outside the blocks, streamed as soon as it cannot be the start of a block) and
:class:`ToolCall` objects (each one once its closing tag arrived). A block whose JSON is not an
object with a string ``name`` and an object ``arguments`` stays in the content as the model
wrote it, markup included, so nothing the model said is lost; so does a block the reply ended
inside (``max_tokens`` reached).

Small models often leave the tags out: Qwen2.5-Coder-0.5B answers a weather question with the
bare object ``{"name": "get_weather", "arguments": {...}}``, or that object in a
```` ```json ```` fence. Given the offered tools' names, a reply that is nothing but such
objects (each naming an offered tool) is read as those calls too, as llama.cpp's Hermes parser
does. A reply that starts like one (``{"name":``) is held back whole until it ends, since only
its end tells a call from text; any other start is streamed at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

#: The tags around one call in the Qwen/Hermes format (single tokens in Qwen2.5's vocabulary).
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
#: How a bare call starts once whitespace is removed.
BARE_CALL_HEAD = '{"name":'
#: A fence around a bare call: ```` ``` ```` or ```` ```json ```` and a newline, then the
#: objects, then a closing ```` ``` ````.
_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?```", re.DOTALL)


def new_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call of a reply.

    Attributes:
        id: the call's id, which the client's ``tool`` message answers with ``tool_call_id``.
        name: the function's name.
        arguments: the arguments as JSON text (an object), as OpenAI sends them.
    """

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``, with ``index``
        first when given (a streamed ``delta.tool_calls`` entry)."""
        head = {} if index is None else {"index": index}
        return dict(head, id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})


def parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of the text between the tags, or None when it is not a
    JSON object with a non-empty string ``name`` and an object ``arguments`` (absent: ``{}``)."""
    try:
        return _call_of(json.loads(body))
    except (ValueError, RecursionError):
        return None


def _call_of(obj: object) -> tuple[str, str] | None:
    """:func:`parse_call` of decoded JSON."""
    if not isinstance(obj, dict):
        return None
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ToolCallStream:
    """Reply text in, content and tool calls out.

    Args:
        names: the offered functions' names; with them a reply made only of bare call objects
            (see the module's docstring) is read as calls. None: only ``<tool_call>`` blocks.
        max_calls: calls kept at most (``parallel_tool_calls: false`` is 1); blocks after that
            many are left out of both the calls and the content. None: no limit.
        make_id: makes each call's id.

    Attributes:
        content: all content released so far.
        calls: all calls found so far, in order.

    Whitespace next to a call (the newline before ``<tool_call>`` and between blocks) is not
    content; so content is held back while it ends in whitespace.
    """

    def __init__(self, *, names: frozenset[str] | None = None, max_calls: int | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls, self._make_id, self._names = max_calls, make_id, names
        self._mode = "start" if names else "text"  # "start": undecided, "bare": held to the end
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet classified: a possible opening tag, or a block's body
        self._inside = False
        self._space = ""  # trailing whitespace of the content, held back
        self._after_call = False  # drop the whitespace that starts the content after a call

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add reply text; return the content it releases and the calls it completes."""
        self._buf += text
        if self._mode == "start":
            self._mode = _bare_start(self._buf)
        if self._mode != "text":
            return "", []
        out, calls = [], []
        while True:
            if self._inside:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                body, self._buf, self._inside = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):], False
                parsed = parse_call(body)
                if parsed is None:
                    out.append(self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE))
                elif (call := self._add(*parsed)) is not None:
                    calls.append(call)
            else:
                start = self._buf.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_tag(self._buf)
                    out.append(self._content(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._content(self._buf[:start]))
                self._buf, self._inside = self._buf[start + len(TOOL_CALL_OPEN):], True
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the reply: release what is held back (an unclosed block as text)."""
        if self._mode != "text":
            self._mode = "text"
            calls = self._bare_calls(self._buf)
            if calls:
                self._buf = ""
                return "", calls
            out, calls = self.push("")  # not bare calls: text, which may hold <tool_call> blocks
            tail, _ = self.finish()
            return out + tail, calls
        rest = (TOOL_CALL_OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        out = self._content(rest)
        if not self.calls and self._space:
            out += self._space
            self.content += self._space
        self._space = ""
        return out, []

    def _bare_calls(self, text: str) -> list[ToolCall]:
        """The calls of a reply that is only bare call objects naming offered tools, else []."""
        fenced = _FENCE.fullmatch(text.strip())
        body, decoder, found, pos = (fenced.group(1) if fenced else text).strip(), json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return []
            parsed = _call_of(obj)
            if parsed is None or parsed[0] not in self._names:
                return []
            found.append(parsed)
            pos = len(body) - len(body[end:].lstrip())
        return [c for c in (self._add(*p) for p in found) if c is not None]

    def _add(self, name: str, arguments: str) -> ToolCall | None:
        """The new call, or None past ``max_calls``."""
        self._space, self._after_call = "", True  # whitespace next to a call is not content
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        call = ToolCall(id=self._make_id(), name=name, arguments=arguments)
        self.calls.append(call)
        return call

    def _content(self, text: str) -> str:
        """Content to release: ``text`` after the held whitespace, less its own trailing whitespace."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._space + text
        core = text.rstrip()
        self._space = text[len(core):]
        self.content += core
        return core


def _bare_start(text: str) -> str:
    """How a reply beginning with ``text`` goes on: "bare" (it starts like a bare call),
    "text" (it cannot be one), or "start" (too short to tell)."""
    head = text.lstrip()
    if head.startswith("`") or "```".startswith(head):
        if "\n" not in head:
            return "start" if head == "" or any(f.startswith(head) for f in ("```json", "```\n")) \
                or re.fullmatch(r"```(json)?[ \t]*", head) else "text"
        if not re.match(r"```(json)?[ \t]*\n", head):
            return "text"
        head = head[head.index("\n") + 1:]
    compact = re.sub(r"\s+", "", head[:1024])
    if compact.startswith(BARE_CALL_HEAD):
        return "bare"
    return "start" if BARE_CALL_HEAD.startswith(compact) else "text"


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins :data:`TOOL_CALL_OPEN` (shorter than it)."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0
