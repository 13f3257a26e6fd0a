"""The meshinfer exception tree.

Every error a user or a remote peer can cause is a subclass of :class:`MeshError`.
Messages carry the numbers involved (sizes, positions, layer indices) so that a
one-line report is enough to act on. ``assert`` is reserved for internal
invariants and never guards input.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class of every error meshinfer raises on purpose."""

    #: Short machine-readable kind, sent on the wire in error replies.
    code = "mesh_error"


class WeightsError(MeshError, ValueError):
    """A weights file is unreadable: wrong magic, truncated, inconsistent or unsupported.

    The message names the file and the field or tensor at fault.
    """

    code = "bad_weights"


class UnsupportedTensorType(WeightsError):
    """A tensor uses a quantization type that meshinfer cannot dequantize."""

    code = "unsupported_tensor_type"


class ModelNotFound(MeshError, FileNotFoundError):
    """``--model`` is neither an existing path nor a known model name."""

    code = "model_not_found"


class DownloadError(MeshError):
    """``meshinfer pull`` could not fetch or verify a model."""

    code = "download_failed"


class LayerRangeError(MeshError, ValueError):
    """A layer range is empty, reversed, or outside the model's ``[0, num_layers)``."""

    code = "bad_layer_range"


class InvalidInput(MeshError, ValueError):
    """Input to a model or tokenizer is invalid (token id >= vocabulary size, wrong shape, ...)."""

    code = "invalid_input"


class ContextOverflow(InvalidInput):
    """A prompt, or prompt plus ``max_tokens``, exceeds the model's context length."""

    code = "context_overflow"


class PositionError(InvalidInput):
    """A step's positions leave a gap or overlap with what a KV cache already holds."""

    code = "bad_positions"


class CacheFull(MeshError):
    """A peer's KV budget (bytes) cannot hold another conversation or more tokens."""

    code = "cache_full"


class RateLimited(MeshError):
    """A client went over a peer's per-client limit (conversations, steps/s or bytes/s)."""

    code = "rate_limited"


class ProtocolError(MeshError):
    """A wire message is malformed: bad msgpack, unknown type, missing or mistyped field."""

    code = "protocol_error"


class DraftsRefused(ProtocolError):
    """A hop does not verify drafts (a step with ``want="tokens"``): it predates speculative
    decoding. Such a peer answers ``protocol_error`` naming ``want``;
    :func:`meshinfer.wire.transport.remote_error` turns that answer into this error, and the
    client then decodes without drafts."""

    code = "drafts_refused"


class VersionMismatch(ProtocolError):
    """The remote side speaks a protocol version this side cannot understand."""

    code = "version_mismatch"


class PeerUnavailable(MeshError):
    """A peer could not be reached, closed the connection, or missed its deadline.

    Attributes:
        peer: when a hop reports that its connection to its next hop closed mid-conversation,
            that next hop's peer id (on the wire: the error frame's ``peer``); else None.
        relay: the relay that connection ran through (the error frame's ``relay``), or None
            for a direct connection.
        reporter: the hop that sent this error (set by the client when a hop reports it), or
            None when the client found it itself (a closed link, a missed deadline).
    """

    code = "peer_unavailable"

    def __init__(self, message: str = "", *, peer: str | None = None, relay: str | None = None) -> None:
        super().__init__(message)
        self.peer, self.relay = peer, relay
        self.reporter: str | None = None


class Unauthenticated(MeshError):
    """A remote could not prove its key (or the mesh key), or acted before proving it."""

    code = "unauthenticated"


class LyingPeer(MeshError):
    """A hop's replies do not match its advert: hidden states it sent fail the cheap checks
    (dtype, shape, positions, finite values, plausible RMS), or a spot-check recomputation of
    its layers on another peer disagrees beyond the tolerance (see ``meshinfer.peer.verify``).

    Attributes:
        suspect: the peer id of the hop that produced the bad output, when known. On the wire
            it travels as the error frame's ``suspect`` field.
        reporter: the hop whose word this is, when it is a hop's accusation with nothing the
            client can check (``unproven``; set by the client, never read from the wire).
        unproven: the accusation carries no evidence the accused cannot dispute: the client
            backs the suspect off instead of banning it (docs/security.md, "Lying peers").
    """

    code = "lying_peer"

    def __init__(self, message: str, *, suspect: str | None = None) -> None:
        super().__init__(message)
        self.suspect = suspect
        self.reporter: str | None = None
        self.unproven = False


class IncompatiblePeer(MeshError):
    """A peer's weights hash, precision or protocol differs from the rest of the route."""

    code = "incompatible_peer"


class IncompatibleDraft(InvalidInput):
    """A draft model whose vocabulary differs from the mesh model's (drafts would be other ids)."""

    code = "incompatible_draft"


class NoRoute(MeshError):
    """No chain of compatible ready peers covers every layer; the message says what is missing."""

    code = "no_route"


class DeviceError(MeshError):
    """A compute device cannot be used; the message carries advice (driver, torch build)."""

    code = "device_error"


class StepAbandoned(MeshError):
    """A forward pass stopped between two layers because nobody waits for its result any more
    (the step's conversation ended): the KV cache it wrote to must be freed, not used."""

    code = "step_abandoned"


class TemplateError(InvalidInput):
    """A chat template cannot render the given messages (``raise_exception`` in the template,
    an undefined variable, a sandbox violation) or the model has no chat template."""

    code = "bad_template"
