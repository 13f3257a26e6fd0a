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
    ledger.hold(3)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2, 3], 0, 3)
    ledger.confirm()
    assert ledger.confirmed == 3 and not ledger.rolls_back(3)


def test_rejected_drafts_leave_cached_and_the_next_step_rolls_them_back():
    ledger = PositionLedger()
    ledger.send([1, 2, 3, 4, 5])
    ledger.hold(5)
    ledger.keep_accepted(3)
    assert (ledger.cached, ledger.confirmed, ledger.held) == ([1, 2, 3], 3, 5)
    assert ledger.rolls_back(3)


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
    ledger.hold(6)
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
