"""Hops' reports that no probe bears out, counted over all of a client's conversations
(``meshinfer.client.reports``): pure tests on synthetic routes whose every hop answers its probe."""

from __future__ import annotations

from types import SimpleNamespace

from meshinfer.client import reports
from meshinfer.client.conversation import Conversation
from meshinfer.client.mesh import MeshClient
from meshinfer.client.reports import ReportLedger
from meshinfer.core.errors import PeerUnavailable


def conversation(client: MeshClient, *peer_ids: str, lengths: dict[str, int] | None = None) -> Conversation:
    """A conversation of ``client`` over hops ``peer_ids`` whose probes answer ``lengths`` (10 each by default)."""
    hops = [SimpleNamespace(peer_id=p) for p in peer_ids]
    conv = Conversation(client, SimpleNamespace(hops=hops, peer_ids=tuple(peer_ids)), max_tokens_total=64)

    async def probe(hop):
        return (lengths or {}).get(hop.peer_id, 10)

    conv._probe = probe
    return conv


def report(reporter: str, peer: str) -> PeerUnavailable:
    """``reporter``'s ``peer_unavailable`` report that its link to ``peer`` closed."""
    exc = PeerUnavailable("my next hop is gone", peer=peer)
    exc.reporter = reporter
    return exc


async def test_a_liar_with_one_report_per_conversation_is_blamed_by_its_second():
    """Hop "liar" reports its next hop "h" gone once in each of three conversations. Counted per
    conversation, each report was a first (no blame), so every new conversation gave the liar a
    free failover and, with a second report, one honest hop backed off. Counted by the client, the
    second report replaces the liar (with "h": the client cannot tell which end broke the link, once),
    and the third the liar alone."""
    client = MeshClient(["ws://127.0.0.1:1"])
    verdicts = [await conversation(client, "liar", "h", "t")._find_failed(10, report("liar", "h")) for _ in range(3)]
    assert verdicts == [set(), {"liar", "h"}, {"liar"}]
    assert client.reports.count("liar") == 3 and client.reports.accusers("h") == {"liar"}


async def test_sybils_taking_turns_get_their_named_peer_replaced_once():
    """Three identities in front of one honest hop "h", each reporting it gone twice (each in its
    own conversation): counted per identity alone, each got "h" backed off once, doubling its
    backoff. "h" answers every probe and a second reporter names it: the reporters are the
    suspects, and from then on each is replaced alone."""
    client = MeshClient(["ws://127.0.0.1:1"])
    verdicts = []
    for sybil in ("s1", "s2", "s3"):
        conv = conversation(client, sybil, "h", "t")
        verdicts.append([await conv._find_failed(10, report(sybil, "h")) for _ in range(2)])
    assert verdicts == [[set(), {"s1", "h"}], [set(), {"s2"}], [set(), {"s3"}]]
    assert client.reports.accusers("h") == {"s1", "s2", "s3"}


async def test_a_hop_that_withholds_its_output_in_each_conversation_is_counted_by_the_client():
    """Hop "w" finishes each step (10 positions) and never forwards it; its next hop holds 8. The
    stuck next hop is replaced alone the first time (it may have stalled on its own), with "w" at the
    second, and at the third, in yet another conversation, "w" alone: "w" has had its one co-blame."""
    client = MeshClient(["ws://127.0.0.1:1"])
    verdicts = [await conversation(client, "w", "h", "t", lengths={"w": 10, "h": 8, "t": 8})._find_failed(10)
                for _ in range(3)]
    assert verdicts == [{"h"}, {"w", "h"}, {"w"}]


async def test_a_stuck_hop_after_a_fresh_previous_hop_is_still_replaced():
    """A hop that really hangs (answers probes, never finishes a step) is replaced when the hop
    before it has no count yet, whoever was blamed before: sparing named peers never keeps a hung one."""
    client = MeshClient(["ws://127.0.0.1:1"])
    lengths = {"p1": 10, "p2": 10, "h": 8, "t": 8}
    for _ in range(2):
        await conversation(client, "p1", "h", "t", lengths=lengths)._find_failed(10)
    assert await conversation(client, "p2", "h", "t", lengths=lengths)._find_failed(10) == {"h"}


