"""Conversation keys: a conversation belongs to the client that holds its key.

A client makes a fresh Ed25519 key for each conversation (:class:`ConversationKey`). The
conversation's id is derived from the public key (:func:`conv_id_of`), so nobody else can open
a conversation under that id, and the client signs:

- every ``open`` and ``reroute`` it sends a hop (:func:`open_message`: the hop it is for, its
  layers, its neighbours, the KV it reserves, and ``n``, a number that grows with each open or
  reroute the client sends, so an old open replayed by someone who saw it cannot displace a
  newer one);
- every ``step`` (:class:`StepHeader`: seq, start, the number of positions, ``want``,
  ``sampling``, ``rollback``, ``replay`` and a digest of the token ids or hidden states the
  client sent). Hops pass the header's fields and the signature on unchanged, and every hop
  checks them against the key, so a hop cannot change what its next hops are asked to do (make
  the last hop sample, or answer nothing) and a relay cannot change the tokens.

Why: until protocol version 3 a hop that learnt a conversation's id could open it first on
another peer (blocking the client's failover to that peer) and could change the unsigned
``want`` and ``sampling`` of the steps it passed on (docs/security.md, "Conversation keys").
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshinfer.core.sampling_params import SamplingParams

#: Domain labels: a signature made for one purpose never verifies for another.
CONV_ID_LABEL = b"meshinfer-conversation\0"
OPEN_LABEL = b"meshinfer-open\0"
CLIENT_STEP_LABEL = b"meshinfer-client-step\0"
#: Bytes of a raw Ed25519 public key, of a signature, and of a step's payload digest (SHA-256).
KEY_BYTES, SIG_BYTES, PAYLOAD_DIGEST_BYTES = 32, 64, 32


def conv_id_of(public: bytes) -> str:
    """The conversation id of the raw 32-byte public key ``public``: hex of
    SHA-256(label + key)[:16], 32 characters, like a peer id."""
    return hashlib.sha256(CONV_ID_LABEL + public).hexdigest()[:32]


def public_key(raw: bytes) -> Ed25519PublicKey | None:
    """The Ed25519 public key of ``raw`` (32 bytes), or None when it is not one."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


def verifies(key: Ed25519PublicKey, sig: bytes, message: bytes) -> bool:
    """True when ``sig`` (64 bytes) is ``key``'s signature of ``message``."""
    if not isinstance(sig, bytes) or len(sig) != SIG_BYTES:
        return False
    try:
        key.verify(sig, message)
        return True
    except InvalidSignature:
        return False


def open_message(kind: str, to: str, conv_id: str, n: int, min_seq: int, layers: Sequence[int], max_tokens: int,
                 prev: str | None, next_id: str | None, next_addrs: Sequence[str],
                 next_relays: Sequence[str] | None) -> bytes:
    """The bytes a client signs for an ``open`` or ``reroute`` (``kind``) of ``conv_id``
    (number ``n``) sent to the peer ``to`` (its id): ``min_seq``, the lowest seq of any step
    the client sends from now on (the hop refuses older ones), the hop's layer range ``[a, b)``,
    ``max_tokens`` of KV, the previous hop's id (None on the first hop) and the next hop's id,
    addresses and relays (None on the last hop; relays None when the frame carries none).
    msgpack of a fixed list, so each field has one encoding."""
    return OPEN_LABEL + msgpack.packb(
        [kind, to, conv_id, n, min_seq, list(layers), max_tokens, prev, next_id, list(next_addrs),
         None if next_relays is None else list(next_relays)], use_bin_type=True)


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """SHA-256 (32 bytes) of token ids as little-endian int64: a step's payload on the first hop."""
    return hashlib.sha256(b"tokens\0" + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def hidden_digest(row_digests: bytes) -> bytes:
    """SHA-256 (32 bytes) of the row digests (:func:`meshinfer.wire.tensors.row_digests`) of
    hidden states a client sends a hop itself (a conversation opened past layer 0)."""
    return hashlib.sha256(b"hidden\0" + row_digests).digest()


@dataclass(frozen=True)
class StepHeader:
    """What a client asks of every hop in one step; signed by the client, checked by each hop.

    Attributes:
        conv_id: the conversation.
        seq: the step's number (grows with every step the client sends).
        start: position of the step's first token.
        count: positions in the step (T).
        want: ``"none"``, ``"token"`` or ``"tokens"`` (:data:`meshinfer.wire.protocol.STEP_WANTS`).
        sampling: the last hop's sampling settings, or None (greedy).
        rollback: the step drops the rejected drafts of the step before.
        replay: a failover replay.
        payload: :func:`tokens_digest` or :func:`hidden_digest` of what the client sent the first hop.
    """

    conv_id: str
    seq: int
    start: int
    count: int
    want: str
    sampling: SamplingParams | None
    rollback: bool
    replay: bool
    payload: bytes

    def message(self) -> bytes:
        """The signed bytes: a label, then msgpack of a fixed list of the fields (sampling as
        ``[temperature, top_p, seed]`` as float, float, int, or None)."""
        s = self.sampling
        sampling = None if s is None else [float(s.temperature), float(s.top_p), int(s.seed)]
        return CLIENT_STEP_LABEL + msgpack.packb(
            [self.conv_id, self.seq, self.start, self.count, self.want, sampling, bool(self.rollback),
             bool(self.replay), self.payload], use_bin_type=True)

    def check(self, key: Ed25519PublicKey, sig: bytes) -> bool:
        """True when ``sig`` is the client's signature (``key``) of this header."""
        return verifies(key, sig, self.message())


class ConversationKey:
    """A client's key for one conversation: its id, and signatures of its opens and steps.

    Attributes:
        conv_id: :func:`conv_id_of` the public key.
        public: the raw 32-byte public key (the ``client_key`` of an open).
        opens: opens and reroutes signed so far (each gets the next ``n``).
    """

    def __init__(self, private: Ed25519PrivateKey | None = None) -> None:
        self._key = private if private is not None else Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.conv_id = conv_id_of(self.public)
        self.opens = 0

    def open_fields(self, kind: str, to: str, min_seq: int, layers: Sequence[int], max_tokens: int,
                    prev: str | None, nxt: dict | None) -> dict:
        """The ``client_key``, ``n``, ``min_seq`` and ``client_sig`` fields of an ``open`` or
        ``reroute`` (``kind``) to the peer ``to`` with these fields (``nxt``: the frame's
        ``next`` map, or None); ``n`` is one more than the last."""
        self.opens += 1
        message = open_message(kind, to, self.conv_id, self.opens, min_seq, layers, max_tokens, prev,
                               nxt["peer_id"] if nxt else None, nxt["addrs"] if nxt else (),
                               nxt.get("relays") if nxt else None)
        return {"client_key": self.public, "n": self.opens, "min_seq": min_seq, "client_sig": self._key.sign(message)}

    def step_fields(self, header: StepHeader) -> dict:
        """The ``pd`` (payload digest) and ``csig`` fields of a step with ``header``."""
        return {"pd": header.payload, "csig": self._key.sign(header.message())}
