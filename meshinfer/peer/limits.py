"""The numbers that bound what one connection, client host or peer may cost, and the KV budget default.

Every module of the peer reads these as ``limits.NAME`` when it runs, never as a copy taken
at import, so one assignment (a test's ``monkeypatch``) changes them for the whole peer; the
advert signature check :func:`verify_advert` is looked up here the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

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
#: Steps queued per conversation before new ones are refused (flow control).
MAX_QUEUED_STEPS = 64
#: Most bytes of hidden states queued for the device over all conversations: 128 steps of
#: 512 tokens of the default model (1.8 MB each). Beyond it a step is refused (rate_limited),
#: so a previous hop that floods queues cannot grow the peer's memory without bound.
MAX_QUEUED_BYTES = 256 << 20
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
MAX_CIRCUITS_PER_LINK, MAX_CIRCUITS_PER_PEER = 64, 256
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
    """

    conversations: int = 64
    connections: int = DEFAULT_CONNECTIONS_PER_HOST
    steps_per_s: float = 200.0
    bytes_per_s: float = 32 * 2 ** 20
    kv_share: float = 0.5


class Bucket:
    """A token bucket: ``rate`` per second, holding at most ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.t = rate, burst, burst, time.monotonic()

    def take(self, amount: float) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now
        if amount > self.level:
            return False
        self.level -= amount
        return True


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
