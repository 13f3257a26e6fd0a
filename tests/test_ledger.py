"""The client's position ledger (pure) and the typed refusal of drafts by an old peer."""

from types import SimpleNamespace

from meshinfer.client.ledger import PositionLedger
from meshinfer.core.errors import DraftsRefused, ProtocolError
from meshinfer.wire.transport import remote_error


def _frame(**fields):
    return SimpleNamespace(str=lambda key, default=None: fields.get(key, default))


def test_a_step_is_sent_held_and_confirmed():
    ledger = PositionLedger()
    ledger.send([1, 2, 3])
    ledger.hold(1, 0, 3)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2, 3], 0, 3)
    ledger.confirm()
    assert ledger.confirmed == 3 and not ledger.rolls_back(3)


def test_rejected_drafts_leave_cached_and_the_next_step_rolls_them_back():
    ledger = PositionLedger()
    ledger.send([1, 2, 3, 4, 5])
    ledger.hold(1, 0, 5)
    ledger.keep_accepted(3)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2, 3], 3, 5)
    assert ledger.rolls_back(3)


def test_each_position_remembers_the_last_step_that_sent_it():
    """``seq_at``: the step whose signed statement a hop must show for a position."""
    ledger = PositionLedger()
    ledger.hold(1, 0, 4)  # a prefill
    ledger.hold(2, 4, 7)  # a verification step: the last token and two drafts
    ledger.hold(3, 5, 6)  # the second draft was rejected: the next step rolls back to 5
    assert ledger.seq_at == [1, 1, 1, 1, 2, 3]
    ledger.truncate(2)
    assert ledger.seq_at == [1, 1]
    ledger.hold(9, 0, 3)  # a failover's replay sends everything again
    assert ledger.seq_at == [9, 9, 9]


def test_a_failed_step_keeps_what_was_confirmed():
    ledger = PositionLedger()
    ledger.send([1, 2])
    ledger.confirm()
    ledger.send([3, 4])
    ledger.drop_failed(2)
    assert (ledger.cached, ledger.confirmed) == ([1, 2], 2)


def test_roll_back_truncate_and_forget():
    ledger = PositionLedger()
    ledger.send([1, 2, 3, 4])
    ledger.confirm()
    ledger.hold(1, 0, 6)
    ledger.roll_back(3)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2, 3], 3, 6)
    ledger.forget_after(2)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2], 2, 6)
    ledger.truncate(1)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1], 1, 1)


def test_an_old_peer_refusing_want_tokens_is_a_typed_error():
    exc = remote_error(_frame(code="protocol_error", message="step 3: want 'tokens' is not token or none"))
    assert type(exc) is DraftsRefused and exc.code == "drafts_refused" and isinstance(exc, ProtocolError)
    other = remote_error(_frame(code="protocol_error", message="field 'seq' missing"))
    assert type(other) is ProtocolError
    assert type(remote_error(_frame(code="drafts_refused", message="no drafts"))) is DraftsRefused


def test_a_hop_keeps_the_signed_statement_of_the_step_that_last_sent_each_position():
    """``Conv.keep_signed``: a step drops every position from its ``start``
    first; a failover replay replaces its own positions only."""
    from meshinfer.core.config import LayerRange
    from meshinfer.peer.conversations import Conv

    conv = Conv("c", LayerRange(1, 2), owner=None, prev_id="p", next_id=None, next_addrs=(),
                reserved_tokens=64, cache=None)

    def seqs() -> list[int]:
        return [s[0] for s in conv.signed_at]

    conv.keep_signed(1, 0, b"a" * 64, b"s1")  # a 4-position prefill
    conv.keep_signed(2, 4, b"b" * 48, b"s2")  # a verification step of 3 positions
    conv.keep_signed(3, 5, b"c" * 16, b"s3")  # rolls back to 5: step 2 still holds position 4
    assert seqs() == [1, 1, 1, 1, 2, 3]
    conv.keep_signed(4, 4, b"d" * 16, b"s4")  # from 4 again
    assert seqs() == [1, 1, 1, 1, 4] and conv.signed_at[4] == (4, 4, b"d" * 16, b"s4")
    conv.keep_signed(5, 0, b"e" * 32, b"s5", replay=True)  # a replay of positions 0-1 only
    assert seqs() == [5, 5, 1, 1, 4]
