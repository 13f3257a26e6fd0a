"""The byte-level BPE vocabulary: a ``tokenizers.Tokenizer`` rebuilt from a GGUF file's
``tokenizer.*`` metadata, or loaded from a Hugging Face directory (``tokenizer.json`` and
``tokenizer_config.json``), with the keyword arguments :class:`~meshinfer.text.tokenizer.Tokenizer`
takes besides it (chat template, bos/eos tokens, extra eos ids)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from meshinfer.core.errors import WeightsError
from meshinfer.core.gguf_header import read_gguf_metadata

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


def gguf_vocab(source: str | os.PathLike | Any) -> tuple[Path, Mapping[str, Any], tokenizers.Tokenizer, dict[str, Any]]:
    """The tokenizer stored in a GGUF file's ``tokenizer.*`` metadata, in parts.

    Args:
        source: the ``.gguf`` file, or anything with ``path`` and ``metadata`` (an open
            :class:`~meshinfer.engine.weights.gguf_file.GGUFFile`).

    Returns:
        ``(path, metadata, bpe, kwargs)``: ``kwargs`` are the ``chat_template``, ``bos_token``,
        ``eos_token``, ``eos_ids`` and ``add_bos_token`` arguments of ``Tokenizer``.

    Raises:
        FileNotFoundError: no such file.
        WeightsError: unreadable metadata, a tokenizer model other than ``gpt2`` (byte-level
            BPE), an unsupported ``tokenizer.ggml.pre``, inconsistent token tables, or a
            ``tokenizer.chat_template`` that is not a string. The message names the field.
    """
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
    return path, meta, tok, dict(
        chat_template=template,
        bos_token=None if ids["bos_token_id"] is None else tokens[ids["bos_token_id"]],
        eos_token=None if ids["eos_token_id"] is None else tokens[ids["eos_token_id"]],
        eos_ids=[i for k, i in ids.items() if k != "bos_token_id" and i is not None],
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def hf_dir_vocab(path: Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The tokenizer of a Hugging Face model directory ``path``, in parts: ``(tokenizer,
    kwargs)`` with ``kwargs`` the ``chat_template``, ``bos_token``, ``eos_token``, ``eos_ids``
    and ``add_bos_token`` arguments of ``Tokenizer``.

    Raises:
        WeightsError: a file is missing, unparsable or holds a field of the wrong type; the
            message names the file and field.
    """
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
    return tok, dict(chat_template=template, bos_token=_hf_token(config, "bos_token", path),
                     eos_token=_hf_token(config, "eos_token", path),
                     eos_ids=extra, add_bos_token=bool(config.get("add_bos_token", False)))


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
