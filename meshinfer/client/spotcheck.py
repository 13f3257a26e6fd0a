"""Client spot-checks: a hop's logged output for unchecked positions is recomputed by a second
peer serving the same layers, and the two must agree within :data:`TOLERANCE`.

The cheap checks every hop runs on what it receives, and the recomputation a peer does for a
verify, live in :mod:`meshinfer.peer.verify`; the numbers are in ``docs/security.md``.
"""

from __future__ import annotations

import logging
import math
import random

import torch

from meshinfer.core.config import LayerRange
from meshinfer.client.reports import witnesses
from meshinfer.core.errors import InvalidInput, LyingPeer, MeshError
from meshinfer.wire import discovery, tensors
from meshinfer.wire.tensors import DIGEST_BYTES, row_digests

log = logging.getLogger(__name__)


#: Spot-check tolerance, relative L2 error ||y - y'|| / ||y|| over the checked positions, by
#: precision. f32: one-shot vs token-by-token vs 7-token chunks, 1 vs 2 threads, of the same
#: layers differ by at most 8e-7 overall (4.3e-6 at the worst single position) on both real
#: models; 1e-3 leaves a factor of 200 over the worst position and still flags 1e-2 noise. bf16/f16 are not measured; 5e-2 is an estimate
#: from their 8- and 11-bit mantissas accumulated over a hop's layers.
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2, "f16": 5e-2,
             # quantized precisions round every projection's input and output to bf16, and
             # their kernels may sum in another order for another number of rows: the bf16
             # estimate. From models.quant.DENSE_MIN_ROWS rows on a pass uses bf16-rounded
             # dequantized weights instead: a 12-layer hop of the default model, 200 tokens at
             # once against the kernels, differs by 2.4e-3 (q8), a twentieth of it (the kernels
             # alone, one-shot vs 40-token chunks: 5e-4); tests/test_quant.py
             "q8-bf16": 5e-2,
             # the file's own blocks: a pass of DENSE_MIN_ROWS rows or more multiplies float32
             # activations, a decode step the mode's; a 12-layer hop of the default model, 120
             # tokens at once against token by token, differs by 2.8e-7 (gguf), 7.5e-6
             # (gguf-a16) and 1.8e-3 (gguf-a8, int8 activations)
             "gguf": 1e-3, "gguf-a16": 1e-3, "gguf-a8": 5e-2}


#: Share of decode steps after which the client spot-checks one random hop (besides the
#: check of every checkable hop after each prefill). 0 turns spot-checks off.
DEFAULT_SPOT_CHECK_RATE = 0.05
#: Third peers asked to settle one dispute, at most: each recomputes the hop's layers over the
#: whole prefix, and only a referee independent of the side it agrees with settles it
#: (:func:`_second_opinion`), so a few are tried before the dispute is left undecided.
MAX_REFEREES = 3


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """||reference - other|| / ||reference|| (L2 over all elements, float64); inf on a shape mismatch."""
    if reference.shape != other.shape:
        return math.inf
    ref = reference.double()
    return float((ref - other.double()).norm() / ref.norm().clamp_min(1e-30))


