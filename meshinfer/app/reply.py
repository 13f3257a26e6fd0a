"""One chat reply through the mesh: the path ``meshinfer chat`` and ``meshinfer serve`` share.

:func:`plan_for` plans a route (optionally only over peers holding given weights) and fetches
its tokenizer; :func:`reply` generates on a conversation and streams the text through a
:class:`TextStream`, which holds back incomplete UTF-8 characters and any text that may turn
out to start a stop sequence; :func:`one_reply` wraps it in a fresh conversation that is
closed (freeing the hops' caches) however the reply ends, cancellation included.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from meshinfer.core.config import PRECISION_NAMES
from meshinfer.core.errors import ContextOverflow, NoRoute
from meshinfer.client.routing import Route
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.client.conversation import Conversation
from meshinfer.client.mesh import MeshClient
from meshinfer.client.results import ChatResult
from meshinfer.text.prompt_bound import min_chat_tokens
from meshinfer.text.stream import StreamDecoder
from meshinfer.text.tokenizer import Tokenizer


class TextStream:
    """Generated ids in, text safe to show out: whole characters, never part of a stop sequence.

    Args:
        tokenizer: the route's tokenizer.
        stop: stop sequences (non-empty strings); the first one found ends the text, and
            neither it nor anything after it is emitted.

    Attributes:
        text: everything emitted so far.
        stopped: True once a stop sequence was found.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self._pending = ""
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it releases (may be ``""``)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """Release what is held back at the end of generation (an incomplete character shows as U+FFFD)."""
        if not self.stopped:
            self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[:min(hits)], "", True
        else:
            keep = 0 if final else self._held()
            out = self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(out):]
        self.text += out
        return out

    def _held(self) -> int:
        """Length of the longest end of the pending text that begins some stop sequence."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best


#: Plans ``plan_for`` makes before it gives up on a route of the weights and precision asked for:
#: each ``client.plan`` refreshes the table, and may learn peers of others that the exclusions
#: made from the table before it did not name.
PLAN_TRIES = 3


def _unwanted(client: MeshClient, weights_hash: str | None, precision: str | None) -> frozenset[str]:
    """Ids of the peers in ``client``'s table of other weights or another precision than asked."""
    return frozenset(pid for pid, ad in client.table.items()
                     if (weights_hash is not None and ad.weights_hash != weights_hash)
                     or (precision is not None and ad.precision != precision))


def _precisions_note(client: MeshClient, precision: str) -> str:
    """What the mesh computes at, for a refusal: the known precision names its peers advertise
    (:data:`PRECISION_NAMES`) and how many others (an advert's string is anyone's: it is not printed)."""
    have = {ad.precision for ad in client.table.values()}
    known = [p for p in PRECISION_NAMES if p in have]
    others = len(have) - len(known)
    listed = ", ".join(known) or "none"
    return (f"asked for precision {precision}, the mesh's peers compute at {listed}"
            + (f" and {others} other precision name(s)" if others else ""))


def model_id(weights_hash: str) -> str:
    """The stable id of the weights ``weights_hash``: a known model's name, else ``sha256-<16 hex>``."""
    from meshinfer.engine.weights.registry import KNOWN_MODELS

    for name, known in KNOWN_MODELS.items():
        if known.sha256 == weights_hash:
            return name
    return f"sha256-{weights_hash[:16]}"


async def weights_for(client: MeshClient, name: str) -> str:
    """The weights hash ``chat --model NAME`` asks for: a known model's name, a :func:`model_id`
    (``sha256-<hex>``), or the start of a weights hash (at least 8 hex digits) of a peer in the
    mesh.

    Raises:
        ValueError: no such model in the mesh, or a prefix that several weights share; the
            message lists the models the mesh serves.
        PeerUnavailable: no bootstrap peer answered.
    """
    from meshinfer.engine.weights.registry import KNOWN_MODELS

    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name].sha256
    await client.refresh()
    served = sorted({ad.weights_hash for ad in client.table.values()})
    prefix = name.lower().removeprefix("sha256-")
    found = [h for h in served if len(prefix) >= 8 and h.startswith(prefix)] if prefix.isalnum() else []
    if len(found) == 1:
        return found[0]
    listing = ", ".join(model_id(h) for h in served) or "none"
    if found:
        raise ValueError(f"--model {name[:80]!r} is the start of {len(found)} weights hashes: give more of it "
                         f"(the mesh serves {listing})")
    raise ValueError(f"--model {name[:80]!r} is no model this mesh serves (it serves {listing}; a known model "
                     f"name or the first 8 or more hex digits of a weights hash, as `meshinfer status` shows)")


