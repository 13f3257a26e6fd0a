"""Tokenizer, chat template and streaming detokenizer.

A :class:`Tokenizer` is built from the tokenizer metadata of a GGUF file (byte-level BPE,
``tokenizer.ggml.model == "gpt2"``) or from a Hugging Face directory (``tokenizer.json`` and
``tokenizer_config.json``). :meth:`Tokenizer.to_bundle` turns it into plain data so that a
client without weights can get it from a peer, and :meth:`Tokenizer.fingerprint` lets the
client check that it holds the same one.

Security: in :meth:`Tokenizer.encode_chat` only the chat template produces control tokens.
Message text that spells a control token (``<|im_end|>``, ``<|im_start|>system``) is encoded
as ordinary text, so a user cannot close their turn and open a forged system turn.

:class:`StreamDecoder` turns generated ids into text one token at a time without ever
showing half a UTF-8 character.
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

import jinja2
import jinja2.meta
import numpy as np
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from meshinfer.core.errors import InvalidInput, TemplateError, WeightsError
from meshinfer.text.template_sandbox import TemplateSandbox, make_environment, shared_sandbox
from meshinfer.text.toolcalls import TOOL_CALL_OPEN
from meshinfer.core.gguf_header import read_gguf_metadata

logger = logging.getLogger(__name__)

#: Version of the dict written by :meth:`Tokenizer.to_bundle`; other versions are refused.
BUNDLE_VERSION = 1

#: Roles a chat message may have.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
#: Keys a message of a role may have besides ``role`` and ``content`` (OpenAI's tool-call fields).
MESSAGE_EXTRAS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}

#: Control tokens that end a turn in common chat formats (ChatML, Llama 3, Gemma). Those the
#: vocabulary holds as control tokens join the metadata's eos id in :attr:`Tokenizer.eos_ids`.
END_OF_GENERATION_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")

#: Qwen2 pre-tokenizer regex: llama.cpp ``src/llama-vocab.cpp`` (LLAMA_VOCAB_PRE_TYPE_QWEN2),
#: identical to the ``Split`` pattern in the ``tokenizer.json`` of Qwen/Qwen2.5-*.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _qwen2_pre_tokenizer() -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    # HF tokenizer.json of Qwen2.5: NFC, Split(QWEN2_PATTERN, isolated), ByteLevel without regex.
    return normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _smollm_pre_tokenizer() -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    # HF tokenizer.json of SmolLM2 (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" then the GPT-2
    # regex): every digit alone, then byte-level with the GPT-2 regex.
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _gpt2_pre_tokenizer() -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    # llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2: only the GPT-2 regex, which ByteLevel(use_regex) applies.
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


#: ``tokenizer.ggml.pre`` values this module can rebuild, and how.
_PRE_TOKENIZERS = {
    "qwen2": _qwen2_pre_tokenizer,
    "deepseek-r1-qwen": _qwen2_pre_tokenizer,  # same regex in llama.cpp
    "smollm": _smollm_pre_tokenizer,
    "gpt-2": _gpt2_pre_tokenizer,
}


def _require(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    value = meta.get(key)
    if value is None:
        raise WeightsError(f"{path}: GGUF metadata has no {key}")
    if not isinstance(value, kind):
        raise WeightsError(f"{path}: GGUF {key} has type {type(value).__name__}")
    return value


def _token_id(meta: Mapping[str, Any], key: str, n_tokens: int, path: Path) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_tokens:
        raise WeightsError(f"{path}: GGUF {key} = {value!r} is outside the vocabulary [0, {n_tokens})")
    return value


def _bpe_from_gguf(meta: Mapping[str, Any], path: Path) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equal to the one the GGUF was converted from."""
    model = _require(meta, "tokenizer.ggml.model", str, path)
    if model != "gpt2":
        raise WeightsError(f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE "
                           "('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        raise WeightsError(f"{path}: tokenizer.ggml.pre is {pre!r}; supported: "
                           f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens = _require(meta, "tokenizer.ggml.tokens", list, path)
    merges = _require(meta, "tokenizer.ggml.merges", list, path)
    types = _require(meta, "tokenizer.ggml.token_type", np.ndarray, path)
    if len(types) != len(tokens):
        raise WeightsError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries, "
                           f"tokenizer.ggml.tokens has {len(tokens)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise WeightsError(f"{path}: tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} "
                           "duplicate strings")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise WeightsError(f"{path}: tokenizer.ggml.merges entry {bad!r} is not 'left right'")
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                              byte_fallback=False))
    except Exception as exc:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise WeightsError(f"{path}: tokenizer.ggml.merges do not fit the vocabulary: {exc}") from exc
    normalizer, pre_tokenizer = _PRE_TOKENIZERS[pre]()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # Added tokens keep their ids because their strings are already in the BPE vocabulary.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.flatnonzero(types == TokenType.CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.flatnonzero(types == TokenType.USER_DEFINED)])
    return tok


