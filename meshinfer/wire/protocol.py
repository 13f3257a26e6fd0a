"""The meshinfer wire protocol: typed, versioned messages in msgpack, validated in one place.

Every frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": TYPE, ...fields}``. Unknown
fields are ignored, so newer peers can add fields without breaking older ones; a missing
or mistyped field is a :class:`~meshinfer.core.errors.ProtocolError`. Tensors travel as
``{"dtype": "f32", "shape": [B, T, C], "data": <raw little-endian bytes>}`` — never
pickle, never JSON floats. The message catalogue is documented in ``docs/protocol.md``.

Encoding and decoding happen only here: :func:`encode` and :func:`decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import ProtocolError, VersionMismatch
from meshinfer.core.sampling_params import SamplingParams

#: Version of the wire protocol. A handshake whose version differs is refused. 2 (2026-12-03):
#: a hop's hidden states to its next hop carry its signature (``sig``), required. 3 (2026-12-03):
#: conversation keys (``meshinfer.wire.convkeys``): a conversation's id is derived from its
#: client's key, and opens, reroutes and steps carry the client's signature, required.
PROTOCOL_VERSION = 3

#: Largest ``seq`` of a step (a client counts from 1; hops sign it as 8 bytes).
MAX_SEQ = (1 << 62) - 1

#: Peer states as advertised.
JOINING, READY, DRAINING = "joining", "ready", "draining"
PEER_STATES = (JOINING, READY, DRAINING)


#: Largest number of tensor dimensions accepted.
MAX_TENSOR_DIMS = 4
#: Most elements in one list field (token ids per step, adverts per gossip, trace entries).
MAX_LIST_LEN = 1 << 16
#: Bytes a ``tokenizer`` part leaves free in its frame for the rest of the reply, and the
#: smallest part a peer sends (a relay with a smaller frame limit cannot carry the bundle).
TOKENIZER_PART_MARGIN_BYTES, MIN_TOKENIZER_PART_BYTES = 4096, 64 * 1024
#: Longest string field (URLs, ids, error text) in characters.
MAX_STR_LEN = 4096
#: Longest peer id accepted in a trace or an ``rtts_ms`` map, characters (ids are 32 hex digits).
MAX_ID_LEN = 64
#: Most addresses in an advert or in an ``open``'s ``next``: each is dialed, so an attacker's long
#: list would make peers and clients dial (and wait on) whatever it names.
MAX_ADDRS = 4
#: Longest address accepted, characters.
MAX_ADDR_LEN = 256
#: Most relays an advert lists (peer ids of the peers a NAT'd peer keeps outbound links to).
MAX_RELAYS = 4
#: The only URL schemes a peer or client dials.
ADDR_SCHEMES = ("ws://", "wss://")
#: Most entries of a step's trace (one per hop).
MAX_TRACE_HOPS = 64
#: Most tokens of a step with ``want="tokens"`` (speculative verification): the last hop computes
#: T x V float32 logits for it (19 MB for T = 32 and V = 151,936), not only the last position's.
MAX_VERIFY_TOKENS = 32
#: What a step asks the last hop for: nothing, the argmax of its last position, or the argmax
#: of every position (speculative verification; added in protocol 1 without a version bump:
#: a peer that predates it answers ``protocol_error`` naming ``want``).
STEP_WANTS = ("none", "token", "tokens")
#: Precisions that choose the same tokens on every backend (tested: tests/test_gpu.py checks CUDA
#: f32 against CPU f32). Any other precision is repeatable only on one kind of backend: bf16,
#: int8 and GGUF block kernels round and accumulate differently on CPU, CUDA and Metal (the blog this
#: project follows saw Q4_K_M choose other tokens on CUDA than on Metal), so it chains only with
#: peers of the same device type.
PORTABLE_PRECISIONS = frozenset({"f32"})


def numerics_backend(device: str, precision: str) -> str:
    """The backend part of a compat key: ``"any"`` for a :data:`PORTABLE_PRECISIONS` precision,
    else the device type (``"cpu"``, ``"cuda"``, ``"mps"``; ``"cuda:1"`` -> ``"cuda"``)."""
    return "any" if precision in PORTABLE_PRECISIONS else (device.split(":", 1)[0] or "cpu")


@dataclass(frozen=True)
class PeerAdvert:
    """What a peer announces about itself; gossiped through the mesh.

    Attributes:
        peer_id: hex id derived from the peer's public key.
        addrs: websocket URLs the peer can be dialed at (may be empty behind NAT).
        protocol_version: the peer's :data:`PROTOCOL_VERSION`.
        weights_hash: sha256 hex of the weights (see ``meshinfer.engine.weights.identity``).
        architecture: one of ``meshinfer.core.config.SUPPORTED_ARCHITECTURES`` (``"qwen2"``, ``"qwen3moe"`` ...).
        num_layers: L, layers of the whole model.
        layers: the half-open layer range this peer holds.
        device: ``"cpu"``, ``"cuda:0"``, ``"mps"`` ...
        precision: compute precision identity, e.g. ``"f32"`` or ``"bf16"``.
        state: ``"joining"``, ``"ready"`` or ``"draining"``.
        free_kv_tokens: how many more tokens of KV cache the peer can hold for its range.
        compute_ms_per_token: measured decode time of its whole range per token, milliseconds.
        rtts_ms: the peer's measured round-trip times to other peers, by peer id, milliseconds.
        seq: per-peer counter, larger means newer.
        ttl_s: seconds the record stays valid after it was received, unless refreshed. Not
            signed: relays rewrite it to the remaining lifetime.
        public_key: hex of the peer's raw 32-byte Ed25519 public key (``peer_id`` derives from it).
        sig: hex Ed25519 signature of :meth:`signed_bytes` by that key (see
            :func:`meshinfer.wire.discovery.sign_advert`).
        tls_fingerprint: hex SHA-256 of the TLS certificate the peer serves ``wss://`` with,
            or "" without TLS. Signed, so a dialer can pin the certificate by peer id. Sent
            only when set, so adverts of plain peers keep their old bytes.
        tokenizer_sha256: hex SHA-256 of the tokenizer bundle the peer serves with
            ``get_tokenizer`` (:func:`meshinfer.text.tokenizer.bundle_sha256`), or "" for a peer
            without one. Signed; a client takes the tokenizer only when it hashes to what most
            peers of its weights advertise. Sent only when set.
        params: weights the peer holds for its layers, in elements, whatever the precision
            (``ModelConfig.parameter_counts``); 0 from a peer that predates the field.
        active_params: weights one token reads there: ``params`` for a dense model, the router
            and ``k`` of ``E`` experts per layer for a mixture of experts. Both signed, sent
            only when set.
        relays: peer ids (at most :data:`MAX_RELAYS`) of reachable peers that forward frames to
            this peer over the links it opened to them, for a peer nobody can dial (``join
            --listen none``, or a failed reachability check); empty for a reachable peer.
            Signed like every other field, sent only when set.
    """

    peer_id: str
    addrs: tuple[str, ...]
    protocol_version: int
    weights_hash: str
    architecture: str
    num_layers: int
    layers: LayerRange
    device: str
    precision: str
    state: str = READY
    free_kv_tokens: int = 0
    compute_ms_per_token: float = 0.0
    rtts_ms: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    seq: int = 0
    ttl_s: float = 15.0
    public_key: str = ""
    sig: str = ""
    tls_fingerprint: str = ""
    tokenizer_sha256: str = ""
    params: int = 0
    active_params: int = 0
    relays: tuple[str, ...] = ()

    @property
    def compat_key(self) -> tuple[str, str, int, int, str]:
        """Peers may share a route only when this key is equal: (hash, precision, protocol, L,
        backend), where backend is :func:`numerics_backend` of the device and precision."""
        return (self.weights_hash, self.precision, self.protocol_version, self.num_layers,
                numerics_backend(self.device, self.precision))

    def to_wire(self) -> dict:
        """A msgpack-able dict; the layer range travels half-open as ``[start, stop]``."""
        d = {"peer_id": self.peer_id, "addrs": list(self.addrs), "protocol_version": self.protocol_version,
                "weights_hash": self.weights_hash, "architecture": self.architecture,
                "num_layers": self.num_layers, "layers": [self.layers.start, self.layers.stop],
                "device": self.device, "precision": self.precision, "state": self.state,
                "free_kv_tokens": self.free_kv_tokens, "compute_ms_per_token": self.compute_ms_per_token,
                "rtts_ms": dict(self.rtts_ms), "seq": self.seq, "ttl_s": self.ttl_s,
                "public_key": self.public_key, "sig": self.sig}
        if self.tls_fingerprint:
            d["tls_fingerprint"] = self.tls_fingerprint
        if self.tokenizer_sha256:
            d["tokenizer_sha256"] = self.tokenizer_sha256
        if self.params:
            d["params"], d["active_params"] = self.params, self.active_params
        if self.relays:
            d["relays"] = list(self.relays)
        return d

    def signed_bytes(self) -> bytes:
        """Canonical encoding of every field but ``sig`` and ``ttl_s``: what the signature covers.

        Keys are sorted (``rtts_ms`` too) and numbers keep the types :meth:`from_wire` gives
        them, so a signer and a verifier build the same bytes from equal adverts.
        """
        d = self.to_wire()
        del d["sig"], d["ttl_s"]
        d["compute_ms_per_token"] = float(d["compute_ms_per_token"])
        d["rtts_ms"] = {k: float(d["rtts_ms"][k]) for k in sorted(d["rtts_ms"])}
        return msgpack.packb({k: d[k] for k in sorted(d)}, use_bin_type=True)

    @classmethod
    def from_wire(cls, d: Any) -> "PeerAdvert":
        """Validate and build an advert. Raises :class:`ProtocolError` naming the bad field."""
        f = Fields(d, "advert")
        num_layers = f.int("num_layers", lo=1, hi=1 << 16)
        layers = f.layer_range("layers")
        if layers.stop > num_layers:
            raise ProtocolError(f"advert: layers {layers.cli()} exceed num_layers {num_layers}")
        rtts = f.get("rtts_ms", dict, {})
        if len(rtts) > MAX_LIST_LEN or not all(isinstance(k, str) and len(k) <= MAX_ID_LEN and _finite(v)
                                               and v >= 0 for k, v in rtts.items()):
            raise ProtocolError("advert: field 'rtts_ms' must map peer ids to non-negative numbers")
        state = f.str("state")
        if state not in PEER_STATES:
            raise ProtocolError(f"advert: state {state!r} is not one of {', '.join(PEER_STATES)}")
        return cls(peer_id=f.str("peer_id"), addrs=check_addrs(f.str_list("addrs"), "advert"),
                   protocol_version=f.int("protocol_version", lo=0, hi=1 << 16),
                   weights_hash=f.str("weights_hash"), architecture=f.str("architecture"),
                   num_layers=num_layers, layers=layers, device=f.str("device"),
                   precision=f.str("precision"), state=state,
                   free_kv_tokens=f.int("free_kv_tokens", lo=0, hi=1 << 40),
                   compute_ms_per_token=f.float("compute_ms_per_token", lo=0.0),
                   rtts_ms={k: float(v) for k, v in rtts.items()}, seq=f.int("seq", lo=0, hi=1 << 62),
                   ttl_s=f.float("ttl_s", lo=0.0, hi=3600.0), public_key=f.str("public_key", ""),
                   sig=f.str("sig", ""), tls_fingerprint=f.str("tls_fingerprint", ""),
                   tokenizer_sha256=_sha256_hex(f, "tokenizer_sha256"),
                   params=f.int("params", lo=0, hi=1 << 50, default=0),
                   active_params=f.int("active_params", lo=0, hi=1 << 50, default=0),
                   relays=check_relays(f.str_list("relays", []), "advert"))


def _sha256_hex(f: "Fields", name: str) -> str:
    """Optional field ``name``: "" or 64 lowercase hex digits."""
    value = f.str(name, "")
    if value and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
        raise ProtocolError(f"advert: field {name!r} must be 64 lowercase hex digits")
    return value


def check_addrs(addrs: list[str], what: str) -> tuple[str, ...]:
    """``addrs`` when it holds at most :data:`MAX_ADDRS` ``ws://`` or ``wss://`` URLs of at most
    :data:`MAX_ADDR_LEN` characters each.

    Raises:
        ProtocolError: naming the count or the first bad address.
    """
    if len(addrs) > MAX_ADDRS:
        raise ProtocolError(f"{what}: field 'addrs' holds {len(addrs)} addresses; at most {MAX_ADDRS} are allowed")
    for url in addrs:
        if len(url) > MAX_ADDR_LEN or not url.lower().startswith(ADDR_SCHEMES) or len(url.split("://", 1)[1]) == 0:
            raise ProtocolError(f"{what}: address {url[:80]!r} is not a ws:// or wss:// URL of at most "
                                f"{MAX_ADDR_LEN} characters")
    return tuple(addrs)


def check_relays(relays: list[str], what: str) -> tuple[str, ...]:
    """``relays`` when it holds at most :data:`MAX_RELAYS` peer ids of at most :data:`MAX_ID_LEN` characters.

    Raises:
        ProtocolError: naming the count or the first bad id.
    """
    if len(relays) > MAX_RELAYS:
        raise ProtocolError(f"{what}: field 'relays' holds {len(relays)} peer ids; at most {MAX_RELAYS} are allowed")
    for rid in relays:
        if not 0 < len(rid) <= MAX_ID_LEN:
            raise ProtocolError(f"{what}: relay {rid[:80]!r} is not a peer id")
    return tuple(relays)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Fields:
    """Typed access to a decoded map; every failure is a :class:`ProtocolError` naming the field.

    Methods ``str``, ``int``, ``float``, ``str_list``, ``layer_range`` and ``get`` take the
    field name and an optional default (missing field -> ``ProtocolError`` unless given).
    """

    def __init__(self, d: Any, what: str) -> None:
        if not isinstance(d, dict):
            raise ProtocolError(f"{what}: expected a map, got {type(d).__name__}")
        self.d, self.what = d, what

    def get(self, key: str, kind: type | tuple, default: Any = ...) -> Any:
        if key not in self.d or self.d[key] is None:
            if default is ...:
                raise ProtocolError(f"{self.what}: field {key!r} is missing")
            return default
        value = self.d[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ProtocolError(f"{self.what}: field {key!r} has type {type(value).__name__}")
        return value

    def str(self, key: str, default: Any = ...) -> str:
        value = self.get(key, str, default)
        if isinstance(value, str) and len(value) > MAX_STR_LEN:
            raise ProtocolError(f"{self.what}: field {key!r} is longer than {MAX_STR_LEN} characters")
        return value

    def int(self, key: str, *, lo: int, hi: int, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value is not None and not lo <= value <= hi:
            raise ProtocolError(f"{self.what}: field {key!r} = {value} is outside [{lo}, {hi}]")
        return value

    def float(self, key: str, *, lo: float = -math.inf, hi: float = math.inf, default: Any = ...) -> float:
        value = self.get(key, (int, float), default)
        if value is not None and (not _finite(value) or not lo <= value <= hi):
            raise ProtocolError(f"{self.what}: field {key!r} = {value} is not a finite number in [{lo}, {hi}]")
        return None if value is None else float(value)

    def str_list(self, key: str, default: Any = ...) -> list[str]:
        value = self.get(key, list, default)
        if len(value) > 64 or not all(isinstance(x, str) and len(x) <= MAX_STR_LEN for x in value):
            raise ProtocolError(f"{self.what}: field {key!r} must be a list of at most 64 strings")
        return value

    def int_list(self, key: str, *, lo: int, hi: int, max_len: int, default: Any = ...) -> list[int]:
        """A list of at most ``max_len`` ints, each in ``[lo, hi]`` (bools refused)."""
        value = self.get(key, list, default)
        if value is not None and (len(value) > max_len or not all(
                type(x) is int and lo <= x <= hi for x in value)):
            raise ProtocolError(f"{self.what}: field {key!r} must be a list of at most {max_len} "
                                f"integers in [{lo}, {hi}]")
        return value

    def layer_range(self, key: str) -> LayerRange:
        value = self.get(key, list)
        if len(value) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ProtocolError(f"{self.what}: field {key!r} must be [start, stop]")
        if not 0 <= value[0] < value[1] <= 1 << 16:
            raise ProtocolError(f"{self.what}: field {key!r} = {value} is not a valid half-open layer range")
        return LayerRange(value[0], value[1])


def trace_from_wire(value: Any, what: str) -> list[dict]:
    """A step's trace rebuilt from its known fields, at most :data:`MAX_TRACE_HOPS` entries.

    Each hop forwards the trace it received plus its own entry, so whatever else a sender
    packed into it would travel on, and could push the next frame past the receiver's limit.

    Raises:
        ProtocolError: the trace is not a list of ``{peer, compute_ms, queue_ms}`` maps.
    """
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: field 'trace' has type {type(value).__name__}")
    out = []
    for d in value[:MAX_TRACE_HOPS]:
        f = Fields(d, f"{what}.trace")
        peer = f.str("peer")
        if len(peer) > MAX_ID_LEN:
            raise ProtocolError(f"{what}.trace: field 'peer' is longer than {MAX_ID_LEN} characters")
        out.append({"peer": peer, "compute_ms": f.float("compute_ms", lo=0.0),
                    "queue_ms": f.float("queue_ms", lo=0.0)})
    return out


def sampling_from_wire(value: Any, what: str) -> SamplingParams | None:
    """The optional ``sampling`` field of a ``step``: None (greedy) or checked parameters.

    Wire form ``{"temperature": float in [0, 100], "top_p": float in (0, 1], "seed": int in
    [0, 2**63)}``; every key is required when the map is sent. Unknown keys are ignored.

    Raises:
        ProtocolError: not a map, a missing or mistyped key, a value out of range.
    """
    if value is None:
        return None
    f = Fields(value, f"{what}.sampling")
    top_p = f.float("top_p", lo=0.0, hi=1.0)
    if top_p <= 0.0:
        raise ProtocolError(f"{what}.sampling: field 'top_p' = {top_p} must be above 0")
    return SamplingParams(temperature=f.float("temperature", lo=0.0, hi=100.0), top_p=top_p,
                          seed=f.int("seed", lo=0, hi=(1 << 63) - 1))


# --------------------------------------------------------------------------- messages
#: Message types. Direction: C client, P peer. See docs/protocol.md.
MESSAGE_TYPES = frozenset({
    "hello",      # C/P -> P   first frame: role, nonce; peers add their signed advert
    "welcome",    # P -> C/P   reply to hello: the peer's signed advert, nonce and proof
    "auth",       # C/P -> P   proof of the dialer's key (peers) and of the mesh key (private mesh)
    "authed",     # P -> C/P   reply to auth
    "get_peers",  # C/P -> P   ask for the peer table
    "peers",      # P -> C/P   adverts
    "gossip",     # P -> P     adverts pushed periodically
    "ping",       # any        RTT probe, echoed as pong
    "pong",
    "get_tokenizer",  # C -> P
    "tokenizer",      # P -> C   tokenizer bundle + weights hash
    "open",       # C -> P     open a conversation on this hop
    "opened",     # P -> C
    "step",       # C -> P1 (token ids), Pi -> Pi+1 (hidden states)
    "token",      # Plast -> C the chosen token of a step (and every position's, want="tokens")
    "truncate",   # C -> P     drop cached positions >= length
    "truncated",  # P -> C
    "reroute",    # C -> P     failover: new prev/next for a hop that stays on the route
    "rerouted",   # P -> C
    "probe",      # C -> P     failover: how many positions does this hop hold?
    "probed",     # P -> C
    "close",      # C -> P     end a conversation
    "get_log",    # C -> P     spot-check: the hidden states this hop sent for positions [start, stop)
    "log",        # P -> C
    "verify",     # C -> P     spot-check: run layers statelessly over a prefix, return positions >= check
    "verified",   # P -> C
    "error",      # any        error reply; carries conv and seq when about a step
    "relay",      # C/P -> relay (with to), relay -> hidden P: one frame of a circuit, toward the hidden peer
    "relay_back",  # hidden P -> relay -> C/P: one frame of a circuit, back toward its opener
    "relay_close",  # either way: the circuit is gone
    "dial_back",  # P -> P     reachability check: dial my advertised addresses
    "dialed_back",  # P -> P   reply: which answered
})


def encode(msg_type: str, **fields: Any) -> bytes:
    """Encode one frame. ``fields`` must be msgpack-able (use :func:`tensor_to_wire` for tensors)."""
    if msg_type not in MESSAGE_TYPES:
        raise ValueError(f"unknown message type {msg_type!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg_type, **fields}, use_bin_type=True)


def wire_size(obj: Any) -> int:
    """Bytes ``obj`` takes in a frame."""
    return len(msgpack.packb(obj, use_bin_type=True))


def _check_complete(frame: bytes) -> None:
    """Walk ``frame`` with msgpack's C skipper, which builds no object.

    msgpack allocates every array at the length its header declares, so a 3 KB frame of
    nested headers each declaring 65,535 elements costs the decoder tens of MB and a tenth
    of a second before it finds the elements missing. A frame that skips to its end holds
    every element it declares, so decoding it allocates in proportion to its size.
    """
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(frame), 1))
    unpacker.feed(frame)
    try:
        unpacker.skip()
    except msgpack.OutOfData as exc:
        raise ProtocolError("frame is not valid msgpack: it ends inside an object") from exc
    except msgpack.StackError as exc:
        raise ProtocolError("frame is not valid msgpack: containers nest too deep") from exc
    except msgpack.FormatError as exc:
        raise ProtocolError("frame is not valid msgpack: it holds the reserved type byte 0xc1") from exc
    except ValueError as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc or type(exc).__name__}") from exc


def unpack(data: bytes, *, max_bytes: int) -> Any:
    """The object msgpack ``data`` holds, decoded within a frame's limits: every string and
    bytes at most ``max_bytes``, lists at most :data:`MAX_LIST_LEN`, maps 1,024 entries, no
    extension types, string keys, and nothing declared that is not there (:func:`_check_complete`).

    Raises:
        ProtocolError: ``data`` is not such msgpack.
    """
    _check_complete(data)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes,
                               max_str_len=max_bytes, max_array_len=MAX_LIST_LEN, max_map_len=1024,
                               max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc


def decode(frame: bytes | str, *, max_bytes: int) -> tuple[str, Fields]:
    """Decode and check the envelope of one frame.

    Args:
        frame: the websocket message.
        max_bytes: largest payload accepted; bounds every msgpack container and string.

    Returns:
        ``(type, fields)`` where ``fields`` gives typed access that raises ``ProtocolError``.

    Raises:
        ProtocolError: text frames, invalid msgpack, a non-map, unknown type.
        VersionMismatch: a version other than :data:`PROTOCOL_VERSION`, naming both.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("frames must be binary msgpack, got a text frame")
    f = Fields(unpack(frame, max_bytes=max_bytes), "message")
    version = f.get("v", int)
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version} is not supported; this side speaks "
                              f"version {PROTOCOL_VERSION}")
    msg_type = f.str("t")
    if msg_type not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {msg_type[:64]!r}")
    f.what = msg_type
    return msg_type, f
