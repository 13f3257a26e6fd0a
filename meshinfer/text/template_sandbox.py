"""Render chat templates received from the network in a child process with time, memory and
output limits.

A chat template is Jinja code. Jinja's sandbox stops a template from reaching Python objects,
but not from looping: ``{% for a in range(100000) %}{% for b in range(100000) %}...`` keeps a
core busy for hours, and ``{{ 'x' * 10**10 }}`` asks for 10 GB. A client takes its template from
a peer (``get_tokenizer``), so a stranger's template must not be able to do either. Here it
runs in one long-lived child process (``python -m meshinfer.text.template_sandbox``: it imports only
Jinja and this module), which reads one JSON request a line and answers one a line:

- a render that has not answered within its deadline is stopped by killing the child (a new
  one starts on the next render), and :class:`TemplateError` is raised;
- the child's address space is capped (``RLIMIT_AS``, where the OS enforces it), so a huge
  allocation fails with MemoryError inside the child;
- output beyond ``max_output_chars`` stops the render.

This module imports no torch: the child starts in about 0.1 s.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from meshinfer.core.errors import TemplateError

log = logging.getLogger(__name__)

#: Wall-clock seconds a render may take, plus :data:`RENDER_S_PER_MB` per MB of message
#: content. A real chat template renders a 100,000-message chat in about a second (measured
#: with Qwen2.5's template on the 2-core CI machine), so the bound stops only runaway templates.
RENDER_BASE_S = 5.0
RENDER_S_PER_MB = 2.0
#: Most characters one render may produce: 4x the messages' content, this many per message
#: (a turn's header and footer, ``<|im_start|>user\n ... <|im_end|>\n``, is about 30), and
#: :data:`RENDER_EXTRA_CHARS` (a system prompt, tool descriptions).
RENDER_CHARS_PER_MESSAGE = 256
RENDER_EXTRA_CHARS = 1 << 20
#: Address-space cap of the child, bytes: the interpreter, Jinja and a 4 MB chat fit many times.
CHILD_MEMORY_BYTES = 2 << 30


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template refused the messages: {message}")


def make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment chat templates compile in, as transformers configures it
    (``PreTrainedTokenizerBase.apply_chat_template``): trim/lstrip blocks, loop controls,
    ``tojson``, ``raise_exception`` and ``strftime_now``."""
    from datetime import datetime

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _render(env, cache: dict, source: str, context: dict | None, max_chars: int) -> str:
    """``source`` rendered with ``context``, or only compiled when ``context`` is None (Jinja
    folds constant expressions while compiling: ``{{ 'x' * 10**10 }}`` allocates then)."""
    template = cache.get(source)
    if template is None:
        try:
            template = cache[source] = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from None
        if len(cache) > 8:
            cache.pop(next(iter(cache)))
    if context is None:
        return ""
    out, n = [], 0
    for chunk in template.generate(**context):
        n += len(chunk)
        if n > max_chars:
            raise TemplateError(f"chat template output exceeds {max_chars} characters; stopped")
        out.append(chunk)
    return "".join(out)


def _child(memory_bytes: int) -> None:  # pragma: no cover - runs in the child process
    """The child's loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass  # not enforced on this OS: the deadline still holds
    env, cache = make_environment(), {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = {"kind": "ok", "text": _render(env, cache, req["source"], req["context"], req["max_chars"])}
        except TemplateError as exc:
            answer = {"kind": "refused", "text": str(exc)}
        except MemoryError:
            answer = {"kind": "failed", "text": f"MemoryError: over the {memory_bytes >> 20} MiB limit"}
        except Exception as exc:  # the template is data: any failure in it is a template error
            answer = {"kind": "failed", "text": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def _content_chars(context: dict) -> int:
    """Characters of the request's own text: the contents, plus the JSON of the tool calls and tools."""
    messages = context.get("messages") or []
    structured = [m.get("tool_calls") for m in messages if m.get("tool_calls")], context.get("tools")
    extra = len(json.dumps(structured, ensure_ascii=False)) if any(structured) else 0
    return sum(len(m.get("content") or "") for m in messages) + extra


class TemplateSandbox:
    """One child process (``python -m meshinfer.text.template_sandbox``) that renders templates;
    safe to call from several threads (renders run one at a time). ``close()`` ends the child
    and is safe to call twice."""

    def __init__(self, *, memory_bytes: int = CHILD_MEMORY_BYTES) -> None:
        self._memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def check(self, source: str) -> None:
        """Compile ``source`` in the child, under the limits of a render of no messages.

        Raises:
            TemplateError: it does not compile, or compiling it ran out of time or memory.
        """
        self.render(source, None)

    def render(self, source: str, context: dict[str, Any] | None) -> str:
        """``source`` rendered with ``context`` in the child.

        Args:
            source: the template's Jinja source.
            context: JSON-able variables: ``messages`` (``[{"role", "content"}]``, an
                assistant's ``tool_calls``), ``tools``, ``add_generation_prompt`` ... The
                deadline (:data:`RENDER_BASE_S` + :data:`RENDER_S_PER_MB` per MB of content,
                which counts the tool calls and tools as their JSON) and the output limit (4x the
                content, :data:`RENDER_CHARS_PER_MESSAGE` a message, plus
                :data:`RENDER_EXTRA_CHARS`) grow with the messages. None: compile only.

        Raises:
            TemplateError: the template refused the messages, failed, ran past its deadline
                (the child is killed) or produced too much output.
        """
        messages = (context or {}).get("messages") or []
        content_chars = _content_chars(context or {})
        timeout_s = RENDER_BASE_S + RENDER_S_PER_MB * content_chars / 1e6
        max_chars = 4 * content_chars + RENDER_CHARS_PER_MESSAGE * len(messages) + RENDER_EXTRA_CHARS
        request = json.dumps({"source": source, "context": context, "max_chars": max_chars}).encode() + b"\n"
        with self._lock:
            try:
                line = self._exchange(request, time.monotonic() + timeout_s)
            except OSError as exc:  # the child died (the OS killed it for memory, say)
                self._stop()
                raise TemplateError(f"chat template failed: its render process died ({exc})") from None
            if line is None:
                self._stop()
                raise TemplateError(f"chat template did not finish within {timeout_s:.1f} s; it was stopped")
        answer = json.loads(line)
        if answer["kind"] == "ok":
            return answer["text"]
        raise TemplateError(answer["text"] if answer["kind"] == "refused" else f"chat template failed: {answer['text']}")

    def _exchange(self, request: bytes, deadline: float) -> bytes | None:
        """Send ``request`` to the child and read its answer line; None past ``deadline``
        (monotonic seconds). Raises OSError when the child is gone."""
        proc = self._started()
        proc.stdin.write(request)
        proc.stdin.flush()
        fd, buf = proc.stdout.fileno(), bytearray()
        while not buf.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise OSError("the render process closed its output")
            buf += chunk
        return bytes(buf)

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "meshinfer.text.template_sandbox", str(self._memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:  # a request left unflushed for a dead child
                    pass

    def close(self) -> None:
        """End the child process."""
        with self._lock:
            self._stop()


_shared: TemplateSandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> TemplateSandbox:
    """The process-wide sandbox (made on first use; its child starts on the first render)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateSandbox()
        return _shared


if __name__ == "__main__":  # the child: python -m meshinfer.text.template_sandbox MEMORY_BYTES
    _child(int(sys.argv[1]))