# ---------------------------------------------------------------------------------------------
# Chat templates, rendered as transformers does (PreTrainedTokenizerBase.apply_chat_template).


_JINJA_ENV = make_environment()

#: Unicode private-use ranges [start, stop) searched for per-call content sentinels.
_PRIVATE_USE_RANGES = ((0xE000, 0xF900), (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE))


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
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


def _validate_tools(tools: Any) -> list[dict[str, Any]] | None:
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


def _template_uses_tools(source: str | None) -> bool:
    """Whether template ``source`` reads a ``tools`` variable and writes ``<tool_call>`` (parsed only)."""
    if source is None or TOOL_CALL_OPEN not in source:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_JINJA_ENV.parse(source))
    except (jinja2.TemplateError, RecursionError):
        return False


def _compile_template(source: str) -> jinja2.Template:
    try:
        return _JINJA_ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


# ---------------------------------------------------------------------------------------------


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
        self._template = None if chat_template is None or sandbox is not None else _compile_template(chat_template)
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
        if not isinstance(source, (str, os.PathLike)):
            path, meta = source.path, source.metadata
        else:
            path = Path(source)
            meta = read_gguf_metadata(path)
        tok = _bpe_from_gguf(meta, path)
        tokens = meta["tokenizer.ggml.tokens"]
        ids = {k: _token_id(meta, f"tokenizer.ggml.{k}", len(tokens), path)
               for k in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id")}
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise WeightsError(f"{path}: GGUF tokenizer.chat_template is not a string")
        try:
            out = cls(tok, chat_template=template,
                      bos_token=None if ids["bos_token_id"] is None else tokens[ids["bos_token_id"]],
                      eos_token=None if ids["eos_token_id"] is None else tokens[ids["eos_token_id"]],
                      eos_ids=[i for k, i in ids.items() if k != "bos_token_id" and i is not None],
                      add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
        except InvalidInput as exc:
            raise WeightsError(f"{path}: tokenizer.chat_template: {exc}") from exc
        logger.debug("tokenizer from %s: %d tokens, pre=%s, %.2f s", path, len(tokens),
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
        try:
            tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for I/O and JSON errors
            raise WeightsError(f"{path / 'tokenizer.json'}: cannot load: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        template = _hf_template(config, path)
        generation = _read_json(path / "generation_config.json")
        extra = generation.get("eos_token_id")
        extra = [] if extra is None else [extra] if isinstance(extra, int) else extra
        if not isinstance(extra, list):
            raise WeightsError(f"{path / 'generation_config.json'}: eos_token_id must be an int "
                               f"or a list of int, got {type(extra).__name__}")
        try:
            return cls(tok, chat_template=template,
                       bos_token=_hf_token(config, "bos_token", path),
                       eos_token=_hf_token(config, "eos_token", path),
                       eos_ids=extra, add_bos_token=bool(config.get("add_bos_token", False)))
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
        return self._render(_validate_messages(messages), _validate_tools(tools), add_generation_prompt)

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
        msgs, tool_list = _validate_messages(messages), _validate_tools(tools)
        plain = self._render(msgs, tool_list, add_generation_prompt)
        if self._control_re is None:
            return self._encode_pieces([plain])
        structured = [tool_list, [{k: v for k, v in m.items() if k not in ("role", "content")} for m in msgs]]
        key = next((k for k in _keys(structured) if self._control_re.search(k)), None)
        if key is not None:
            raise InvalidInput(f"a key in the tools or tool calls spells a control token: {key[:80]!r}")
        open_, close = _pick_sentinels(set(self._template_chars).union(*(m["content"] for m in msgs),
                                                                       *_strings(structured), *_keys(structured)))
        wrapped = [{k: v if k == "role" else _wrap_strings(v, open_, close) for k, v in m.items()} for m in msgs]
        try:
            traced = _unwrap(self._render(wrapped, _wrap_strings(tool_list, open_, close), add_generation_prompt),
                             open_, close)
        except TemplateError:  # the template checks a value that the sentinels changed
            traced = None
        if traced is None or traced[0] != plain:
            if any(self._control_re.search(text) for text in _strings([msgs, tool_list])):
                raise TemplateError("the chat template alters message content, so control-token "
                                    "text inside a message cannot be kept as text")
            logger.debug("chat template alters content; no content spells a control token")
            traced = (plain, [])
        return self._encode_pieces(self._split_control(*traced))

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it uses a ``tools`` variable)
        and asks for calls as ``<tool_call>`` blocks, the one format :mod:`meshinfer.text.toolcalls`
        parses (Qwen2.5, Hermes). The template is parsed, never run, here."""
        if self._tools_support is None:
            self._tools_support = _template_uses_tools(self.chat_template)
        return self._tools_support

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use encode() for plain text")
        context = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if self._sandbox is not None:
            return self._sandbox.render(self.chat_template, context)
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except Exception as exc:  # the template is data: any failure in it is a template error
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def _split_control(self, text: str, spans: list[tuple[int, int]]) -> list[str | int]:
        """Split ``text`` at control strings lying wholly outside ``spans`` -> text and ids."""
        pieces: list[str | int] = []
        last = j = 0  # spans are sorted and disjoint, matches come in order: one pass over both
        for match in self._control_re.finditer(text):
            start, name = match.start(), match.group(1)
            stop = start + len(name)
            while j < len(spans) and spans[j][1] <= start:
                j += 1
            if start < last or (j < len(spans) and spans[j][0] < stop):
                continue
            if start > last:
                pieces.append(text[last:start])
            pieces.append(self._control[name])
            last = stop
        if last < len(text):
            pieces.append(text[last:])
        return pieces

    def _encode_pieces(self, pieces: list[str | int]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._tok.encode(piece, add_special_tokens=False).ids)
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
        if not isinstance(bundle, Mapping):
            raise InvalidInput(f"tokenizer bundle must be a dict, got {type(bundle).__name__}")
        if bundle.get("version") != BUNDLE_VERSION:
            raise InvalidInput(f"tokenizer bundle version is {bundle.get('version')!r}; "
                               f"this side reads version {BUNDLE_VERSION}")
        tok_json = _field(bundle, "tokenizer_json", str)
        eos_ids = _field(bundle, "eos_ids", list)
        if not all(type(i) is int for i in eos_ids):
            raise InvalidInput("tokenizer bundle field 'eos_ids' must be a list of int")
        bos_id = _field(bundle, "bos_id", int, optional=True)
        try:
            tok = tokenizers.Tokenizer.from_str(tok_json)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise InvalidInput(f"tokenizer bundle field 'tokenizer_json' does not load: {exc}") from exc
        out = cls(tok, chat_template=_field(bundle, "chat_template", str, optional=True),
                  bos_token=_field(bundle, "bos_token", str, optional=True),
                  eos_token=_field(bundle, "eos_token", str, optional=True), eos_ids=eos_ids,
                  add_bos_token=_field(bundle, "add_bos_token", bool, optional=True) or False,
                  sandbox=shared_sandbox())
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


#: The fields of a tokenizer bundle (:meth:`Tokenizer.to_bundle`), in the order they are hashed.
BUNDLE_KEYS = ("version", "tokenizer_json", "chat_template", "eos_ids", "bos_id", "bos_token",
               "eos_token", "add_bos_token")


def bundle_sha256(bundle: Mapping[str, Any]) -> str:
    """Hex SHA-256 of a tokenizer bundle as sent (:data:`BUNDLE_KEYS` only, unknown keys left
    out): the canonical JSON of those fields, keys sorted, UTF-8. A peer advertises it
    (``tokenizer_sha256``) and a client checks the bundle it receives against it.

    Raises:
        InvalidInput: ``bundle`` is not a mapping, or holds values JSON cannot encode.
    """
    if not isinstance(bundle, Mapping):
        raise InvalidInput(f"tokenizer bundle must be a dict, got {type(bundle).__name__}")
    try:
        canon = json.dumps({k: bundle.get(k) for k in BUNDLE_KEYS}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False, allow_nan=False)
        return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"tokenizer bundle holds a value JSON cannot encode: {exc}") from None


def _field(bundle: Mapping[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    value = bundle.get(key)
    if value is None and optional:
        return None
    if type(value) is not kind:  # exact: bool is not an int here
        raise InvalidInput(f"tokenizer bundle field {key!r} must be {kind.__name__}"
                           f"{' or null' if optional else ''}, got {type(value).__name__}")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _hf_template(config: Mapping[str, Any], path: Path) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise WeightsError(f"{path / 'tokenizer_config.json'}: chat_template must be a string")
    return template


def _hf_token(config: Mapping[str, Any], key: str, path: Path) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise WeightsError(f"{path / 'tokenizer_config.json'}: {key} must be a string")
    return value


class StreamDecoder:
    """Incremental detokenizer: feed generated ids one at a time, get finished text.

    Uses the prefix/read offset technique of text-generation-inference (``decode_token`` in
    ``server/text_generation_server/models/model.py``): decode the ids since the last emitted
    boundary with and without the new id, and emit the difference only when it does not end in
    U+FFFD (an incomplete UTF-8 character). Control and end-of-generation ids are dropped.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tk = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the ids decoded for context
        self._read = 0  # end of the ids whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (may be ``""``).

        Raises:
            InvalidInput: ``token_id`` is not an integer in ``[0, vocab_size)``.
        """
        (token_id,) = self._tk._check_ids([token_id])
        if token_id in self._tk._hidden_ids:
            return ""
        self._ids.append(token_id)
        done = self._tk._decode(self._ids[self._prefix:self._read])
        text = self._tk._decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        # Keep only the ids still needed as context for the next call.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Return the text still held back (an incomplete character shows as U+FFFD) and reset."""
        done = self._tk._decode(self._ids[self._prefix:self._read])
        text = self._tk._decode(self._ids[self._prefix:])
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(done):]
