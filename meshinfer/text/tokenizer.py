"""The tokenizer: token ids of plain text and of a chat, and text of ids.

A :class:`Tokenizer` is built from the tokenizer metadata of a GGUF file (byte-level BPE,
``tokenizer.ggml.model == "gpt2"``) or from a Hugging Face directory (``tokenizer.json`` and
``tokenizer_config.json``), both read by :mod:`meshinfer.text.vocab`. :meth:`Tokenizer.to_bundle`
turns it into plain data so that a client without weights can get it from a peer
(:mod:`meshinfer.text.bundle`), and :meth:`Tokenizer.fingerprint` lets the client check that it
holds the same one.

Security: in :meth:`Tokenizer.encode_chat` only the chat template produces control tokens.
Message text that spells a control token (``<|im_end|>``, ``<|im_start|>system``) is encoded
as ordinary text, so a user cannot close their turn and open a forged system turn
(:mod:`meshinfer.text.template`).

:class:`~meshinfer.text.stream.StreamDecoder` (re-exported here) turns generated ids into text
one token at a time without ever showing half a UTF-8 character.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from meshinfer.core.errors import InvalidInput, WeightsError
from meshinfer.text.bundle import BUNDLE_KEYS, BUNDLE_VERSION, bundle_sha256, read_bundle
from meshinfer.text.stream import StreamDecoder
from meshinfer.text.template import (compile_template, render_template, split_control, template_uses_tools,
                                     trace_content, validate_messages, validate_tools)
from meshinfer.text.template_sandbox import TemplateSandbox, shared_sandbox
from meshinfer.text.vocab import gguf_vocab, hf_dir_vocab

__all__ = ["BUNDLE_KEYS", "BUNDLE_VERSION", "END_OF_GENERATION_TOKENS", "StreamDecoder", "Tokenizer",
           "bundle_sha256"]

logger = logging.getLogger(__name__)

# Tokenize on the calling thread. With its parallelism on (the default), tokenizers runs even a
# batch of one text on its process-wide thread pool, as many threads as cores this process may
# use: a 4 MB prompt (seconds) then holds it, and every other request's tokenization waits
# behind it (all of them, on one core). Off, each call runs in its own thread (``serve``'s
# worker threads), without the GIL (:meth:`Tokenizer._encode_pieces`). A value the user set wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Control tokens that end a turn in common chat formats (ChatML, Llama 3, Gemma). Those the
#: vocabulary holds as control tokens join the metadata's eos id in :attr:`Tokenizer.eos_ids`.
END_OF_GENERATION_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")


class Tokenizer:
    """Byte-level BPE tokenizer with its chat template and end-of-generation ids.

    Build one with :meth:`from_gguf`, :meth:`from_hf_dir` or :meth:`from_bundle`; construction
    takes about a second, every call after that a fraction of a millisecond for a short chat.
    Methods are safe to call from several threads.

    Attributes:
        chat_template: Jinja source of the chat template, or None.
        bos_token, eos_token: the begin/end-of-sequence token strings the template sees
            (``""`` is passed to the template when None).
        bos_id: id of ``bos_token``, or None.
        add_bos_token: whether the model expects a BOS in front of plain text (metadata only:
            :meth:`encode` never adds one; chat templates add it themselves).
        eos_ids: ids that end generation (the metadata's eos plus end-of-turn control tokens).
        control_ids: ids of every control (special) token; :meth:`decode` and
            :class:`StreamDecoder` hide them.
    """

    def __init__(self, tok: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_ids: Iterable[int] = (), add_bos_token: bool = False,
                 sandbox: TemplateSandbox | None = None) -> None:
        """Wrap a ``tokenizers.Tokenizer``, taking ownership of it.

        ``sandbox``: render the chat template in that child process, with its time, memory and
        output limits (:mod:`meshinfer.text.template_sandbox`), as :meth:`from_bundle` does for a
        template that came from the network; None renders in this process (a local file).

        ``tok.encode_special_tokens`` is set to True: :meth:`encode` never splits at control
        tokens, and :meth:`encode_chat` splits at the template's own control tokens itself.

        Raises:
            TemplateError: ``chat_template`` does not compile.
            InvalidInput: ``bos_token``/``eos_token`` is not in the vocabulary, or an eos id is
                outside ``[0, vocab_size)``.
        """
        self._tok = tok
        self._tok.encode_special_tokens = True
        self._json: str | None = None  # tok.to_str(), made on first use (0.3 s for 152k tokens)
        self.chat_template = chat_template
        self._sandbox = sandbox
        if chat_template is not None and sandbox is not None:
            sandbox.check(chat_template)  # Jinja runs constant expressions while compiling
        self._template = None if chat_template is None or sandbox is not None else compile_template(chat_template)
        # Characters the sentinels of encode_chat must avoid besides those of the contents.
        self._template_chars = set(chat_template or "") | set(bos_token or "") | set(eos_token or "")
        self.bos_token, self.eos_token, self.add_bos_token = bos_token, eos_token, add_bos_token
        self.bos_id = self._id_of(bos_token, "bos_token")
        eos_id = self._id_of(eos_token, "eos_token")
        self._control = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()
                         if t.special}
        self.control_ids = frozenset(self._control.values())
        names = sorted(self._control, key=len, reverse=True)
        # Lookahead: every position where some control string starts (longest alternative first).
        self._control_re = re.compile("(?=(" + "|".join(map(re.escape, names)) + "))") if names else None
        eos = {i for i in eos_ids} | {self._control[t] for t in END_OF_GENERATION_TOKENS
                                      if t in self._control}
        if eos_id is not None:
            eos.add(eos_id)
        bad = [i for i in eos if type(i) is not int or not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInput(f"eos ids {bad} are not ids in the vocabulary [0, {self.vocab_size})")
        self.eos_ids: frozenset[int] = frozenset(eos)
        self._hidden_ids = self.control_ids | self.eos_ids
        self._fingerprint: str | None = None
        self._tools_support: bool | None = None
        self._max_piece_chars: int | None = None

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise InvalidInput(f"{what} {token!r} is not in the vocabulary")
        return token_id

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | Any) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file's ``tokenizer.*`` metadata.

        Args:
            source: the ``.gguf`` file, or an open :class:`~meshinfer.engine.weights.gguf_file.GGUFFile` (anything with
                ``path`` and ``metadata``) (a peer that loads
                weights and tokenizer then parses the file once).

        Raises:
            FileNotFoundError: no such file.
            WeightsError: unreadable metadata, a tokenizer model other than ``gpt2`` (byte-level
                BPE), an unsupported ``tokenizer.ggml.pre``, inconsistent token tables, or a
                ``tokenizer.chat_template`` that does not compile. The message names the field.
        """
        start = time.perf_counter()
        path, meta, tok, kwargs = gguf_vocab(source)
        try:
            out = cls(tok, **kwargs)
        except InvalidInput as exc:
            raise WeightsError(f"{path}: tokenizer.chat_template: {exc}") from exc
        logger.debug("tokenizer from %s: %d tokens, pre=%s, %.2f s", path, len(meta["tokenizer.ggml.tokens"]),
                     meta.get("tokenizer.ggml.pre"), time.perf_counter() - start)
        return out

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json``, ``tokenizer_config.json`` (``chat_template``, ``bos_token``,
        ``eos_token``, ``add_bos_token``), ``chat_template.jinja`` when present (it wins over
        the config's template, as in transformers) and ``generation_config.json``'s
        ``eos_token_id`` when present.

        Raises:
            WeightsError: a file is missing, unparsable or holds a field of the wrong type, or
                the chat template does not compile; the message names the file and field.
        """
        path = Path(path)
        tok, kwargs = hf_dir_vocab(path)
        try:
            return cls(tok, **kwargs)
        except InvalidInput as exc:
            raise WeightsError(f"{path}: {exc}") from exc

    # -- plain text ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (V)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def pieces(self) -> list[str | None]:
        """The piece (vocabulary string) of every id, ``pieces()[i]`` for id ``i``; None for an
        id without one. Two tokenizers with equal pieces map text to the same ids."""
        out: list[str | None] = [None] * self.vocab_size
        for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(out):
                out[i] = piece
        return out

    @property
    def max_piece_chars(self) -> int:
        """Characters of the longest piece of the vocabulary, added tokens included (at least 1).

        No token stands for more characters of text (:mod:`meshinfer.text.prompt_bound` says
        why). Computed once, a pass over the V pieces (0.3 s for 152k)."""
        if self._max_piece_chars is None:
            self._max_piece_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1) or 1
        return self._max_piece_chars

    def encode(self, text: str) -> list[int]:
        """Token ids of plain ``text``; control-token strings in it are encoded as text.

        No BOS is added. Raises:
            InvalidInput: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise InvalidInput(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of token ids; control tokens are left out when ``skip_special``.

        Raises:
            InvalidInput: an id is not an integer or lies outside ``[0, vocab_size)``.
        """
        return self._decode(self._check_ids(ids), skip_special)

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        try:
            out = [operator.index(i) for i in ids]
        except TypeError as exc:
            raise InvalidInput(f"token ids must be integers: {exc}") from exc
        n = self.vocab_size
        bad = next((i for i in out if not 0 <= i < n), None)
        if bad is not None:
            raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {n})")
        return out

    # -- chat ----------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render ``messages`` with the chat template to a prompt string.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``;
                an assistant message may add ``tool_calls`` (``[{"id", "type": "function",
                "function": {"name", "arguments": dict}}]``), a tool message ``tool_call_id``
                and ``name`` (str), passed to the template as they are (transformers' form).
            add_generation_prompt: end with the header of an assistant turn.
            tools: tool definitions for the template's ``tools`` variable (OpenAI's
                ``[{"type": "function", "function": {...}}]``), or None.

        Raises:
            InvalidInput: malformed messages or tools (not lists of such dicts, not JSON data).
            TemplateError: no chat template, or the template failed or refused the messages.
        """
        return self._render(validate_messages(messages), validate_tools(tools), add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered with the chat template (what the model reads).

        Only the template's own text becomes control tokens: content that spells
        ``<|im_end|>`` is encoded as ordinary text. Each content, and each string value in the
        tool calls and tools, is wrapped in a pair of private-use sentinels absent from all of
        them and from the template; the sentinels' positions mark the spans of text the
        request gave, and control strings overlapping a span are left as text.

        Args: as :meth:`render_chat`.

        Raises:
            InvalidInput: malformed messages or tools, or a dict key in the tools or tool calls
                that spells a control token (keys are not traced).
            TemplateError: as :meth:`render_chat`, or the template alters the request's text (so
                its spans cannot be traced) while some of that text spells a control token.
        """
        msgs, tool_list = validate_messages(messages), validate_tools(tools)
        plain = self._render(msgs, tool_list, add_generation_prompt)
        if self._control_re is None:
            return self._encode_pieces([plain])
        text, spans = trace_content(lambda m, t: self._render(m, t, add_generation_prompt), plain, msgs, tool_list,
                                    self._control_re, self._template_chars)
        return self._encode_pieces(split_control(text, spans, self._control_re, self._control))

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it uses a ``tools`` variable)
        and asks for calls as ``<tool_call>`` blocks, the one format :mod:`meshinfer.text.toolcalls`
        parses (Qwen2.5, Hermes). The template is parsed, never run, here."""
        if self._tools_support is None:
            self._tools_support = template_uses_tools(self.chat_template)
        return self._tools_support

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str:
        context = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return render_template(self.chat_template, self._template, self._sandbox, context)

    def _encode_pieces(self, pieces: list[str | int]) -> list[int]:
        # encode_batch lets go of the GIL, encode does not: a 4 MB prompt tokenized in a worker
        # thread held the event loop's thread for all of its 10 s, now under a second (the ids)
        texts = [p for p in pieces if isinstance(p, str)]
        encoded = iter(self._tok.encode_batch(texts, add_special_tokens=False) if texts else ())
        ids: list[int] = []
        for piece in pieces:
            ids.extend([piece] if isinstance(piece, int) else next(encoded).ids)
        return ids

    # -- serialization -------------------------------------------------------------------------

    def to_bundle(self) -> dict[str, Any]:
        """Everything a weightless client needs, as plain JSON/msgpack-able data.

        Returns:
            ``{"version": int, "tokenizer_json": str, "chat_template": str | None,
            "eos_ids": list[int], "bos_id": int | None, "bos_token": str | None,
            "eos_token": str | None, "add_bos_token": bool}``.
        """
        if self._json is None:
            self._json = self._tok.to_str()
        return {
            "version": BUNDLE_VERSION, "tokenizer_json": self._json,
            "chat_template": self.chat_template, "eos_ids": sorted(self.eos_ids),
            "bos_id": self.bos_id, "bos_token": self.bos_token, "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
        }

    @classmethod
    def from_bundle(cls, bundle: Mapping[str, Any]) -> Tokenizer:
        """Rebuild a tokenizer from :meth:`to_bundle` output (e.g. received from a peer).

        Unknown keys are ignored so that newer peers stay compatible. The chat template is
        rendered in the process-wide :class:`~meshinfer.text.template_sandbox.TemplateSandbox`: it
        is data from the network.

        Raises:
            InvalidInput: not a mapping, another ``version``, a missing or mistyped field, a
                tokenizer JSON that does not load, a template that does not compile
                (TemplateError), or ids that do not fit the vocabulary.
        """
        tok, kwargs, bos_id = read_bundle(bundle)
        out = cls(tok, **kwargs, sandbox=shared_sandbox())
        if bos_id != out.bos_id:
            raise InvalidInput(f"tokenizer bundle bos_id {bos_id} does not match bos_token "
                               f"{out.bos_token!r} (id {out.bos_id})")
        return out

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON of :meth:`to_bundle` (sorted keys)."""
        if self._fingerprint is None:
            canon = json.dumps(self.to_bundle(), sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False)
            self._fingerprint = hashlib.sha256(canon.encode("utf-8")).hexdigest()
        return self._fingerprint


