"""The client's memory of hops' reports that no probe bore out (:class:`ReportLedger`).

A hop can say that its link to the next hop broke (``peer_unavailable``), or finish a step and
never forward it; when every hop then answers the client's probe, the client cannot tell whether
the link broke, the next hop lied, or the reporting hop did. The failover counts such events
against the hop before the break (the *reporter*) and, from the
:data:`UNCONFIRMED_REPORTS_BLAMED`-th, replaces it. The count is client-wide, not per
conversation: a liar that made one false report in each new conversation used to get one honest
next hop backed off per conversation, for free.

Records are per reporting peer id, forgotten :data:`REPORT_MEMORY_S` after their last report and
at most :data:`MAX_REPORTERS` at once (the stalest goes first), so the memory is bounded whatever
identities report. No torch, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

#: A hop's unconfirmed reports (remembered ones, this one included) from which it is replaced:
#: the first is a link that broke once (it is reopened); a second is a pattern.
UNCONFIRMED_REPORTS_BLAMED = 2
#: Seconds a reporter's record is kept after its last unconfirmed report. An hour: a link between
#: two honest peers that breaks twice within it costs them a 5 s backoff, while a liar that spaces
#: its reports over conversations is still counted.
REPORT_MEMORY_S = 3600.0
#: Reporters remembered at once (the size of a peer's table); beyond it the record whose last
#: report is oldest is forgotten, so many identities cannot grow the client's memory.
MAX_REPORTERS = 256
#: Peers one record remembers its reporter naming (the newest kept).
MAX_NAMED = 8
#: Independent witnesses (:func:`witnesses`) whose unproven accusations (no evidence) of one
#: peer get it banned: one hop's word is not enough (it may be the liar), nor are the words of
#: many identities on one other host (keys are free: sybils), but hops on two hosts are
#: (docs/security.md).
UNPROVEN_ACCUSER_HOSTS_BANNED = 2
#: The host of a hop the client does not reach directly (through a relay, or with no link): all
#: such hops count as one host, since the client cannot tell where they run.
UNKNOWN_HOST = "?"


def witnesses(hosts: dict[str, str], subject_host: str) -> int:
    """How many independent witnesses the peers of ``hosts`` (peer id -> host, as
    ``MeshLinks.host`` gives it) are against a peer on ``subject_host``: peers on one host other
    than the subject's count once (keys are free: one machine can run many identities); peers of
    unknown host (:data:`UNKNOWN_HOST`: relayed) count not at all, since a hidden identity may run
    on the same machine as any other (an attack run made one machine two witnesses, one identity
    listening and one relayed); peers on the subject's own host count one each, since their host
    tells nothing apart (a mesh on one machine keeps one witness per peer)."""
    return len({h if h != subject_host else p for p, h in hosts.items() if h != UNKNOWN_HOST})


@dataclass
class _Record:
    """One reporter's unconfirmed reports: how many, when the last came, and whom they named."""
    count: int = 0
    last_s: float = 0.0
    named: dict[str, None] = field(default_factory=dict)  # an ordered set, oldest first
    host: str = UNKNOWN_HOST  # where the reporter runs (``discovery.host_key`` of its address)


