"""The numbers that bound what one connection, client host or peer may cost, and the KV budget default.

Every module of the peer reads these as ``limits.NAME`` when it runs, never as a copy taken
at import, so one assignment (a test's ``monkeypatch``) changes them for the whole peer; the
advert signature check :func:`verify_advert` is looked up here the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from meshinfer.core.errors import RateLimited
from meshinfer.wire import discovery
from meshinfer.wire.discovery import host_key
from meshinfer.wire.transport import Link

#: The signature check of a signed advert (:func:`meshinfer.wire.discovery.verify_advert`),
#: looked up here at each check so that a test can count the checks.
verify_advert = discovery.verify_advert

#: Seconds a connection has to send its ``hello`` before it is closed.
HELLO_TIMEOUT_S = 10.0
#: Seconds a connection has for its TLS and HTTP upgrade handshake (websockets' ``open_timeout``):
#: a connection that never finishes its headers (slowloris) is dropped after it.
HANDSHAKE_TIMEOUT_S = 10.0
#: Default most connections one remote IP address may hold open on a peer at once
#: (``ClientLimits.connections``, ``join --max-connections-per-host``); more get HTTP 503 at the
#: upgrade. An honest client holds one per peer; the default leaves room for many clients behind
#: one NAT and for every peer of a machine, and keeps one host far below the 1,024 open files
#: a process often gets.
DEFAULT_CONNECTIONS_PER_HOST = 256
#: Most adverts of one gossip frame that are looked at; the rest are dropped unread. An honest
#: payload holds at most :data:`GOSSIP_BUDGET_BYTES` (32 KiB, about 80 adverts).
MAX_GOSSIP_ADVERTS = 128
#: Gossip frames one connection may send per second, sustained (token bucket, bursts of 2 s);
#: further ones are dropped unread. An honest peer sends one per gossip round (2 s by default).
GOSSIP_FRAMES_PER_S = 10.0
#: Gossiped adverts one connection may make this peer parse and check the signature of per
#: second, sustained (token bucket, bursts of 2 s). Adverts not newer than the record held, and
#: second copies of a peer in one frame, cost nothing and are skipped; past the budget the rest
#: of the frame is dropped unread. A check and a parse take about 0.1 ms, so a flood costs a peer
#: under 1% of a core per connection. An honest neighbour sends its own advert first, then its
#: table every gossip round (2 s): 64 a second covers a full table of 128 changed adverts a round.
GOSSIP_VERIFIES_PER_S = 64.0
#: Seconds a connection that holds no conversation (a client, or a peer that has not proven its
#: key) may stay silent before it is closed: idle connections cannot pile up to the open-file limit.
IDLE_LINK_TIMEOUT_S = 120.0
#: Tokenizer bundles one connection may fetch at once, then one per :data:`TOKENIZER_EVERY_S`
#: seconds (a bundle is up to 10 MB: a loop of requests would be a bandwidth amplifier).
TOKENIZER_BURST, TOKENIZER_EVERY_S = 2, 30.0
#: Tokenizer bundles one client host may fetch at once over all its connections (a machine
#: running a few chats and a ``serve`` at once), then one per TOKENIZER_HOST_EVERY_S seconds:
#: 2.7 MB/s of the default model's 5.4 MB bundle per host at most, after a burst.
TOKENIZER_HOST_BURST, TOKENIZER_HOST_EVERY_S = 16, 2.0
#: Client hosts whose tokenizer budget a peer remembers (the oldest forgotten first: a host
#: forgotten early starts with a full budget again).
MAX_TOKENIZER_HOSTS = 1024
#: Steps queued per conversation before new ones are refused (flow control).
MAX_QUEUED_STEPS = 64
#: Most bytes of hidden states queued for the device over all conversations: 128 steps of
#: 512 tokens of the default model (1.8 MB each). Beyond it a step is refused (rate_limited),
#: so a previous hop that floods queues cannot grow the peer's memory without bound.
MAX_QUEUED_BYTES = 256 << 20
#: Share of :data:`MAX_QUEUED_BYTES` the conversations of one client host may hold queued (their
#: steps, whether the client sent them or a previous hop passed them on): one host that fills its
#: share leaves the rest to others (an attack run refused a second host's steps while one host's
#: queued steps held the whole pool). Half, as ``ClientLimits.kv_share``.
QUEUED_BYTES_HOST_SHARE = 0.5
#: Frames one connection whose hello said "peer" may send per second, sustained (token bucket,
#: bursts of 2 s), counted before a frame is decoded; further ones are dropped unread
#: (:class:`FrameBudgets`). An honest hop sends one frame per conversation per pass (a decode pass
#: of 64 conversations every 16 ms is 4,000 a second) plus gossip, probes and their replies, and
#: a previous hop relays every client's steps, so peer links are not charged to a client host's budget.
PEER_LINK_FRAMES_PER_S = 8192.0
#: Bytes one peer link may send per second, sustained (bursts of 2 s), counted before decoding
#: like its frames. An honest previous hop relays hidden states of every client: for a model of
#: width 8,192 (32 KiB a token in float32), 256 MiB/s is 8,000 prefilled tokens a second.
PEER_LINK_BYTES_PER_S = float(256 << 20)
#: Seconds between two ``rate_limited`` notices telling a connection that its frames are dropped unread.
DROP_NOTICE_EVERY_S = 1.0
#: Most conversations one client connection may hold open at once.
MAX_CONVERSATIONS_PER_LINK = 64
#: Frame overhead allowed beyond the largest hidden-state payload, bytes.
FRAME_OVERHEAD_BYTES = 64 * 1024
#: Most peers one peer's table holds; adverts of further unknown peers are dropped, so a rogue
#: peer cannot grow the table (and every gossip round) without bound. A peer that proves its key
#: in a handshake still gets in, in place of an unproven record (see ``PeerTable.merge``).
MAX_KNOWN_PEERS = 256
#: Addresses learnt from others (gossip, ``open.next``) that a peer dials per second, sustained
#: (token bucket, bursts of 2 s): an attacker's adverts cannot make the mesh a request flood.
MAX_DIALS_PER_S = 8.0
#: After a failed dial of a peer id, its next dial waits this long, seconds, doubling with each
#: failure up to :data:`MAX_DIAL_BACKOFF_S`; bootstrap addresses are retried every gossip round.
DIAL_BACKOFF_S, MAX_DIAL_BACKOFF_S = 1.0, 30.0
#: Most peer ids whose dial failures a peer remembers (the oldest is forgotten first).
MAX_DIAL_FAILURES = 1024
#: Largest advert kept, bytes (an honest one is about 400 bytes plus 42 per RTT it reports).
MAX_ADVERT_BYTES = 16 * 1024
#: Largest gossip payload, bytes: below every peer's frame limit whatever its hidden size.
GOSSIP_BUDGET_BYTES = FRAME_OVERHEAD_BYTES // 2
#: Requests only clients make: charged to the sender's host whatever role its hello claimed
#: (a fresh key makes anyone a "peer" in an open mesh).
CLIENT_REQUESTS = frozenset({"open", "verify", "get_log", "truncate", "get_tokenizer", "get_peers", "relay"})
#: Circuits one connection may have a relay forward at once, and circuits a relay forwards to
#: one hidden peer, all openers together (each circuit costs a few map entries; its frames go
#: through the bounded outboxes of the two links).
#: Seconds between lookups of a peer's own DNS names (``Connections.keep_own_names_resolved``).
OWN_NAMES_EVERY_S = 60.0
MAX_CIRCUITS_PER_LINK, MAX_CIRCUITS_PER_PEER = 64, 256
#: Circuits one client host may hold through a relay to one hidden peer (over all its
#: connections): a quarter of the hidden peer's, so one host cannot take them all (an attack
#: run took all 256 from 4 connections in 0.75 s).
MAX_CIRCUITS_PER_HOST_TO_PEER = MAX_CIRCUITS_PER_PEER // 4
#: Seconds a peer waits for the answer to its reachability check (the asked peer dials every
#: advertised address at once, each within its open timeout of 5 s).
DIAL_BACK_TIMEOUT_S = 15.0
#: What a connection that has not proven the mesh key is told, whatever it asks.
PRIVATE_MESH = "this mesh is private: pass its key with --mesh-key-file (or MESHINFER_MESH_KEY_FILE)"


@dataclass(frozen=True)
class ClientLimits:
    """What one client host (by IP address) may use of a peer; beyond it, ``rate_limited``.

    Attributes:
        conversations: conversations open at once, all its connections together.
        connections: connections open at once (accepted by this peer); beyond it the websocket
            upgrade is answered with HTTP 503. Clients behind one NAT share it.
        steps_per_s: step frames per second, sustained (token bucket, bursts of 2 s).
        bytes_per_s: frame bytes per second, sustained (token bucket, bursts of 2 s).
        kv_share: share of the peer's KV capacity (tokens) the host's open conversations may
            reserve together, so that one host cannot reserve all of it and send nothing.
        frames_per_s: frames per second of every kind, sustained (token bucket, bursts of 2 s):
            five times the step rate, room for the probes, closes and spot-checks around steps.

    ``frames_per_s`` and ``bytes_per_s`` are checked on a frame's size before it is decoded
    (:class:`FrameBudgets`); a frame over them is dropped unread, so a flood costs the peer a
    length check per frame.
    """

    conversations: int = 64
    connections: int = DEFAULT_CONNECTIONS_PER_HOST
    steps_per_s: float = 200.0
    bytes_per_s: float = 32 * 2 ** 20
    kv_share: float = 0.5
    frames_per_s: float = 1000.0


class Bucket:
    """A token bucket: ``rate`` per second, holding at most ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.t = rate, burst, burst, time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now

    def take(self, amount: float) -> bool:
        """Take ``amount`` if the bucket holds it; False (nothing taken) if not."""
        self._refill()
        if amount > self.level:
            return False
        self.level -= amount
        return True

    def full(self) -> bool:
        """Whether the bucket has refilled to ``burst`` (its owner has been idle)."""
        self._refill()
        return self.level >= self.burst


