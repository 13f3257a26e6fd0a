"""The server side of the client's spot-checks: a hop's logs of a conversation (``get_log``) and
stateless recomputation of a prefix over some layers (``verify``).

A client recomputes a random position of a hop on another peer (``verify``) and compares it with
what the hop logged it sent (``get_log``); see :mod:`meshinfer.peer.verify` for the recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshinfer.core.errors import InvalidInput, LayerRangeError, RateLimited
from meshinfer.peer import verify
from meshinfer.peer.limits import client_host
from meshinfer.wire import tensors
from meshinfer.wire.transport import Link

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer


class Audits:
    """Spot-check requests ``peer`` answers.

    Attributes:
        verifying: client hosts with a ``verify`` running (one at a time per host).
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.verifying: set[str] = set()

    async def on_get_log(self, link: Link, f) -> None:
        """Spot-check: the hidden states this hop sent for positions ``[start, stop)`` (``hidden``,
        not on the last hop) and the digests of those it received (``received``, not on hop 0);
        with ``signed_at`` (a position), the previous hop's signed statement of the step that last
        sent that position, as this hop received it (``signed``: seq, start, digests, sig; absent
        when it holds none)."""
        conv = self.peer.convs.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("get_log: no such conversation on this connection")
        start = f.int("start", lo=0, hi=self.peer.cfg.max_position_embeddings)
        stop = f.int("stop", lo=start + 1, hi=start + self.peer.settings.max_step_tokens)
        await conv.queue.join()
        reply = {}
        if conv.sent is not None:
            reply["hidden"] = tensors.tensor_to_wire(conv.sent.slice(start, stop))
        if conv.run.start > 0:
            reply["received"] = conv.received_digests(start, stop)
        at = f.get("signed_at", int, None)
        if at is not None and 0 <= at < len(conv.signed_at) and conv.signed_at[at] is not None:
            seq, first, digests, sig = conv.signed_at[at]
            reply["signed"] = {"seq": seq, "start": first, "digests": digests, "sig": sig}
        await link.send("log", re=f.get("id", int, None), conv=conv.conv_id, **reply)

    async def on_verify(self, link: Link, f) -> None:
        """Spot-check: run ``layers`` statelessly over a prefix; return positions from ``check`` on.

        At most one verify per client host runs at a time (another gets ``rate_limited``); a prefix holds at most
        ``max_step_tokens`` positions, and clients' verifies count as steps in their limits.
        """
        run = f.layer_range("layers")
        if run.start < self.peer.shard.range.start or run.stop > self.peer.shard.range.stop:
            raise LayerRangeError(f"verify: this peer serves layers {self.peer.shard.range.cli()}, asked for {run.cli()}")
        n_max = self.peer.settings.max_step_tokens
        if run.start == 0:
            tokens = f.get("tokens", list)
            if not 0 < len(tokens) <= n_max or not all(type(t) is int and 0 <= t < self.peer.cfg.vocab_size
                                                       for t in tokens):
                raise InvalidInput(f"verify: tokens must be 1-{n_max} ids in [0, {self.peer.cfg.vocab_size})")
            x = torch.tensor([tokens], dtype=torch.int64)  # (1, P)
        else:
            x = tensors.tensor_from_wire(f.get("hidden", dict), width=self.peer.cfg.hidden_size,
                                          max_elements=n_max * self.peer.cfg.hidden_size)
            if x.dim() != 3 or x.shape[0] != 1 or x.dtype != torch.float32:
                raise InvalidInput(f"verify: hidden states must be float32 (1, P, {self.peer.cfg.hidden_size})")
        check = f.int("check", lo=0, hi=x.shape[1] - 1)
        host = client_host(link)
        if host in self.verifying:  # one at a time per host: a flood from one cannot starve the others
            raise RateLimited(f"peer {self.peer.peer_id[:12]} is busy with another verify from {host}; try later")
        self.verifying.add(host)
        try:
            out = await self.peer.executor.run(verify.recompute, self.peer.shard, x, run, check)
        finally:
            self.verifying.discard(host)
        reply = {"tokens": out} if isinstance(out, list) else {"hidden": tensors.tensor_to_wire(out)}
        await link.send("verified", re=f.get("id", int, None), **reply)
