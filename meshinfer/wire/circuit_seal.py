"""End-to-end sealing of a relay circuit: the relay forwards bytes it can neither read nor change.

A circuit's two ends (the opener, and the hidden peer behind the relay) first exchange
ephemeral X25519 keys in the circuit's first two frames:

1. the opener sends its 32-byte X25519 public key (:meth:`CircuitSeal.offer`);
2. the hidden peer answers with its own X25519 public key and its Ed25519 peer key's signature
   of both (:meth:`CircuitSeal.answer`), which the opener checks against the key of the peer it
   asked for (:meth:`CircuitSeal.accept`): a relay that answers itself cannot sign.

Both derive two 32-byte keys, one per direction, with HKDF-SHA256 (RFC 5869) of the X25519
shared secret (salt: both public keys), and every later frame of the circuit travels as
ChaCha20-Poly1305 (RFC 8439) ciphertext with a 16-byte tag, its nonce the frame's number in its
direction. A frame changed, dropped, replayed or reordered by the relay fails to open, and the
circuit ends. The handshake (hello, welcome, auth) and everything after it run inside.

Why: the relay sees and could alter everything on an unsealed circuit (docs/security.md,
"Relays"): the prompt's tokens for a hidden first hop, tokens sent back by a hidden last hop,
and any frame it wanted to forge, so an honest hidden peer was blamed for what its relay did.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from meshinfer.core.errors import ProtocolError

#: Domain labels: the answer's signature and the key derivation.
ANSWER_LABEL = b"meshinfer-circuit-answer\0"
KEYS_INFO = b"meshinfer-circuit-keys\0"
#: Bytes of an X25519 public key, an Ed25519 signature, and a ChaCha20-Poly1305 tag.
KX_BYTES, SIG_BYTES, TAG_BYTES = 32, 64, 16
#: Most bytes sealing adds to a frame (the tag); the answer frame is KX_BYTES + SIG_BYTES.
SEAL_OVERHEAD_BYTES = TAG_BYTES


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class CircuitSeal:
    """One end's sealing state for one circuit.

    The opener's end is made with ``peer_public_key`` (hex of the raw Ed25519 public key of the
    peer it asked the relay for, from that peer's signed advert); the hidden peer's end with
    ``sign_key`` (its Ed25519 private key).

    Attributes:
        keyed: the keys are derived; :meth:`seal` and :meth:`open` may be called.
    """

    def __init__(self, *, peer_public_key: str | None = None, sign_key=None) -> None:
        if (peer_public_key is None) == (sign_key is None):
            raise ValueError("a circuit seal needs the peer's public key (opener) or the signing key (hidden peer)")
        self._peer_key, self._sign_key = peer_public_key, sign_key
        self._x = X25519PrivateKey.generate()
        self._public = _raw(self._x.public_key())
        self._send = self._recv = None
        self._sent = self._received = 0
        self.keyed = False

    @property
    def opener(self) -> bool:
        return self._sign_key is None

    def offer(self) -> bytes:
        """The opener's first frame: its X25519 public key (32 bytes)."""
        return self._public

    def answer(self, offer: bytes) -> bytes:
        """The hidden peer's answer to the opener's ``offer``: its X25519 public key and its
        signature of both (96 bytes); derives the keys.

        Raises:
            ProtocolError: ``offer`` is not a 32-byte X25519 public key.
        """
        if self.opener or self.keyed or len(offer) != KX_BYTES:
            raise ProtocolError("circuit: the first frame must be the opener's 32-byte key offer")
        self._derive(offer, offer, self._public)
        return self._public + self._sign_key.sign(ANSWER_LABEL + offer + self._public)

    def accept(self, answer: bytes) -> None:
        """Check the hidden peer's ``answer`` (signed by the expected peer's key) and derive the keys.

        Raises:
            ProtocolError: a malformed answer, or a signature that is not the expected peer's.
        """
        if not self.opener or self.keyed or len(answer) != KX_BYTES + SIG_BYTES:
            raise ProtocolError("circuit: the first frame back must be the peer's signed key answer")
        theirs, sig = answer[:KX_BYTES], answer[KX_BYTES:]
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(self._peer_key)).verify(
                sig, ANSWER_LABEL + self._public + theirs)
        except (InvalidSignature, ValueError):
            raise ProtocolError("circuit: the key answer is not signed by the peer asked for") from None
        self._derive(theirs, self._public, theirs)

    def _derive(self, theirs: bytes, offer: bytes, answer: bytes) -> None:
        try:
            shared = self._x.exchange(X25519PublicKey.from_public_bytes(theirs))
        except ValueError:
            raise ProtocolError("circuit: not an X25519 public key") from None
        keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=offer + answer, info=KEYS_INFO).derive(shared)
        to_hidden, to_opener = ChaCha20Poly1305(keys[:32]), ChaCha20Poly1305(keys[32:])
        self._send, self._recv = (to_hidden, to_opener) if self.opener else (to_opener, to_hidden)
        self.keyed = True

    def seal(self, frame: bytes) -> bytes:
        """``frame`` as ciphertext with its tag (``len(frame) + TAG_BYTES`` bytes), the next in
        this direction."""
        self._sent += 1
        return self._send.encrypt(struct.pack(">4xQ", self._sent), frame, None)

    def open(self, data: bytes) -> bytes:
        """The frame sealed as ``data``, which must be the next one from the other end.

        Raises:
            ProtocolError: ``data`` was changed, replayed, reordered or not sealed by the other end.
        """
        self._received += 1
        try:
            return self._recv.decrypt(struct.pack(">4xQ", self._received), data, None)
        except InvalidTag:
            raise ProtocolError(f"circuit: frame {self._received} does not open (changed, replayed or "
                                f"out of order)") from None
