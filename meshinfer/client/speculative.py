"""Exact speculative decoding with prompt-lookup drafting: the pure parts (no I/O, no torch).

Prompt lookup (Saxena 2023, "prompt lookup decoding"; the n-gram variant of Leviathan et al.
2023, "Fast inference from transformers via speculative decoding") needs no draft model: the
last ``n`` tokens of the conversation are looked up earlier in the conversation (prompt and
generated tokens), and the tokens that followed that earlier occurrence are proposed as the
continuation. Editing code ("reproduce this function with one change") repeats long spans of
the prompt, so most drafts are right.

The client sends ``[last token] + drafts`` as one step; the last hop returns the argmax at every
position (``want="tokens"``). :func:`accept` keeps the longest prefix of drafts that equals those
argmaxes plus the one argmax after it, so greedy output is exactly what plain decoding gives
(up to the float rounding of a T > 1 matmul, see docs/architecture.md).

Drafts can also come from a draft model at the client (:mod:`meshinfer.client.draft`); either way
:class:`DraftPolicy` chooses each step's draft length, 0 included, from what the conversation
measures (acceptance, the route's step time as a function of the step's length, the cost of
drafting), so speculation is used only where it is expected to beat plain decoding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

#: Longest n-gram looked up; shorter ones (down to :data:`MIN_NGRAM`) are tried when it has no match.
MAX_NGRAM = 3
#: Shortest n-gram looked up. A 1-gram matches often and wrongly, but a rejected draft costs only
#: the extra positions of one step (tens of ms on a CPU), not a round trip.
MIN_NGRAM = 1
#: Default most drafts per step (``--draft-tokens``). A step of 1 + 8 tokens costs about 1.5x a
#: one-token step on a CPU peer for the default model, and accepted runs on code edits are long.
DEFAULT_DRAFT_TOKENS = 8
#: Most drafts one step may carry: a peer computes the output head at every position of a
#: verification step (T x V float32 logits, 9.7 MB for T = 16 and V = 151,936).
MAX_DRAFT_TOKENS = 31
#: How far back the lookup searches, tokens: bounds the per-step cost on long conversations.
LOOKUP_WINDOW = 4096


def propose(history: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
            window: int = LOOKUP_WINDOW) -> list[int]:
    """Draft up to ``k`` tokens that follow ``history`` by prompt lookup.

    For n from ``max_ngram`` down to ``min_ngram``, the last n tokens of ``history`` are searched
    for in the last ``window`` tokens (most recent occurrence first, the suffix itself excluded);
    the first occurrence found proposes the (at most ``k``) tokens that followed it.

    Args:
        history: token ids of the conversation so far (prompt + generated), oldest first.
        k: most tokens to propose; 0 or less proposes nothing.

    Returns:
        The drafts, possibly empty (no n-gram recurs).
    """
    if k <= 0:
        return []
    hist = list(history[-window:])
    L = len(hist)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = hist[L - n:]
        for i in range(L - n - 1, -1, -1):  # occurrence hist[i:i+n]; something must follow it
            if hist[i:i + n] == suffix:
                return hist[i + n:i + n + k]
    return []


def accept(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens plain greedy decoding would produce, given one verification step.

    Args:
        drafts: the ``k`` drafted tokens d0..d(k-1) sent after the last chosen token.
        argmax: the last hop's argmax at each of the ``k + 1`` positions of the step: ``argmax[i]``
            is the greedy choice after the last token and ``drafts[:i]``.

    Returns:
        ``argmax[:m + 1]`` where ``m`` is the length of the longest prefix of ``drafts`` equal to
        ``argmax``: the accepted drafts, then the corrected (or bonus) token. 1 to k + 1 tokens.

    Raises:
        ValueError: ``argmax`` does not have ``len(drafts) + 1`` entries.
    """
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"a step with {len(drafts)} drafts needs {len(drafts) + 1} argmaxes, got {len(argmax)}")
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return list(argmax[:m + 1])


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens one verification step with ``k`` drafts yields, at per-draft acceptance ``a``.

    ``E[tokens | k] = (1 - a^(k+1)) / (1 - a)``: the accepted prefix of the drafts plus the one
    token the last hop chooses after it, when each draft is accepted with probability ``a``
    independently of the others (Leviathan et al. 2023, "Fast inference from transformers via
    speculative decoding", eq. 1). ``k = 0`` gives 1 (a plain step); ``a = 1`` gives ``k + 1``.

    Raises:
        ValueError: ``acceptance`` outside ``[0, 1]`` or ``k`` negative.
    """
    if not 0.0 <= acceptance <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= acceptance <= 1 and k >= 0, got acceptance {acceptance}, k {k}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


#: Acceptance assumed before any draft is verified, and the drafted positions that prior is
#: worth: measurements outweigh it after a step or two.
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.5, 2.0
#: Share of past measurements (acceptance counts and step-time averages) kept per decode step:
#: they fade with a half-life of about 7 steps, so the policy follows the text as it changes, and
#: after a run of steps without drafts the acceptance estimate drifts back to the prior, so a
#: policy that stopped drafting tries again (one cheap probe) instead of never learning more.
DECAY = 0.9
#: Cost of one more position in a step, as a share of the route's compute per token
#: (:meth:`DraftPolicy.for_route`), until two step lengths are measured: a CPU peer pays a
#: fraction of a token's compute for each extra position of one pass (docs/architecture.md).
PRIOR_SLOPE_SHARE = 0.25
#: A draft length is chosen only when it promises this many times plain decoding's tokens per
#: second: measurement noise alone must not turn drafting on.
MIN_GAIN = 1.03
#: A step length whose measurements have faded below this weight (about 30 steps ago) is
#: forgotten: an old point would otherwise still set the slope of a two-point line on its own.
FORGET_WEIGHT = 0.05
#: Most drafts while no step longer than one position has been measured: the cost of extra
#: positions is a guess until then, and a wrong guess should cost little.
FIRST_PROBE_DRAFTS = 2
#: Weight (decode steps, fading by :data:`DECAY`) each kind of step, drafted and plain, needs in
#: the realized tokens-per-second check before that check can overrule the model (see
#: :meth:`DraftPolicy.choose`). With DECAY 0.9 a check that turned drafting off lapses after
#: about 9 plain steps, so the policy probes again with one drafted step.
REALIZED_MIN_WEIGHT = 2.0
#: Most plain steps the policy waits before it may draft again after a drafted step that yielded
#: no accepted draft while drafted steps realize fewer tokens per ms than plain ones: 1 after the
#: first such step, doubling with each in a row up to this; none once a draft is accepted. The
#: realized-rate check alone fades within a few plain steps, so a draft that is always wrong (a
#: model of another training run with the same vocabulary) was tried every 4-5 steps: a
#: new-user run measured decoding up to 25% slower than plain with one.
MAX_PROBE_GAP = 64


class DraftPolicy:
    """How many tokens to draft in the next decode step: the ``k`` that maximises expected tokens
    per second, from what this conversation measured. Pure: no I/O, no clock.

    Model (Leviathan et al. 2023, section 3.4, with the draft's cost and the route's step cost
    measured instead of assumed)::

        rate(k) = E[tokens | k] / (draft_ms(k) + step_ms(k + 1))
        E[tokens | k] = (1 - a^(k+1)) / (1 - a)          (see expected_tokens)
        draft_ms(k) = k * draft_ms_per_token
        step_ms(T) = base_ms + slope_ms * (T - 1)         (wall time of a step of T positions)

    ``rate(0) = 1 / step_ms(1)`` is plain decoding; ``k = 0`` is chosen unless some ``k`` beats
    it by :data:`MIN_GAIN`. ``a`` is the per-draft acceptance: each verification step with ``k``
    drafts of which ``m`` were accepted counts ``m`` successes in ``m + (1 if m < k else 0)``
    trials (the drafts after the first rejection were never tried), on top of
    :data:`PRIOR_TRIALS` trials at the prior acceptance. ``base_ms`` and ``slope_ms`` are a
    weighted least-squares line through the average wall time of each step length measured
    (route RTT and compute both included); before two lengths are measured the slope is the
    prior ``prior_slope_ms``, and before any step the base is ``prior_base_ms``.

    Args:
        prior_base_ms: expected wall time of a one-token step, ms (e.g. the route planner's
            estimate per token).
        prior_slope_ms: expected extra ms per extra position in a step.
        prior_acceptance: acceptance assumed before drafts are verified.
        prior_draft_ms: expected ms per drafted token before drafting is timed.

    Until a step of more than one position has been measured, at most :data:`FIRST_PROBE_DRAFTS`
    drafts are chosen.

    The model can be wrong in ways its inputs do not show (a draft model that slows hops on the
    same machine, catch-up passes after plain steps), so the policy also keeps the realized
    tokens per ms of drafted and of plain decode steps, drafting wait included
    (:meth:`record_yield`): when both are measured and drafted steps yield less, it decodes
    plainly whatever the model says. That check fades like the rest, so it is retried.
    """

    def __init__(self, *, prior_base_ms: float, prior_slope_ms: float,
                 prior_acceptance: float = PRIOR_ACCEPTANCE, prior_draft_ms: float = 0.0) -> None:
        self.prior_base_ms, self.prior_slope_ms = max(prior_base_ms, 1e-3), max(prior_slope_ms, 0.0)
        self.prior_acceptance = prior_acceptance
        self._hits = self._trials = 0.0
        self._steps: dict[int, list[float]] = {}  # T -> [mean ms, weight]
        self._draft_ms: list[float] = [max(prior_draft_ms, 0.0), 1.0]  # [mean ms per drafted token, weight]
        self._yield = {True: [0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0]}  # drafted? -> [tokens, ms, weight]
        self.steps_recorded = 0  # decode steps measured so far
        self._gap = self._waited = 0  # plain steps to wait before drafting again, and plain steps since the last drafted

    @classmethod
    def for_route(cls, route, *, prior_acceptance: float = PRIOR_ACCEPTANCE,
                  prior_draft_ms: float = 0.0) -> "DraftPolicy":
        """A policy whose priors come from ``route``'s planner estimate: ``base`` is its ms per
        token, the slope :data:`PRIOR_SLOPE_SHARE` of its hops' compute ms per token."""
        compute = sum(h.peer.compute_ms_per_token * len(h.layers) / max(1, len(h.peer.layers))
                      for h in route.hops)
        return cls(prior_base_ms=route.estimated_ms_per_token, prior_slope_ms=PRIOR_SLOPE_SHARE * compute,
                   prior_acceptance=prior_acceptance, prior_draft_ms=prior_draft_ms)

    # -- measurements --------------------------------------------------------------------------
    def record_step(self, n_positions: int, ms: float) -> None:
        """A decode step of ``n_positions`` positions (1 + drafts) took ``ms`` of wall time.
        Every step also ages the older measurements by :data:`DECAY`."""
        self.steps_recorded += 1
        self._waited = self._waited + 1 if n_positions == 1 else 0
        self._hits, self._trials = self._hits * DECAY, self._trials * DECAY
        for kind in self._yield.values():
            kind[:] = [x * DECAY for x in kind]
        for t in list(self._steps):
            self._steps[t][1] *= DECAY
            if self._steps[t][1] < FORGET_WEIGHT:  # measured too long ago (maybe at another RTT)
                del self._steps[t]
        mean, weight = self._steps.get(n_positions, (0.0, 0.0))
        self._steps[n_positions] = [(mean * weight + ms) / (weight + 1.0), weight + 1.0]

    def record_drafts(self, proposed: int, accepted: int) -> None:
        """A verification step carried ``proposed`` drafts and the first ``accepted`` were kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} drafts")
        self._hits += accepted
        self._trials += accepted + (1 if accepted < proposed else 0)

    def record_yield(self, drafted: bool, tokens: int, ms: float) -> None:
        """A decode step (``drafted``: it carried drafts) gave ``tokens`` kept tokens in ``ms``
        of the decode loop's wall time, drafting included."""
        kind = self._yield[bool(drafted)]
        kind[0] += tokens
        kind[1] += max(ms, 1e-3)
        kind[2] += 1.0
        if drafted:  # no draft accepted, while drafted steps realized less than plain ones: wait longer
            (dt, dms, _), (pt, pms, pw) = self._yield[True], self._yield[False]
            losing = tokens <= 1 and pw > 0 and dt / dms < pt / pms
            self._gap = min(MAX_PROBE_GAP, max(1, 2 * self._gap)) if losing else 0

    def realized_rates(self) -> tuple[float | None, float | None]:
        """Realized tokens per ms of ``(drafted, plain)`` decode steps; None where fewer than
        :data:`REALIZED_MIN_WEIGHT` steps (faded) are measured."""
        return tuple(t / ms if w >= REALIZED_MIN_WEIGHT else None
                     for t, ms, w in (self._yield[True], self._yield[False]))

    def record_draft_cost(self, drafted: int, ms: float) -> None:
        """Drafting ``drafted`` tokens took ``ms`` (of the client's own time, before the step)."""
        if drafted > 0:
            mean, weight = self._draft_ms
            self._draft_ms = [(mean * weight + ms / drafted) / (weight + 1.0), min(weight + 1.0, 1.0 / (1 - DECAY))]

    def new_text(self) -> None:
        """A new generation starts (another prompt, maybe another kind of text): no wait carries
        over from the last one's fruitless drafts (the policy is shared by a route's conversations,
        and a wait grown on general chat kept prompt lookup off a following code edit)."""
        self._gap = self._waited = 0

    # -- estimates -----------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        """Estimated probability that one more draft is accepted."""
        return (self._hits + self.prior_acceptance * PRIOR_TRIALS) / (self._trials + PRIOR_TRIALS)

    def step_line(self) -> tuple[float, float]:
        """``(base_ms, slope_ms)`` of ``step_ms(T) = base_ms + slope_ms * (T - 1)``."""
        pts = [(t, m, w) for t, (m, w) in self._steps.items() if w > 1e-6]
        if not pts:
            return self.prior_base_ms, self.prior_slope_ms
        if len(pts) == 1:
            t, m, _ = pts[0]
            slope = self.prior_slope_ms
            return max(m - slope * (t - 1), 1e-3), slope
        W = sum(w for _, _, w in pts)
        tx, my = sum(w * t for t, _, w in pts) / W, sum(w * m for _, m, w in pts) / W
        var = sum(w * (t - tx) ** 2 for t, _, w in pts)
        slope = max(0.0, sum(w * (t - tx) * (m - my) for t, m, w in pts) / var)
        return max(my - slope * (tx - 1), 1e-3), slope

    def rate(self, k: int) -> float:
        """Expected tokens per ms with ``k`` drafts (see the class docstring)."""
        base, slope = self.step_line()
        return expected_tokens(self.acceptance, k) / (k * self._draft_ms[0] + base + slope * k)

    def describe(self) -> str:
        """The estimates, for logs: acceptance, step line and draft cost."""
        base, slope = self.step_line()
        return (f"acceptance {self.acceptance:.2f}, step {base:.0f} + {slope:.1f} ms per extra position, "
                f"draft {self._draft_ms[0]:.1f} ms per token")

    def choose(self, limit: int) -> int:
        """The draft length, 0 to ``limit``, of the next step: the best :meth:`rate`, or 0 when no
        ``k`` beats plain decoding by :data:`MIN_GAIN`, or when drafted steps realized fewer
        tokens per ms than plain ones (:meth:`realized_rates`), or while it waits after drafted
        steps that lost (:data:`MAX_PROBE_GAP`)."""
        if self._waited < self._gap:
            return 0
        drafted, plain = self.realized_rates()
        if drafted is not None and plain is not None and drafted < plain:
            return 0  # drafting measured slower than plain decoding, whatever the model says
        if not any(t > 1 for t in self._steps):
            limit = min(limit, FIRST_PROBE_DRAFTS)
        best_k, best = 0, self.rate(0) * MIN_GAIN
        for k in range(1, max(0, limit) + 1):
            r = self.rate(k)
            if r > best:
                best_k, best = k, r
        return best_k


@dataclass
class SpecStats:
    """Speculation counters of one generation (``speculative`` in ``chat --json``).

    Attributes:
        proposed: drafted tokens sent for verification.
        accepted: drafted tokens that equalled the greedy choice.
        steps: verification steps (decode steps that carried at least one draft).
        plain_steps: decode steps without drafts (the policy chose none, or nothing was found).
        draft_tokens: the most drafts a step could carry (``--draft-tokens``).
        drafter: what drafted: ``"prompt-lookup"`` or ``"model:NAME"``.
    """

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    plain_steps: int = 0
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    drafter: str = "prompt-lookup"

    def to_dict(self) -> dict:
        return asdict(self) | {"acceptance": round(self.accepted / self.proposed, 3) if self.proposed else 0.0}
