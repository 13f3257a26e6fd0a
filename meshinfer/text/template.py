"""Chat templates, rendered as transformers does (``PreTrainedTokenizerBase.apply_chat_template``),
and the control-token guard of :meth:`~meshinfer.text.tokenizer.Tokenizer.encode_chat`.

Messages and tools are checked and copied (:func:`validate_messages`, :func:`validate_tools`)
before a template sees them. A template is Jinja code: a local one compiles in a sandboxed
environment (:func:`compile_template`), one from the network renders in the child process of
:mod:`meshinfer.text.template_sandbox` (:func:`render_template`).

The guard: only the template's own text becomes control tokens. :func:`trace_content` finds the
spans of the rendered prompt that the request's text gave, and :func:`split_control` splits the
prompt at control strings lying wholly outside them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta

from meshinfer.core.errors import InvalidInput, TemplateError
from meshinfer.text.template_sandbox import TemplateSandbox, make_environment
from meshinfer.text.toolcalls import TOOL_CALL_OPEN

logger = logging.getLogger(__name__)

#: Roles a chat message may have.
CHAT_ROLES = ("system", "user", "assistant", "tool")
#: Other names an OpenAI client may give a role, and the role each stands for (``developer`` is
#: OpenAI's newer name for ``system``). The HTTP API accepts them; a chat template never sees them.
ROLE_ALIASES = {"developer": "system"}
#: Keys a message of a role may have besides ``role`` and ``content`` (OpenAI's tool-call fields).
MESSAGE_EXTRAS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}

_JINJA_ENV = make_environment()

#: Unicode private-use ranges [start, stop) searched for per-call content sentinels.
_PRIVATE_USE_RANGES = ((0xE000, 0xF900), (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE))


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI-style chat and return fresh message dicts: ``{"role", "content"}`` plus,
    where present, an assistant's ``tool_calls`` and a tool message's ``tool_call_id``/``name``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidInput("messages must be a list of {'role': ..., 'content': ...} dicts, "
                           f"got {type(messages).__name__}")
    if not messages:
        raise InvalidInput("messages is empty; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInput(f"messages[{i}] must be a dict with 'role' and 'content', "
                               f"got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidInput(f"messages[{i}]['role'] is {role!r}; expected one of "
                               f"{', '.join(sorted(CHAT_ROLES))}")
        extras = MESSAGE_EXTRAS.get(role, ())
        extra = sorted(repr(k) for k in message if k not in ("role", "content", *extras))
        if extra:
            allowed = ", ".join(repr(k) for k in ("role", "content", *extras))
            raise InvalidInput(f"messages[{i}] has unsupported key(s) {', '.join(extra)}; "
                               f"a {role} message may have only {allowed}")
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{i}]['content'] must be a str, "
                               f"got {type(content).__name__}")
        fresh = {"role": role, "content": content}
        for key in extras:
            if key in message:
                fresh[key] = _checked_extra(message[key], key, i)
        out.append(fresh)
    return out


def _checked_extra(value: Any, key: str, i: int) -> Any:
    """A fresh copy of ``messages[i][key]``: ``tool_calls`` a list of JSON objects, the others str."""
    if key != "tool_calls":
        if not isinstance(value, str):
            raise InvalidInput(f"messages[{i}]['{key}'] must be a str, got {type(value).__name__}")
        return value
    if not isinstance(value, list) or not all(isinstance(c, Mapping) for c in value):
        raise InvalidInput(f"messages[{i}]['tool_calls'] must be a list of dicts "
                           "({'id', 'type': 'function', 'function': {'name', 'arguments'}})")
    return _json_copy(value, f"messages[{i}]['tool_calls']")


def _json_copy(value: Any, what: str) -> Any:
    """A deep copy of JSON data ``value`` (it travels to the template sandbox as JSON)."""
    try:
        return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInput(f"{what} must be JSON data (dicts, lists, str, numbers, bool, None): {exc}") from None


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check the tool definitions handed to the template: None, or a fresh list of JSON dicts."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) \
            or not all(isinstance(t, Mapping) for t in tools):
        raise InvalidInput("tools must be a list of dicts ({'type': 'function', 'function': {'name', "
                           "'description', 'parameters'}})")
    return _json_copy(list(tools), "tools")


def _strings(value: Any) -> Iterable[str]:
    """Every string value (not dict key) in JSON data ``value``."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _strings(v)


def _keys(value: Any) -> Iterable[str]:
    """Every dict key in JSON data ``value``."""
    if isinstance(value, list):
        for v in value:
            yield from _keys(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)


def _wrap_strings(value: Any, open_: str, close: str) -> Any:
    """``value`` with every string value (not dict key) wrapped by :func:`_wrap`."""
    if isinstance(value, str):
        return _wrap(value, open_, close)
    if isinstance(value, list):
        return [_wrap_strings(v, open_, close) for v in value]
    if isinstance(value, dict):
        return {k: _wrap_strings(v, open_, close) for k, v in value.items()}
    return value


def _pick_sentinels(used: set[str]) -> tuple[str, str]:
    """Two adjacent private-use characters, neither in ``used``."""
    for start, stop in _PRIVATE_USE_RANGES:
        for cp in range(start, stop - 1, 2):
            if chr(cp) not in used and chr(cp + 1) not in used:
                return chr(cp), chr(cp + 1)
    raise InvalidInput("the messages use every Unicode private-use character; cannot encode "
                       "them safely")