def test_the_ledger_forgets_old_reports_and_holds_a_bounded_number_of_reporters():
    """A record is forgotten ``memory_s`` after its reporter's last report; beyond ``max_reporters``
    the stalest record goes, and one record remembers at most ``MAX_NAMED`` named peers."""
    now = [0.0]
    ledger = ReportLedger(memory_s=100.0, max_reporters=3, clock=lambda: now[0])
    assert ledger.blame("a", "x") == frozenset()
    now[0] = 99.0
    assert ledger.blame("a", "x") == {"a", "x"}  # within memory: the second counts
    now[0] = 199.5
    assert ledger.count("a") == 0 and ledger.blame("a", "x") == frozenset()  # forgotten: a first again
    for i, r in enumerate(["b", "c", "d"]):
        now[0] += 1
        ledger.add(r, f"n{i}")
    assert len(ledger) == 3 and ledger.count("a") == 0 and ledger.count("d") == 1  # "a" was stalest
    for i in range(reports.MAX_NAMED + 5):
        ledger.add("d", f"m{i}")
    assert ledger.accusers("m0") == frozenset() and ledger.accusers(f"m{reports.MAX_NAMED + 4}") == {"d"}


def test_an_unproven_accusation_backs_the_accused_off_and_two_independent_witnesses_ban_it():
    """``ReportLedger.accuse``: a hop's accusation of its previous hop with nothing the client
    can check replaces the accused, not the accuser, at the first; both at the accuser's second;
    the accuser alone after that. Only a peer accused by two independent witnesses is to be
    banned: identities on one host other than the accused's (sybils, keys are free) are one
    witness, relayed ones none; on the accused's own host (a mesh on one machine) each counts."""
    x, y, z = "198.51.100.7", "203.0.113.9", "192.0.2.4"  # the accusers' hosts, the accused's
    ledger = ReportLedger()
    assert ledger.accuse("liar", "p1", x, y) == (frozenset({"p1"}), False)
    assert ledger.accuse("liar", "p2", x, y) == (frozenset({"liar", "p2"}), False)
    assert ledger.accuse("liar", "p3", x, y) == (frozenset({"liar"}), False)  # its word moves nobody else
    assert ledger.accuse("sybil", "p3", x, y) == (frozenset({"p3"}), False)  # same host: one witness
    assert ledger.accuse("relayed", "p3", reports.UNKNOWN_HOST, y) == (frozenset({"p3"}), False)  # none
    assert ledger.accuse("other", "p3", z, y) == (frozenset({"p3"}), True)  # a second host: banned
    assert ledger.accusers("p3") == {"liar", "sybil", "relayed", "other"} and ledger.count("liar") == 3
    assert ledger.accuser_hosts("p3") == {"liar": x, "sybil": x, "relayed": reports.UNKNOWN_HOST, "other": z}
    assert ledger.accuse("n1", "p5", y, y) == (frozenset({"p5"}), False)
    assert ledger.accuse("n2", "p5", y, y) == (frozenset({"p5"}), True)  # one machine's mesh: one each


def test_witnesses_count_one_per_other_host_none_when_relayed_and_one_per_peer_on_the_subjects_host():
    """``reports.witnesses``: what the accusation ledger and the spot-check referees count."""
    u = reports.UNKNOWN_HOST
    assert reports.witnesses({"a": "h1", "b": "h1"}, "h2") == 1
    assert reports.witnesses({"a": "h1", "b": "h3"}, "h2") == 2
    assert reports.witnesses({"a": "h2", "b": "h2"}, "h2") == 2
    assert reports.witnesses({"a": "h1", "b": u}, "h2") == 1  # one machine: one listening, one relayed
    assert reports.witnesses({"a": u, "b": u}, u) == 0 and reports.witnesses({}, "h1") == 0