class FrameBudgets:
    """What a peer's connections may send: per client host (all its client connections together,
    :class:`ClientLimits`) and per peer link (:data:`PEER_LINK_FRAMES_PER_S`).

    :meth:`admit` runs on a frame's size before it is decoded (``Link.admit``); :meth:`charge`
    on a client request after (it needs the frame's type: steps per second, and the bytes of
    client requests made over a peer link).

    Args:
        client_limits: returns the peer's current :class:`ClientLimits` (read at each frame).
        metrics: counts a dropped frame as an error ``rate_limited`` (``PeerMetrics.error``).
    """

    def __init__(self, client_limits, metrics) -> None:
        self.client_limits, self.metrics = client_limits, metrics
        self.hosts: dict[str, tuple[Bucket, Bucket, Bucket]] = {}  # host -> (steps, bytes, frames)

    def _host(self, host: str) -> tuple[Bucket, Bucket, Bucket]:
        cl = self.client_limits()
        if host not in self.hosts:
            self.hosts[host] = (Bucket(cl.steps_per_s, 2 * cl.steps_per_s), Bucket(cl.bytes_per_s, 2 * cl.bytes_per_s),
                                Bucket(cl.frames_per_s, 2 * cl.frames_per_s))
        return self.hosts[host]

    def admit(self, link: Link, nbytes: int) -> bool:
        """Whether to decode a frame of ``nbytes`` bytes from ``link``. A client connection (or one
        that has not said hello) spends its host's frame and byte budgets; a peer link its own frame
        budget. Over budget: False, and at most one ``rate_limited`` notice a second (with no ``re``:
        the frame was not read) tells the connection why; a connection that does not read them is
        cut off by its outbox limit."""
        if link.role == "peer":
            why = self._admit_peer(link, nbytes)
            if why is None:
                return True
        else:
            host, cl = client_host(link), self.client_limits()
            _, volume, frames = self._host(host)
            if not frames.take(1):
                why = f"client {host} sends more than {cl.frames_per_s:g} frames/s"
            elif not volume.take(nbytes):
                why = f"client {host} sends more than {cl.bytes_per_s:.0f} bytes/s"
            else:
                return True
        self.metrics.error("rate_limited")
        now = time.monotonic()
        if now - link.info.get("drop_notice_at", -math.inf) >= DROP_NOTICE_EVERY_S:
            link.info["drop_notice_at"] = now
            link.post("error", code="rate_limited", message=f"{why}; frames over it are dropped unread")
        return False

    def _admit_peer(self, link: Link, nbytes: int) -> str | None:
        """Spend a peer link's own frame and byte budgets (:data:`PEER_LINK_FRAMES_PER_S`,
        :data:`PEER_LINK_BYTES_PER_S`); None when the frame fits, else why not.

        There is no budget shared by the peer links of one host: strangers on an address an
        honest peer shares (a NAT, a hosting provider's /64) would empty it and starve that
        peer's link. Identities per host are bounded by the connections a host may hold
        (``ClientLimits.connections``) instead."""
        own = link.info.get("peer_budget")
        if own is None:
            own = link.info["peer_budget"] = (Bucket(PEER_LINK_FRAMES_PER_S, 2 * PEER_LINK_FRAMES_PER_S),
                                              Bucket(PEER_LINK_BYTES_PER_S, 2 * PEER_LINK_BYTES_PER_S))
        frames, volume = own
        name = f"peer link {(link.remote_id or '?')[:12]}"
        if not frames.take(1):
            return f"{name} sends more than {PEER_LINK_FRAMES_PER_S:g} frames/s"
        if not volume.take(nbytes):
            return f"{name} sends more than {PEER_LINK_BYTES_PER_S:.0f} bytes/s"
        return None

    def charge(self, link: Link, msg_type: str) -> None:
        """Count a decoded client request against its host: its bytes when it came over a peer link
        (a client connection's were counted by :meth:`admit`), and a step or verify against the
        step rate.

        Raises:
            RateLimited: over ``bytes_per_s`` or ``steps_per_s``, naming the host and the limit.
        """
        host, cl = client_host(link), self.client_limits()
        steps, volume, _ = self._host(host)
        if link.role != "client" and not volume.take(link.last_frame_bytes):
            raise RateLimited(f"client {host} sends more than {cl.bytes_per_s:.0f} bytes/s")
        if msg_type in ("step", "verify") and not steps.take(1):
            raise RateLimited(f"client {host} sends more than {cl.steps_per_s:g} steps/s")

    def forget_idle(self) -> None:
        """Drop the buckets of hosts that have sent nothing for long enough to refill them all."""
        self.hosts = {h: b for h, b in self.hosts.items() if not all(bucket.full() for bucket in b)}


def client_host(link: Link) -> str:
    """The host a client connection comes from (:func:`host_key` of its IP address; its limits are per host)."""
    addr = getattr(link.ws, "remote_address", None)
    return host_key(str(addr[0])) if addr else "?"


#: Share of the memory free at start-up that a peer's KV budget takes by default.
DEFAULT_KV_SHARE = 0.5


def free_memory_bytes(device: torch.device) -> int:
    """Device memory free now, bytes (CUDA: ``mem_get_info``; CPU and MPS: the system's
    available RAM, ``MemAvailable`` of /proc/meminfo, else ``sysconf``); 0 when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return 0


def default_kv_budget(device: torch.device) -> int:
    """Default KV budget, bytes: half the device memory free now (:func:`free_memory_bytes`),
    at least 64 MiB. A peer asks after its shard is loaded, so the weights (every expert of a
    mixture of experts) are already out of it."""
    return max(64 << 20, int(free_memory_bytes(device) * DEFAULT_KV_SHARE))