class Auditor:
    """Client-side spot-check state of one conversation.

    Args:
        rate: share of decode steps followed by a spot-check of one random hop (0: never check).
        seed: seed of the choice of steps and hops (None: random).

    ``verified[(peer_id, layers)]`` is the number of leading positions whose output from that
    hop has been checked; ``emitted[p]`` is the token the route chose at position ``p``.
    """

    def __init__(self, *, rate: float = DEFAULT_SPOT_CHECK_RATE, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidInput(f"spot-check rate {rate} must be within [0, 1]")
        self.rate = rate
        self.rng = random.Random(seed)
        self.verified: dict[tuple[str, LayerRange], int] = {}
        self.emitted: dict[int, int] = {}
        self.checks = 0
        self.disputes: dict[str, set[str]] = {}  # peer id -> peers whose recomputation it contradicted

    def mark(self, hop) -> int:
        """Leading positions of ``hop``'s output already checked."""
        return self.verified.get((hop.peer_id, hop.layers), 0)

    def truncate(self, length: int) -> None:
        """Positions ``>= length`` were dropped: their checks and tokens no longer hold."""
        self.verified = {k: min(v, length) for k, v in self.verified.items()}
        self.emitted = {p: t for p, t in self.emitted.items() if p < length}

    def dispute(self, a: str, b: str) -> None:
        """Record that peers ``a`` and ``b`` disagreed on a recomputation with nobody to settle it."""
        self.disputes.setdefault(a, set()).add(b)
        self.disputes.setdefault(b, set()).add(a)

    def disputed_by(self, peer_id: str, banned: frozenset[str] = frozenset()) -> list[str]:
        """Peers (sorted, ``banned`` ones left out: a convicted liar's word no longer counts)
        that ``peer_id`` disagreed with."""
        return sorted(p for p in self.disputes.get(peer_id, ()) if p not in banned)

    def hops_to_check(self, hops, *, after_prefill: bool) -> list[int]:
        """Indices of the hops to check now: all after a prefill, else one with probability ``rate``."""
        if self.rate <= 0:
            return []
        if after_prefill:
            return list(range(len(hops)))
        if self.rng.random() < self.rate:
            return [self.rng.randrange(len(hops))]
        return []


def alternates(client, route, hop) -> list:
    """Adverts of other ready peers (other hops of the route included: a verify is stateless)
    that can run ``hop``'s layers with the route's identity."""
    banned = client.backed_off()
    return [p for p in client.table.values()
            if p.peer_id != hop.peer_id and p.peer_id not in banned and p.state == "ready"
            and p.compat_key == route.compat_key and p.layers.start <= hop.layers.start
            and hop.layers.stop <= p.layers.stop]


async def spot_check(conv, i: int) -> bool:
    """Recompute hop ``i``'s output for its unchecked positions on another peer and compare.

    Also compares the logs with what the neighbours received: the previous hop's log of
    positions ``[0, b)`` (the recomputation's input) against hop ``i``'s digests of what it
    received, and hop ``i``'s log against the next hop's digests, so a hop cannot send one
    thing and show the client another.

    Args:
        conv: the :class:`~meshinfer.client.conversation.Conversation` (its route, tokens and auditor).
        i: index of the hop in ``conv.route.hops``.

    Returns:
        True when checked and consistent; False when it could not be checked (no other peer
        serves those layers, the prefix is longer than one step frame, nothing new to check,
        or the checking peer refused or failed).

    Raises:
        LyingPeer: the outputs differ beyond :data:`TOLERANCE` (``suspect`` is hop ``i``), or a
            log differs from what the next hop received (``suspect``: the log's owner when the
            next hop shows the owner's signature of what it received, else the next hop).
    """
    route, client, audit = conv.route, conv.client, conv.audit
    hops, b = route.hops, len(conv.cached)
    hop, last = hops[i], i == len(hops) - 1
    a = audit.mark(hop)
    if last:  # only positions whose token the client saw can be compared
        a = min([p for p in audit.emitted if a <= p < b] or [b])
    if last and getattr(conv, "sampling", None) is not None:
        return False  # sampled tokens are not the argmax: nothing to compare the last hop with
    others = alternates(client, route, hop)
    if a >= b or b > conv.max_step_tokens or not others:
        return False
    checker = audit.rng.choice(others)
    try:
        own_out, own_in = await _log_of(conv, i, 0, b)
        if i == 0:
            inputs = {"tokens": conv.cached[:b]}
        else:
            prev_out, _ = await _log_of(conv, i - 1, 0, b)
            await _same_rows(conv, i, prev_out, own_in, 0)
            inputs = {"hidden": tensors.tensor_to_wire(prev_out)}
        if not last:
            _, next_in = await _log_of(conv, i + 1, a, b)
            await _same_rows(conv, i + 1, own_out[:, a:], next_in, a)
        got = await _verify(client, checker, hop, a, b, inputs, None if last else own_out.shape[-1])
        try:
            _compare(audit, route, hop, checker, a, b, got, None if last else own_out[:, a:])
        except LyingPeer as exc:
            await _second_opinion(conv, hop, checker, [p for p in others if p is not checker], a, b, inputs,
                                  None if last else own_out[:, a:], exc)
    except LyingPeer:
        raise
    except MeshError as exc:
        log.info("spot-check of hop %s (layers %s) skipped: %s", hop.peer_id[:12], hop.layers.cli(), exc)
        return False
    audit.checks += 1
    audit.verified[(hop.peer_id, hop.layers)] = b
    log.debug("spot-check of %s at %d..%d passed", hop.peer_id[:12], a, b - 1)
    return True


async def _verify(client, checker, hop, a: int, b: int, inputs: dict, width: int | None):
    """``checker``'s recomputation of ``hop``'s layers over positions ``[0, b)``, from ``a`` on:
    hidden states ``(1, b - a, C)``, or argmax tokens when ``width`` is None (the last hop)."""
    link = await client.link(checker)
    _, f = await link.request("verify", timeout_s=max(30.0, client.request_timeout_s),
                              layers=[hop.layers.start, hop.layers.stop], check=a, **inputs)
    return tensors.verified_from_wire(f, count=b - a, width=width)


async def _second_opinion(conv, hop, checker, others: list, a: int, b: int, inputs: dict, claimed,
                          accusation: LyingPeer) -> None:
    """A checker disagreed with ``hop``: nobody is blamed on one peer's word, so that one lying
    checker cannot get an honest hop banned. Third peers that serve those layers recompute, one
    at a time in random order (at most :data:`MAX_REFEREES`), until one settles it: a referee settles the dispute when it and
    the side it agrees with are two independent witnesses against the other side
    (``reports.witnesses``: identities on one machine other than the accused's, keys being
    free, are one witness; an attack run got an honest hop banned by two checkers on one host
    giving the same false answer). With no such referee, a peer that has now contradicted two
    independent witnesses is blamed, and otherwise the dispute is recorded and nobody is.

    Raises:
        LyingPeer: a referee agrees with the checker (``suspect``: ``hop``) or with the hop
            (``suspect``: the checker, which lied about its recomputation), independently; or,
            with no such referee, the side of the dispute that two independent peers contradict.
        MeshError: an undecided dispute (the hop stays unverified).
    """
    host = conv.client.host

    def independent(peers: list[str], accused: str) -> bool:
        return witnesses({p: host(p) for p in peers}, host(accused)) > 1

    for referee in conv.audit.rng.sample(others, min(len(others), MAX_REFEREES)):
        got = await _verify(conv.client, referee, hop, a, b, inputs, None if claimed is None else claimed.shape[-1])
        try:
            _compare(conv.audit, conv.route, hop, referee, a, b, got, claimed)
        except LyingPeer:
            if independent([checker.peer_id, referee.peer_id], hop.peer_id):
                raise accusation from None  # two independent peers agree against the hop
            continue
        if independent([hop.peer_id, referee.peer_id], checker.peer_id):
            raise LyingPeer(f"spot-check: peer {checker.peer_id[:12]} answered a verify of layers {hop.layers.cli()} "
                            f"that peer {referee.peer_id[:12]} and the hop itself contradict", suspect=checker.peer_id)
    conv.audit.dispute(hop.peer_id, checker.peer_id)
    banned = conv.client.backed_off()
    if independent(conv.audit.disputed_by(hop.peer_id, banned), hop.peer_id):
        raise accusation
    if independent(against := conv.audit.disputed_by(checker.peer_id, banned), checker.peer_id):
        raise LyingPeer(f"spot-check: peer {checker.peer_id[:12]} contradicts the output of {len(against)} "
                        f"different peers, peer {hop.peer_id[:12]} among them", suspect=checker.peer_id)
    raise MeshError(f"peers {hop.peer_id[:12]} and {checker.peer_id[:12]} disagree on layers "
                    f"{hop.layers.cli()} and no third peer on another host settles it")


def _compare(audit, route, hop, checker, a: int, b: int, got, claimed) -> None:
    """Raise :class:`LyingPeer` when ``hop``'s output differs from ``checker``'s recomputation."""
    if claimed is None:
        wrong = [p for p in range(a, b) if p in audit.emitted and audit.emitted[p] != got[p - a]]
        if wrong:
            raise LyingPeer(f"spot-check: peer {hop.peer_id[:12]} (layers {hop.layers.cli()}) chose token "
                            f"{audit.emitted[wrong[0]]} at position {wrong[0]}; peer {checker.peer_id[:12]} "
                            f"computes {got[wrong[0] - a]}", suspect=hop.peer_id)
        return
    err, tol = relative_error(got, claimed), TOLERANCE.get(route.compat_key[1], 1e-3)
    if err > tol:
        raise LyingPeer(f"spot-check: output of peer {hop.peer_id[:12]} (layers {hop.layers.cli()}) at "
                        f"positions {a}..{b - 1} differs from peer {checker.peer_id[:12]}'s by {err:.2e} "
                        f"relative L2 (tolerance {tol:g})", suspect=hop.peer_id)


async def _same_rows(conv, j: int, sent: torch.Tensor, received: bytes, start: int) -> None:
    """Raise :class:`LyingPeer` when hop ``j - 1``'s log ``sent`` ``(1, n, C)`` (from position
    ``start``) differs from the digests hop ``j`` shows it ``received``. Either could be lying:
    :func:`_judge` weighs hop ``j``'s signed statement of the first differing position against
    the digest it showed (docs/security.md, "Signed steps")."""
    ours = row_digests(sent)
    if ours == received:
        return
    n = next(k for k in range(len(ours) // DIGEST_BYTES)
             if ours[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES] != received[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES])
    shown = received[n * DIGEST_BYTES:(n + 1) * DIGEST_BYTES]
    raise await _judge(conv, j, start + n, shown if len(shown) == DIGEST_BYTES else b"",
                       f"peer {conv.route.hops[j - 1].peer_id[:12]}'s log of position {start + n} differs from what "
                       f"peer {conv.route.hops[j].peer_id[:12]} shows it received")


async def _judge(conv, j: int, position: int, shown: bytes | None, what: str) -> LyingPeer:
    """Who lied, hop ``j - 1`` (the sender) or hop ``j`` (the receiver), about ``position``:
    ``what`` happened there, and ``shown`` is the digest hop ``j`` showed for it (None: it
    claims to hold a position the client never sent). Hop ``j`` shows hop ``j - 1``'s signed
    statement of the newest step that sent ``position`` (``get_log`` with ``signed_at``):

    - none that hop ``j - 1`` signed, or not covering ``position``: the receiver;
    - a step the client never sent (``PositionLedger.issued``; another seq, start or length):
      the sender, which made it up (a replay or a rollback of its own, say);
    - a step the client sent but not the one that last sent ``position``
      (``PositionLedger.seq_at``): the receiver, which shows a statement it holds no longer;
    - the client's step, with a digest other than ``shown``: the receiver; with ``shown``: the
      sender, whose log differs from what it signed and sent.
    """
    hops, ledger = conv.route.hops, conv.ledger
    sender, receiver = hops[j - 1].peer_id, hops[j].peer_id
    statement = await _statement_at(conv, j, position)

    def blame(suspect: str, why: str) -> LyingPeer:
        return LyingPeer(f"spot-check: {what}; {why}", suspect=suspect)

    if statement is None:
        return blame(receiver, f"peer {receiver[:12]} shows no statement signed by peer {sender[:12]} for it")
    seq, start, digests = statement
    if ledger.issued.get(seq) != (start, len(digests) // DIGEST_BYTES):
        return blame(sender, f"peer {sender[:12]} signed a step (seq {seq}, positions from {start}) that the "
                             f"client never sent")
    if position >= len(ledger.seq_at) or ledger.seq_at[position] != seq:
        return blame(receiver, f"peer {receiver[:12]} shows the statement of step {seq}, which no longer holds "
                               f"position {position}")
    k = position - start
    if shown is None or digests[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES] != shown:
        return blame(receiver, f"peer {receiver[:12]} shows a digest that peer {sender[:12]} did not sign")
    return blame(sender, f"peer {sender[:12]} signed and sent what peer {receiver[:12]} shows")


async def _log_of(conv, j: int, start: int, stop: int) -> tuple[torch.Tensor | None, bytes | None]:
    """Hop ``j``'s log for positions ``[start, stop)``: the hidden states it sent ``(1, n, C)``
    (None on the last hop) and the digests of those it received (None on hop 0)."""
    hops = conv.route.hops
    link = await conv.client.link(hops[j].peer)
    _, f = await link.request("get_log", timeout_s=conv.client.request_timeout_s, conv=conv.conv_id,
                              start=start, stop=stop)
    return tensors.log_from_wire(f, count=stop - start, hidden=j < len(hops) - 1, received=j > 0,
                                  digest_bytes=DIGEST_BYTES)


async def find_length_liar(conv, expected: int, reported: int) -> str:
    """The hop to blame when the last hop reports (in its ``token`` reply) holding ``reported``
    positions after a step, not ``expected``.

    Probes every hop up to the first that holds another count (or does not answer). Hop 0, or
    every hop holding ``expected`` (the last hop misreported in its ``token`` reply): that hop.
    The last hop that now says another count than it just reported, or does not answer: itself.
    A later hop ``i`` that claims more positions must show its previous hop's signed statement
    of the newest step that sent position ``expected``, which the client never sent:
    :func:`_judge` blames the previous hop when it signed a step the client never sent (it made
    up positions), else hop ``i`` (it over-reports, whatever digests it shows). A hop that holds
    fewer positions, or does not answer, blames its previous hop.
    """
    hops = conv.route.hops
    for i, hop in enumerate(hops):
        held = await conv.probe(hop)
        if held == expected:
            continue
        if i == len(hops) - 1 and held != reported:
            return hop.peer_id  # its probe contradicts the reply it just sent
        if i == 0:
            return hop.peer_id
        if held is not None and held > expected:
            return (await _judge(conv, i, expected, None, f"peer {hop.peer_id[:12]} holds {held} positions, the "
                                                          f"conversation {expected}")).suspect
        return hops[i - 1].peer_id
    return hops[-1].peer_id


async def _statement_at(conv, i: int, position: int) -> tuple[int, int, bytes] | None:
    """Hop ``i - 1``'s signed statement ``(seq, start, digests)`` of the newest step that sent
    ``position`` to hop ``i``, as hop ``i`` shows it (``get_log`` with ``signed_at``), when the
    signature verifies against hop ``i - 1``'s key and the step covers ``position``; else None
    (also when hop ``i`` fails or refuses)."""
    hops = conv.route.hops
    try:
        link = await conv.client.link(hops[i].peer)
        _, f = await link.request("get_log", timeout_s=conv.client.request_timeout_s, conv=conv.conv_id,
                                  start=position, stop=position + 1, signed_at=position)
        signed = f.get("signed", dict, None)
        if signed is None:
            return None
        seq, start, digests, sig = (signed.get(k) for k in ("seq", "start", "digests", "sig"))
        if type(seq) is not int or type(start) is not int or not 0 <= seq < 1 << 64 or not 0 <= start < 1 << 64 \
                or not isinstance(digests, bytes) or not isinstance(sig, bytes) or len(digests) % DIGEST_BYTES:
            return None
    except MeshError as exc:
        log.info("hop %s shows no input for position %d: %s", hops[i].peer_id[:12], position, exc)
        return None
    if not 0 <= position - start < len(digests) // DIGEST_BYTES or not discovery.check_step(
            hops[i - 1].peer.public_key, sig, conv.conv_id, seq, start, digests):
        return None
    return seq, start, digests
