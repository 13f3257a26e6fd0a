"""The tokenizer bundle: a tokenizer as plain JSON/msgpack-able data, which a peer sends a
weightless client (``get_tokenizer``), and its hash, which the peer advertises.

:meth:`~meshinfer.text.tokenizer.Tokenizer.to_bundle` writes one; :func:`read_bundle` checks one
received from the network field by field; :func:`bundle_sha256` hashes one as sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import tokenizers

from meshinfer.core.errors import InvalidInput

#: Version of the dict written by :meth:`Tokenizer.to_bundle`; other versions are refused.
BUNDLE_VERSION = 1

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


def read_bundle(bundle: Any) -> tuple[tokenizers.Tokenizer, dict[str, Any], int | None]:
    """The parts of a tokenizer bundle (e.g. received from a peer), each field checked.

    Unknown keys are ignored so that newer peers stay compatible.

    Returns:
        ``(tokenizer, kwargs, bos_id)``: ``kwargs`` are the ``chat_template``, ``bos_token``,
        ``eos_token``, ``eos_ids`` and ``add_bos_token`` arguments of
        :class:`~meshinfer.text.tokenizer.Tokenizer`; ``bos_id`` is the id the bundle gives
        ``bos_token``, for the caller to check against the vocabulary.

    Raises:
        InvalidInput: not a mapping, another ``version``, a missing or mistyped field, or a
            tokenizer JSON that does not load.
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
    return tok, dict(chat_template=_field(bundle, "chat_template", str, optional=True),
                     bos_token=_field(bundle, "bos_token", str, optional=True),
                     eos_token=_field(bundle, "eos_token", str, optional=True), eos_ids=eos_ids,
                     add_bos_token=_field(bundle, "add_bos_token", bool, optional=True) or False), bos_id
