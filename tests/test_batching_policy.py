"""The step scheduler's batching policy (meshinfer.peer.batching) on synthetic queues: pure,
no torch, no event loop, no clock (``now`` and arrival times are plain numbers).

That importing the policy leaves torch unloaded is checked by tests/test_layout.py
(``TORCH_FREE``); that it leaves asyncio unloaded, here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshinfer.peer.batching import (BATCH_STEP_TOKENS, DEFAULT_MAX_HOLD_S, HOLD_FRACTION, PASS_TIME_EWMA,
                                     BatchPolicy, Decision, Step)

A, B = (0, 4), (4, 8)  # two layer spans
PREFILL = BATCH_STEP_TOKENS + 1


def steps(*tokens: int, layers=A, at: float = 0.0) -> list[Step]:
    """One step per entry of ``tokens``, conversations "c0", "c1", ... in that order."""
    return [Step(f"c{i}", layers, t, at) for i, t in enumerate(tokens)]


def warmed(pass_s: float = 1.0, **options) -> BatchPolicy:
    """A policy after one decode pass that took ``pass_s``: holds may last HOLD_FRACTION of it."""
    policy = BatchPolicy(**options)
    policy.ran(1, pass_s)
    return policy


# --------------------------------------------------------------------------- taking a pass
def test_small_steps_of_different_conversations_on_the_same_layers_share_a_pass():
    assert BatchPolicy().take(steps(1, 1, 3, BATCH_STEP_TOKENS)) == (0, 1, 2, 3)


def test_a_prefill_at_the_head_runs_alone():
    assert BatchPolicy().take(steps(PREFILL, 1, 1)) == (0,)


def test_a_prefill_behind_a_decode_step_does_not_join_it():
    assert BatchPolicy().take(steps(1, PREFILL, 1)) == (0, 2)


def test_steps_on_other_layers_never_share_a_pass():
    queue = [Step("a", A, 1), Step("b", B, 1), Step("c", A, 1)]
    assert BatchPolicy().take(queue) == (0, 2)


def test_a_pass_carries_at_most_max_batch_steps_the_oldest_first():
    assert BatchPolicy(max_batch=3).take(steps(1, 1, 1, 1, 1)) == (0, 1, 2)


def test_max_batch_1_runs_every_step_alone():
    assert BatchPolicy(max_batch=1).take(steps(1, 1)) == (0,)


def test_the_oldest_step_is_the_head():
    assert BatchPolicy().take([Step("b", B, 1), Step("a", A, 1)]) == (0,)


def test_after_a_prefill_pass_the_oldest_small_step_goes_first():
    policy = BatchPolicy()
    assert policy.take(steps(PREFILL, PREFILL, 1)) == (0,)
    assert policy.take(steps(PREFILL, 1)) == (1,)


def test_prefills_and_decode_passes_alternate_so_neither_starves():
    policy = BatchPolicy()
    queue = steps(PREFILL, PREFILL, 1, 1)
    order = []
    while queue:
        run = policy.take(queue)
        order.append([queue[i].conv for i in run])
        queue = [s for i, s in enumerate(queue) if i not in run]
    assert order == [["c0"], ["c2", "c3"], ["c1"]]


def test_after_a_decode_pass_the_oldest_step_is_the_head_again():
    policy = BatchPolicy()
    policy.take(steps(PREFILL))
    policy.take(steps(1))
    assert policy.take(steps(PREFILL, 1)) == (0,)


def test_an_empty_queue_takes_nothing():
    assert BatchPolicy().take([]) == ()
    assert BatchPolicy().schedule([], {"c0": A}, now=5.0) == Decision()


# --------------------------------------------------------------------------- holding a pass
def test_a_decode_pass_holds_for_a_coming_conversation():
    decision = warmed(1.0, max_hold_s=5.0).schedule(steps(1, at=10.0), {"c9": A}, now=10.1)
    assert decision.run == () and decision.hold_s == pytest.approx(HOLD_FRACTION * 1.0 - 0.1)


def test_a_hold_lasts_at_most_max_hold_s_after_the_head_arrived():
    decision = warmed(10.0, max_hold_s=0.05).schedule(steps(1, at=10.0), {"c9": A}, now=10.02)
    assert decision.hold_s == pytest.approx(0.03)


def test_when_the_hold_is_over_the_pass_runs_and_gives_up_on_the_missing():
    decision = warmed(1.0, max_hold_s=5.0).schedule(steps(1, 1, at=10.0), {"c8": A, "c9": A}, now=10.5)
    assert decision == Decision(run=(0, 1), give_up=("c8", "c9"))


def test_max_hold_s_0_never_holds():
    decision = warmed(1.0, max_hold_s=0.0).schedule(steps(1, at=10.0), {"c9": A}, now=10.0)
    assert decision == Decision(run=(0,), give_up=("c9",))


def test_before_any_decode_pass_ran_nothing_holds():
    decision = BatchPolicy(max_hold_s=5.0).schedule(steps(1, at=10.0), {"c9": A}, now=10.0)
    assert decision.hold_s == 0 and decision.run == (0,)


def test_a_prefill_never_holds():
    decision = warmed(1.0, max_hold_s=5.0).schedule(steps(PREFILL, at=10.0), {"c9": A}, now=10.0)
    assert decision == Decision(run=(0,))


def test_a_full_pass_does_not_hold():
    decision = warmed(1.0, max_batch=2, max_hold_s=5.0).schedule(steps(1, 1, at=10.0), {"c9": A}, now=10.0)
    assert decision == Decision(run=(0, 1))


def test_a_coming_conversation_whose_step_is_queued_is_not_waited_for():
    decision = warmed(1.0, max_hold_s=5.0).schedule(steps(1, at=10.0), {"c0": A}, now=10.0)
    assert decision == Decision(run=(0,))


def test_a_coming_conversation_on_other_layers_is_not_waited_for():
    decision = warmed(1.0, max_hold_s=5.0).schedule(steps(1, at=10.0), {"c9": B}, now=10.0)
    assert decision == Decision(run=(0,))


def test_only_the_first_coming_conversations_that_fit_are_given_up_on():
    coming = {"c7": A, "c8": A, "c9": A}  # in the order they became coming
    decision = warmed(1.0, max_batch=3, max_hold_s=5.0).schedule(steps(1, at=10.0), coming, now=11.0)
    assert decision.give_up == ("c7", "c8")  # room for 2 more: c9 stays coming


def test_holding_takes_nothing_and_leaves_the_head_rule_alone():
    policy = warmed(1.0, max_hold_s=5.0)
    policy.take(steps(PREFILL))
    assert policy.schedule(steps(PREFILL, 1, at=10.0), {"c9": A}, now=10.0).run == ()
    assert policy.after_prefill


# --------------------------------------------------------------------------- pass time and settings
def test_the_first_decode_pass_sets_the_pass_time_and_later_ones_average_in():
    policy = BatchPolicy()
    policy.ran(1, 2.0)
    policy.ran(BATCH_STEP_TOKENS, 1.0)
    assert policy.pass_s == pytest.approx((1 - PASS_TIME_EWMA) * 2.0 + PASS_TIME_EWMA * 1.0)


def test_a_prefill_pass_does_not_change_the_pass_time():
    policy = warmed(1.0)
    policy.ran(PREFILL, 30.0)
    assert policy.pass_s == 1.0


def test_the_hold_limit_is_the_smaller_of_max_hold_s_and_a_fraction_of_a_pass():
    assert warmed(0.01).hold_limit_s() == pytest.approx(HOLD_FRACTION * 0.01)
    assert warmed(10.0).hold_limit_s() == DEFAULT_MAX_HOLD_S


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_hold_s must be 0 or more seconds, got -1"):
        BatchPolicy(max_hold_s=-1)
    with pytest.raises(ValueError, match="max_batch must be at least 1, got 0"):
        BatchPolicy(max_batch=0)


def test_the_policy_loads_without_asyncio_or_torch():
    code = ("import sys, meshinfer.peer.batching\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
