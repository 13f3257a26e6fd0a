"""Prometheus metrics of one peer (``meshinfer join --metrics-port P`` serves them at ``/metrics``).

Each :class:`PeerMetrics` owns its own ``CollectorRegistry``, never prometheus_client's global
one, so many peers can live in one process (tests, ``meshinfer bench``). Counters and the
histogram are updated by one-line calls from :mod:`meshinfer.peer.steps` and :mod:`meshinfer.wire.transport`;
the KV and conversation gauges are read from the peer's :class:`PeerUsage` snapshot when ``/metrics`` is scraped.

The HTTP server is prometheus_client's WSGI server on a daemon thread: scrapes never run on
the peer's event loop. :meth:`PeerMetrics.close` shuts it down (the peer's ``close`` calls it).

Metric names (all prefixed ``meshinfer_``):

- ``steps_total{kind}``, ``tokens_total{kind}``: step frames computed and the positions they
  held; ``kind`` is ``decode`` for a one-token step and ``prefill`` otherwise (prefill chunks,
  replays that recompute). Replayed steps a kept hop resends from its log are not counted.
- ``step_seconds{kind}``: compute time of a step on the device thread, seconds (histogram,
  :data:`STEP_BUCKETS_S`); queueing before it is not included.
- ``kv_used_bytes``, ``kv_free_bytes``, ``kv_budget_bytes``: KV (and replay-log) storage allocated
  now; budget not reserved by open conversations; the whole budget.
- ``conversations``: conversations open now.
- ``errors_total{code}``: errors this peer answered with, by :class:`meshinfer.core.errors.MeshError`
  ``code`` (``protocol_error``, ``bad_positions``, ``cache_full`` ...).
- ``link_bytes_total{direction}``: websocket frame bytes received (``in``) and sent (``out``).
- ``peer_info{peer_id, layers, device, precision, weights, architecture}``: constant 1.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

log = logging.getLogger(__name__)

#: Step latency buckets, seconds: 1 ms (a small decode step on a GPU) to 10 s (a 512-token
#: prefill chunk of many layers on a slow CPU); roughly 1-2-5 per decade.
STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class PeerUsage:
    """What a peer holds now, as plain values (``Peer.usage()``), for the scrape-time gauges.

    Attributes:
        conversations: conversations open.
        kv_used_bytes: KV cache and replay-log storage allocated, bytes.
        kv_free_bytes: KV budget not reserved by open conversations, bytes.
        kv_budget_bytes: the whole KV budget, bytes.
    """

    conversations: int
    kv_used_bytes: int
    kv_free_bytes: int
    kv_budget_bytes: int


class _PeerCollector:
    """Gauges read from the peer at scrape time (on the HTTP thread), through ``Peer.usage()``."""

    def __init__(self, peer: "Peer") -> None:
        self.peer = peer

    def collect(self) -> Iterable[GaugeMetricFamily]:
        usage = self.peer.usage()
        yield GaugeMetricFamily("meshinfer_kv_used_bytes", "KV cache and replay-log storage allocated now, bytes",
                                value=usage.kv_used_bytes)
        yield GaugeMetricFamily("meshinfer_kv_free_bytes", "KV budget not reserved by open conversations, bytes",
                                value=usage.kv_free_bytes)
        yield GaugeMetricFamily("meshinfer_kv_budget_bytes", "KV budget of this peer, bytes",
                                value=usage.kv_budget_bytes)
        yield GaugeMetricFamily("meshinfer_conversations", "conversations open on this peer",
                                value=usage.conversations)


class PeerMetrics:
    """The metrics of one peer, in a registry of its own.

    Args:
        peer: the peer whose KV and conversations the scrape-time gauges read.

    Attributes:
        registry: the ``CollectorRegistry`` holding every metric of this peer.
        port: the TCP port ``/metrics`` is served on once :meth:`serve` ran, else None.
    """

    def __init__(self, peer: "Peer") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("meshinfer_steps", "step frames computed", ["kind"], registry=r)
        self.tokens = Counter("meshinfer_tokens", "positions computed in steps", ["kind"], registry=r)
        self.step_seconds = Histogram("meshinfer_step_seconds", "compute time of one step, seconds", ["kind"],
                                      buckets=STEP_BUCKETS_S, registry=r)
        self.errors = Counter("meshinfer_errors", "errors answered, by MeshError code", ["code"], registry=r)
        self.link_bytes = Counter("meshinfer_link_bytes", "websocket frame bytes", ["direction"], registry=r)
        self.info = Info("meshinfer_peer", "what this peer serves", registry=r)
        r.register(_PeerCollector(peer))
        for kind in ("prefill", "decode"):  # export zeros from the start: rate() needs a first sample
            self.steps.labels(kind)
            self.tokens.labels(kind)
            self.step_seconds.labels(kind)
        self._bytes_in, self._bytes_out = self.link_bytes.labels("in"), self.link_bytes.labels("out")
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ updates (event loop)
    def step(self, tokens: int, seconds: float) -> None:
        """Count one computed step of ``tokens`` positions that took ``seconds`` of compute."""
        kind = "decode" if tokens == 1 else "prefill"
        self.steps.labels(kind).inc()
        self.tokens.labels(kind).inc(tokens)
        self.step_seconds.labels(kind).observe(seconds)

    def error(self, code: str) -> None:
        """Count one error answered with MeshError ``code``."""
        self.errors.labels(code[:64]).inc()

    def frame_in(self, nbytes: int) -> None:
        """Count a received websocket frame of ``nbytes`` bytes."""
        self._bytes_in.inc(nbytes)

    def frame_out(self, nbytes: int) -> None:
        """Count a sent websocket frame of ``nbytes`` bytes."""
        self._bytes_out.inc(nbytes)

    def set_info(self, **labels: str) -> None:
        """Set the ``meshinfer_peer_info`` labels (layer range, device, precision ...)."""
        self.info.info({k: str(v) for k, v in labels.items()})

    # ------------------------------------------------------------------ HTTP
    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on a daemon thread; return the bound port (``port`` 0: any).

        Raises:
            OSError: the address cannot be bound.
        """
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_address[1]
        log.info("metrics at http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP server and join its thread (blocks up to ~0.5 s). Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
