"""Conversation keys for hand-made frames (protocol version 3, ``meshinfer.wire.convkeys``).

Hostile tests name their conversations ("dup", "c1", ...). Each name gets a fixed key
(:func:`key_for`), so the frames a test writes become what a client holding that key sends:
:func:`authorize` replaces the name by the key's conversation id, signs ``open`` and
``reroute`` for the peer they go to, and signs ``step`` headers. Frames that name a
conversation no test opened keep their ``conv`` as written (forged frames for a victim's id
stay forged), and a frame that already carries ``client_key`` or ``csig`` is sent as written.
"""

from __future__ import annotations

import hashlib
import struct

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshinfer.core.errors import MeshError
from meshinfer.wire import convkeys, protocol, tensors

#: test name -> (key, the last ``n`` it signed)
_KEYS: dict[str, list] = {}
_IDS: dict[str, str] = {}  # conversation id -> test name


def key_for(name: str) -> convkeys.ConversationKey:
    """The fixed key of the test conversation ``name`` (the same in every connection)."""
    if name not in _KEYS:
        key = convkeys.ConversationKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(name.encode()).digest()))
        _KEYS[name] = [key, 0]
        _IDS[key.conv_id] = name
    return _KEYS[name][0]


def conv_id(name: str) -> str:
    """The conversation id of the test conversation ``name``."""
    return key_for(name).conv_id


def name_of(conv: str) -> str:
    """The test name of conversation id ``conv`` (``conv`` itself when it is no test's)."""
    return _IDS.get(conv, conv)


def authorize(msg_type: str, fields: dict, to: str | None) -> dict:
    """``fields`` of a frame of ``msg_type`` as the client holding the named conversation's key
    sends them to the peer ``to`` (see the module docstring)."""
    name = fields.get("conv")
    if not isinstance(name, str) or len(name) > 64 or name in _IDS or "client_key" in fields or "csig" in fields:
        return fields  # not a test's name (a malformed id, an id as the peer knows it), or signed already
    if msg_type in ("open", "reroute"):
        key_for(name)
    if name not in _KEYS:
        return fields
    key, _ = _KEYS[name]
    fields = dict(fields, conv=key.conv_id)
    if msg_type in ("open", "reroute") and "client_key" not in fields and to is not None:
        return fields | open_fields(name, msg_type, to, fields)
    if msg_type == "step" and "csig" not in fields:
        return fields | step_fields(name, fields)
    return fields


def open_fields(name: str, kind: str, to: str, fields: dict) -> dict:
    """``client_key``, ``n``, ``min_seq`` (0 unless given) and ``client_sig`` of an open (n 1: a
    second open of the same name is "already open") or a reroute (n above the last) of
    ``fields``; {} when they do not parse."""
    entry = _KEYS[name]
    n = 1 if kind == "open" else entry[1] + 1
    entry[1] = max(entry[1], n)
    nxt = fields.get("next")
    try:
        message = convkeys.open_message(
            kind, to, entry[0].conv_id, n, fields.get("min_seq", 0), fields["layers"], fields["max_tokens"],
            fields.get("prev"),
            nxt["peer_id"] if nxt else None, nxt.get("addrs", []) if nxt else (), nxt.get("relays") if nxt else None)
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}
    return {"client_key": entry[0].public, "n": n, "min_seq": fields.get("min_seq", 0),
            "client_sig": entry[0]._key.sign(message)}


def step_fields(name: str, fields: dict) -> dict:
    """``pd`` and ``csig`` of a step of ``fields`` (token ids, or hidden states whose payload
    digest is that of their rows); {} when the fields do not parse."""
    key = _KEYS[name][0]
    try:
        if "tokens" in fields:
            count, payload = len(fields["tokens"]), convkeys.tokens_digest(fields["tokens"])
        else:
            x = tensors.tensor_from_wire(fields["hidden"], max_elements=1 << 24)
            count, payload = x.shape[1], convkeys.hidden_digest(tensors.row_digests(x))
        sampling = protocol.sampling_from_wire(fields.get("sampling"), "step")
        header = convkeys.StepHeader(key.conv_id, fields["seq"], fields["start"], count, fields.get("want", "none"),
                                     sampling, fields.get("rollback", False), fields.get("replay", False), payload)
        return key.step_fields(header)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, struct.error, MeshError):
        return {}