class ReportLedger:
    """Client-wide counts of hops' unconfirmed reports, and whom to replace for each.

    Args:
        memory_s: seconds a record outlives its last report (:data:`REPORT_MEMORY_S`).
        max_reporters: most records held (:data:`MAX_REPORTERS`).
        clock: monotonic seconds (``time.monotonic``; a test may pass its own).

    The policy (:meth:`blame`): a reporter's first unconfirmed report costs nobody a backoff.
    At its :data:`UNCONFIRMED_REPORTS_BLAMED`-th the reporter is replaced, and the peer it
    names with it (their link may really be broken, and the client cannot tell which end)
    only when no other reporter has named that peer: a peer that answers every probe and is
    named by two or more distinct reporters is what distinct identities (sybils) taking turns
    look like, so the reporters are the suspects and it stays. Past that count the reporter
    alone is replaced: it has had its one co-blame.
    """

    def __init__(self, *, memory_s: float = REPORT_MEMORY_S, max_reporters: int = MAX_REPORTERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s, self.max_reporters, self.clock = memory_s, max_reporters, clock
        self._records: dict[str, _Record] = {}  # reporter peer id -> its record, stalest first

    def __len__(self) -> int:
        return len(self._records)

    def count(self, reporter: str) -> int:
        """Unconfirmed reports of ``reporter`` still remembered (0 when none)."""
        self._forget_stale()
        rec = self._records.get(reporter)
        return rec.count if rec is not None else 0

    def accusers(self, peer_id: str) -> frozenset[str]:
        """Reporters whose remembered unconfirmed reports named ``peer_id``."""
        self._forget_stale()
        return frozenset(r for r, rec in self._records.items() if peer_id in rec.named)

    def accuser_hosts(self, peer_id: str) -> dict[str, str]:
        """The reporters whose remembered reports named ``peer_id`` (:meth:`accusers`), each with
        its host."""
        return {r: self._records[r].host for r in self.accusers(peer_id)}

    def add(self, reporter: str, named: str | None, host: str | None = None) -> int:
        """Record one unconfirmed report of ``reporter`` (on ``host``, when given) naming ``named``
        (the hop after it, or None); return the reporter's remembered count, this one included."""
        self._forget_stale()
        rec = self._records.pop(reporter, None) or _Record()
        rec.count, rec.last_s = rec.count + 1, self.clock()
        if host is not None:
            rec.host = host
        if named is not None:
            rec.named.pop(named, None)
            rec.named[named] = None
            while len(rec.named) > MAX_NAMED:
                del rec.named[next(iter(rec.named))]
        self._records[reporter] = rec  # last: the dict stays ordered stalest first
        while len(self._records) > self.max_reporters:
            del self._records[next(iter(self._records))]
        return rec.count

    def blame(self, reporter: str, named: str | None) -> frozenset[str]:
        """Record one unconfirmed report (:meth:`add`) and return the peers to replace for it:
        none below :data:`UNCONFIRMED_REPORTS_BLAMED`; at it, the reporter and ``named`` when
        no other reporter named ``named``, else the reporter alone; past it, the reporter alone."""
        n = self.add(reporter, named)
        if n < UNCONFIRMED_REPORTS_BLAMED:
            return frozenset()
        if n == UNCONFIRMED_REPORTS_BLAMED and named is not None and self.accusers(named) == {reporter}:
            return frozenset({reporter, named})
        return frozenset({reporter})

    def accuse(self, accuser: str, accused: str, host: str = UNKNOWN_HOST,
               accused_host: str = UNKNOWN_HOST) -> tuple[frozenset[str], bool]:
        """Record one accusation by hop ``accuser``, on ``host`` (``discovery.host_key`` of the
        address the client reaches it at, :data:`UNKNOWN_HOST` through a relay), that its previous
        hop ``accused`` (on ``accused_host``) sent what it could not take, with no evidence the
        client can check (:meth:`add`). Return the peers to replace for it, and whether to ban
        ``accused``:

        - replaced: ``accused`` at the accuser's first (it may have sent garbage: route around
          it), ``accused`` and ``accuser`` at its :data:`UNCONFIRMED_REPORTS_BLAMED`-th, the
          accuser alone past it (it has had its one co-blame: a liar's word no longer moves
          honest peers);
        - banned: ``accused`` once :data:`UNPROVEN_ACCUSER_HOSTS_BANNED` independent
          :func:`witnesses` named it (two identities on one other machine are one witness).
        """
        n = self.add(accuser, accused, host)
        ban = witnesses(self.accuser_hosts(accused), accused_host) >= UNPROVEN_ACCUSER_HOSTS_BANNED
        if n < UNCONFIRMED_REPORTS_BLAMED:
            return frozenset({accused}), ban
        return frozenset({accuser, accused} if n == UNCONFIRMED_REPORTS_BLAMED or ban else {accuser}), ban

    def _forget_stale(self) -> None:
        """Drop records whose last report is older than ``memory_s``."""
        horizon = self.clock() - self.memory_s
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest].last_s > horizon:
                break
            del self._records[oldest]