async def plan_for(client: MeshClient, *, weights_hash: str | None = None,
                   precision: str | None = None) -> tuple[Route, Tokenizer]:
    """Plan the fastest route and get its tokenizer: only over peers holding ``weights_hash``
    and computing at ``precision`` (e.g. ``"gguf-a16"``) when those are given; otherwise the
    fastest complete route of any weights and precision. A route that ``client.plan``'s own
    refresh made of peers learnt meanwhile of other weights or precision is planned again
    without them (:data:`PLAN_TRIES` plans in all).

    Raises:
        NoRoute: no complete route (of those weights, at that precision); the message names
            the known precisions the mesh does have.
        PeerUnavailable: no bootstrap peer answered.
        IncompatiblePeer: the first hop's tokenizer belongs to other weights.
    """
    exclude: frozenset[str] = frozenset()
    if weights_hash is not None or precision is not None:
        await client.refresh()
        exclude = _unwanted(client, weights_hash, precision)
    for _ in range(PLAN_TRIES):
        try:
            route = await client.plan(exclude=exclude)
        except NoRoute as exc:
            if precision is None:
                raise
            if not any(ad.precision == precision for ad in client.table.values()):
                # no peer of it at all: the planner's list of the others as "excluded" says nothing
                raise NoRoute(f"no route at precision {precision}: {_precisions_note(client, precision)}") from exc
            raise NoRoute(f"{exc}; {_precisions_note(client, precision)}") from exc
        if ((weights_hash is None or route.compat_key[0] == weights_hash)
                and (precision is None or route.compat_key[1] == precision)):
            return route, await client.tokenizer(route)
        exclude |= _unwanted(client, weights_hash, precision)
    what = " ".join(x for x in (weights_hash and f"of weights {weights_hash[:12]}",
                                precision and f"at precision {precision}") if x)
    raise NoRoute(f"no complete route {what}: peers of others kept joining while it was planned")


def check_prompt_fits(tok: Tokenizer, messages: Sequence[Mapping[str, Any]], *, context_tokens: int | None,
                      max_tokens: int) -> None:
    """Refuse ``messages`` whose prompt cannot fit the model's context, before the chat template
    renders them or the tokenizer reads them (seconds of a core for a 4 MB prompt).

    The bound is :func:`~meshinfer.text.prompt_bound.min_chat_tokens`: no token of the vocabulary stands for more
    than :attr:`Tokenizer.max_piece_chars` characters, so a prompt of ``chars`` characters has
    at least ``ceil(chars / max_piece_chars)`` tokens. A prompt under the bound may still be too
    long; the hops' own check (``open``) then refuses it after tokenizing.

    Args:
        tok: the route's tokenizer.
        messages: the chat, as :meth:`Tokenizer.encode_chat` takes it.
        context_tokens: the model's context, tokens (:meth:`MeshClient.context_tokens`), or
            None when unknown (nothing is checked).
        max_tokens: tokens to generate at most, reserved next to the prompt.

    Raises:
        ContextOverflow: the bound plus ``max_tokens`` exceed ``context_tokens``; the message
            names the characters, the bound, ``max_tokens`` and the context.
        InvalidInput: malformed messages.
    """
    if context_tokens is None:
        return
    chars, at_least = min_chat_tokens(messages, tok.max_piece_chars)
    if at_least + max_tokens > context_tokens:
        raise ContextOverflow(f"the prompt cannot fit the model's context of {context_tokens} tokens: its "
                              f"{chars} characters are at least {at_least} tokens (no token of this vocabulary "
                              f"spells more than {tok.max_piece_chars} characters), and max_tokens is {max_tokens}")


async def reply(conv: Conversation, tok: Tokenizer, prompt_ids: Sequence[int], *, max_tokens: int,
                sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                on_text: Callable[[str], None] | None = None) -> ChatResult:
    """Generate a reply on ``conv``; ``on_text`` gets each piece of text as it is released.

    The result's ``text`` is the text released (without any stop sequence); ``finish_reason``
    is "stop" (end-of-generation id or stop sequence) or "length" (``max_tokens`` reached).

    Raises:
        ContextOverflow: the prompt plus ``max_tokens`` exceed the conversation's context.
        MeshError: see :meth:`Conversation.generate`.
    """
    stream = TextStream(tok, stop)

    def take(token: int) -> bool:
        piece = stream.push(token)
        if piece and on_text:
            on_text(piece)
        return stream.stopped

    result = await conv.generate(prompt_ids, max_tokens=max_tokens, eos_ids=tok.eos_ids, on_token=take,
                                 sampling=sampling)
    tail = stream.finish()
    if tail and on_text:
        on_text(tail)
    result.text = stream.text
    return result


async def one_reply(client: MeshClient, route: Route, tok: Tokenizer, prompt_ids: Sequence[int], *,
                    max_tokens: int, conversation_options: dict | None = None, **options) -> ChatResult:
    """:func:`reply` in a new conversation holding ``len(prompt_ids) + max_tokens`` tokens.

    The conversation is closed on every hop afterwards, also when this coroutine is cancelled
    (a client that went away) or raises. ``conversation_options`` go to
    :meth:`MeshClient.conversation` (``speculate``, ``draft_tokens``), ``options`` to :func:`reply`.
    """
    conv = client.conversation(route, max_tokens_total=len(prompt_ids) + max_tokens, **(conversation_options or {}))
    try:
        return await reply(conv, tok, prompt_ids, max_tokens=max_tokens, **options)
    finally:
        await conv.close()