def _wrap(content: str, open_: str, close: str) -> str:
    """Put sentinels around the stripped core, so a template's ``| trim`` acts as on ``content``."""
    core = content.strip()
    if not core:
        return content  # whitespace cannot spell a control token
    lead = content[:len(content) - len(content.lstrip())]
    return f"{lead}{open_}{core}{close}{content[len(lead) + len(core):]}"


def _unwrap(rendered: str, open_: str, close: str) -> tuple[str, list[tuple[int, int]]] | None:
    """Strip sentinels; return the text and the half-open content spans, or None if unbalanced."""
    parts, spans, pos, opened = [], [], 0, None
    for part in re.split(f"([{open_}{close}])", rendered):
        if part == open_:
            if opened is not None:
                return None
            opened = pos
        elif part == close:
            if opened is None:
                return None
            spans.append((opened, pos))
            opened = None
        else:
            parts.append(part)
            pos += len(part)
    return None if opened is not None else ("".join(parts), spans)


def template_uses_tools(source: str | None) -> bool:
    """Whether template ``source`` reads a ``tools`` variable and writes ``<tool_call>`` (parsed only)."""
    if source is None or TOOL_CALL_OPEN not in source:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_JINJA_ENV.parse(source))
    except (jinja2.TemplateError, RecursionError):
        return False


def compile_template(source: str) -> jinja2.Template:
    """Compile a local chat template in the sandboxed Jinja environment (a template cannot reach
    Python internals; loops and output size are not limited here, see :mod:`meshinfer.text.template_sandbox`).

    Raises:
        TemplateError: ``source`` does not compile.
    """
    try:
        return _JINJA_ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


def render_template(source: str | None, compiled: jinja2.Template | None,
                    sandbox: TemplateSandbox | None, context: dict[str, Any]) -> str:
    """Render chat template ``source`` with ``context``: in ``sandbox`` when given, else with
    ``compiled`` (:func:`compile_template` of ``source``).

    Raises:
        TemplateError: ``source`` is None (the model has no chat template), or the template
            failed or refused the messages.
    """
    if source is None:
        raise TemplateError("this model has no chat template; use encode() for plain text")
    if sandbox is not None:
        return sandbox.render(source, context)
    try:
        return compiled.render(**context)
    except TemplateError:
        raise
    except Exception as exc:  # the template is data: any failure in it is a template error
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def trace_content(render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str], plain: str,
                  msgs: list[dict[str, Any]], tool_list: list[dict[str, Any]] | None,
                  control_re: re.Pattern[str], template_chars: set[str]) -> tuple[str, list[tuple[int, int]]]:
    """Where the request's text lies in ``plain``, the prompt ``render(msgs, tool_list)`` made.

    Each content, and each string value in the tool calls and tools, is wrapped in a pair of
    private-use sentinels absent from all of them and from ``template_chars`` (the template's
    and the bos/eos tokens' characters), and rendered again; the sentinels' positions mark the
    spans of text the request gave.

    Returns:
        ``(plain, spans)``: the sorted, disjoint, half-open character spans of ``plain`` that
        the request gave; no spans when the template alters the request's text but none of it
        spells a control token (``control_re`` finds none).

    Raises:
        InvalidInput: a dict key in the tools or tool calls spells a control token (keys are
            not traced).
        TemplateError: the template alters the request's text (so its spans cannot be traced)
            while some of that text spells a control token.
    """
    structured = [tool_list, [{k: v for k, v in m.items() if k not in ("role", "content")} for m in msgs]]
    key = next((k for k in _keys(structured) if control_re.search(k)), None)
    if key is not None:
        raise InvalidInput(f"a key in the tools or tool calls spells a control token: {key[:80]!r}")
    open_, close = _pick_sentinels(set(template_chars).union(*(m["content"] for m in msgs),
                                                             *_strings(structured), *_keys(structured)))
    wrapped = [{k: v if k == "role" else _wrap_strings(v, open_, close) for k, v in m.items()} for m in msgs]
    try:
        traced = _unwrap(render(wrapped, _wrap_strings(tool_list, open_, close)), open_, close)
    except TemplateError:  # the template checks a value that the sentinels changed
        traced = None
    if traced is None or traced[0] != plain:
        if any(control_re.search(text) for text in _strings([msgs, tool_list])):
            raise TemplateError("the chat template alters message content, so control-token "
                                "text inside a message cannot be kept as text")
        logger.debug("chat template alters content; no content spells a control token")
        traced = (plain, [])
    return traced


def split_control(text: str, spans: list[tuple[int, int]], control_re: re.Pattern[str],
                  control: Mapping[str, int]) -> list[str | int]:
    """Split ``text`` at control strings lying wholly outside ``spans`` -> text and ids.

    ``control_re`` finds each position where a control string starts (group 1: the string,
    longest first); ``control`` maps a control string to its id.
    """
    pieces: list[str | int] = []
    last = j = 0  # spans are sorted and disjoint, matches come in order: one pass over both
    for match in control_re.finditer(text):
        start, name = match.start(), match.group(1)
        stop = start + len(name)
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if start < last or (j < len(spans) and spans[j][0] < stop):
            continue
        if start > last:
            pieces.append(text[last:start])
        pieces.append(control[name])
        last = stop
    if last < len(text):
        pieces.append(text[last:])
    return pieces
