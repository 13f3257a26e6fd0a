"""Where a conversation's drafts come from: prompt lookup, or a draft model at the client.

A :class:`Drafter` proposes up to ``k`` tokens that may follow a conversation's history; the
mesh verifies them in one step (:func:`meshinfer.client.speculative.accept`) and
:class:`~meshinfer.client.speculative.DraftPolicy` chooses ``k``. Two implementations:

- :class:`PromptLookup`: n-grams of the conversation itself (:func:`meshinfer.client.speculative.propose`).
  Free to compute; good when the answer repeats the prompt (code edits).
- :class:`ModelDrafter`: a whole small model (:class:`DraftModel`) run greedily in this process
  with its own per-conversation KV cache (Leviathan et al. 2023, "Fast inference from
  transformers via speculative decoding"). It must share the mesh model's vocabulary
  (:meth:`DraftModel.check_vocabulary`), e.g. Qwen2.5-0.5B drafting for Qwen2.5-7B.

This is the one client module that imports the engine (the draft model's forward pass). Nothing
here prints; the model runs on its own executor thread so the event loop never blocks on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch

from meshinfer.core.errors import DeviceError, IncompatibleDraft, InvalidInput, ModelNotFound, WeightsError
from meshinfer.engine.executor import DeviceExecutor, parse_device
from meshinfer.engine.generate import PREFILL_CHUNK, load_shard, new_cache
from meshinfer.engine.kv_cache import KVCache
from meshinfer.engine.models.llama import Shard
from meshinfer.client.speculative import PRIOR_ACCEPTANCE, propose
from meshinfer.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Precision a draft model loads at unless told otherwise: "auto" is :func:`auto_draft_dtype`.
DEFAULT_DRAFT_DTYPE = "auto"
#: Most drafts per step when a draft model drafts and ``--draft-tokens`` is not given: at
#: ``gguf-a16`` the draft agrees with an f32 mesh on nearly every token (acceptance 0.99-1.00 on
#: the benchmark's prompts, docs/benchmarks.md), so long drafts pay; the policy still chooses
#: each step's length (``client/decode.py``).
DEFAULT_MODEL_DRAFT_TOKENS = 16
#: Acceptance a draft model's policy assumes before any of its drafts is verified: a model of the
#: same family agrees with the mesh model on most tokens (prompt lookup starts at 0.5).
DRAFT_MODEL_PRIOR_ACCEPTANCE = 0.8


class Drafter(Protocol):
    """What :class:`~meshinfer.client.conversation.Conversation` asks for drafts.

    Attributes:
        name: what drafts, for the conversation's counters (``"prompt-lookup"``, ``"model:NAME"``).
        prior_acceptance: the acceptance the draft-length policy assumes before measuring.
        prior_draft_ms: the ms per drafted token it assumes before timing drafts.
        last_cost_ms: what the last :meth:`propose` spent drafting, ms, not counting the catch-up
            of a run of tokens the drafter had not seen (a one-off cost, not a per-draft one).
    """

    name: str
    prior_acceptance: float
    prior_draft_ms: float
    last_cost_ms: float

    async def prefill(self, history: Sequence[int]) -> None:
        """Get ready to draft after ``history`` (run while the mesh prefills the same prompt)."""

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` ids that may follow ``history`` (every id of the conversation, oldest first)."""

    def draft_ahead(self, history: Sequence[int], k: int) -> asyncio.Future | None:
        """Start drafting up to ``k`` ids after ``history`` in the background (while the mesh
        verifies the step that ends ``history``), so a later :meth:`propose` on the same line
        finds them computed; None when this drafter has nothing to gain from it."""

    async def stop_ahead(self) -> None:
        """Stop the background drafting of :meth:`draft_ahead` (after the pass it is in) and wait
        for it. Safe to call when none runs."""

    async def close(self) -> None:
        """Free what this conversation's drafter holds. Safe to call twice."""


class PromptLookup:
    """Drafts by prompt lookup (:func:`meshinfer.client.speculative.propose`); holds nothing."""

    name = "prompt-lookup"
    prior_acceptance = PRIOR_ACCEPTANCE
    prior_draft_ms = last_cost_ms = 0.0  # a search in the last 4,096 tokens: well under a ms

    async def prefill(self, history: Sequence[int]) -> None:
        return None

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        return propose(history, k)

    def draft_ahead(self, history: Sequence[int], k: int) -> None:
        return None  # a lookup costs nothing: nothing to hide

    async def stop_ahead(self) -> None:
        return None

    async def close(self) -> None:
        return None


class DraftModel:
    """A whole model loaded at the client to draft for the mesh: weights, tokenizer, executor.

    Load with :func:`load_draft_model`. One per client; each conversation gets its own
    :class:`ModelDrafter` (and KV cache) from :meth:`drafter`.

    Args:
        shard: a shard holding every layer.
        tokenizer: the draft model's own tokenizer (checked against the mesh's).
        name: shown in counters and logs (the file's stem).
        executor: the device thread the model runs on.

    Attributes:
        live: the drafters whose caches are not freed yet.
        ms_per_token: the median wall ms of a one-token pass, timed by :meth:`time_pass`
            (0 until then): the draft cost the policy assumes before it times real drafts.
    """

    def __init__(self, shard: Shard, tokenizer: Tokenizer, *, name: str, executor: DeviceExecutor) -> None:
        if not (shard.is_first and shard.is_last):
            raise InvalidInput(f"a draft model needs every layer; this shard holds {shard.range.cli()}")
        self.shard, self.tokenizer, self.name, self.executor = shard, tokenizer, name, executor
        self.live: set[ModelDrafter] = set()
        self.ms_per_token = 0.0
        self.precision = ""  # its precision name, set by load_draft_model
        self._checked: set[str] = set()  # fingerprints of mesh tokenizers found compatible

    def check_vocabulary(self, target: Tokenizer) -> None:
        """Refuse a mesh model whose tokenizer maps ids to other pieces than the draft's.

        Compares every id's piece (text and control tokens alike), not model names; the draft
        model's embedding may have extra padding rows (they are never proposed).

        Raises:
            IncompatibleDraft: the vocabularies differ; the message gives both sizes and the first id
                whose piece differs.
        """
        key = target.fingerprint()
        if key in self._checked:
            return
        mine, theirs = self.tokenizer.pieces(), target.pieces()
        if mine != theirs:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise IncompatibleDraft(
                f"draft model {self.name} has a vocabulary of {len(mine)} tokens, the mesh model {len(theirs)}; "
                f"they differ from id {diff} on ({_piece(mine, diff)} against {_piece(theirs, diff)}): a draft "
                f"model must use the mesh model's tokenizer (a smaller model of the same family)")
        self._checked.add(key)

    def time_pass(self, *, passes: int = 3) -> float:
        """Time ``passes`` one-token passes after a short prompt (which also warms the kernels up);
        set and return :attr:`ms_per_token`, their median. Runs in the calling thread
        (:func:`load_draft_model` calls it on the drafting thread)."""
        import statistics

        cache = new_cache(self.shard)
        try:
            self.shard(torch.zeros(1, 8, dtype=torch.int64), 0, cache)  # (1, 8) ids
            times = []
            for _ in range(passes):
                t0 = time.perf_counter()
                self.shard(torch.zeros(1, 1, dtype=torch.int64), cache.length, cache)
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            cache.free()
        self.ms_per_token = statistics.median(times)
        return self.ms_per_token

    def drafter(self) -> "ModelDrafter":
        """A drafter with its own (empty) KV cache, for one conversation."""
        d = ModelDrafter(self)
        self.live.add(d)
        return d

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV cache the live drafters hold now."""
        return sum(d.cache_bytes for d in self.live)

    def close(self) -> None:
        """Stop the executor thread (after queued work). Safe to call twice."""
        self.executor.close()


def _piece(pieces: list, i: int) -> str:
    return repr(pieces[i]) if i < len(pieces) else "none"


class ModelDrafter:
    """One conversation's drafts from a :class:`DraftModel`: greedy tokens from its own KV cache.

    The cache holds a prefix of the conversation. Each :meth:`propose` keeps the longest prefix
    the cache shares with the history (dropping what the mesh rejected: the rollback), feeds the
    rest in one pass (its last position's logits give the first draft), then one pass per further
    draft. So ``k`` drafts cost ``k`` passes of 1-2 positions after the first call, which also
    prefills the prompt.

    The drafter remembers the greedy line it drafted last (a history and the drafts after it).
    Greedy drafting is deterministic, so when a later history lies on that line (the mesh
    accepted every draft and chose the token the draft model guessed next), the drafts after it
    are already known and cost nothing. :meth:`draft_ahead` extends the line in the background
    while the mesh verifies a step (Leviathan et al. 2023 leave this overlap to the
    implementation; issue 12, item 4).
    """

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.name = f"model:{model.name}"
        self.prior_acceptance = DRAFT_MODEL_PRIOR_ACCEPTANCE
        self.prior_draft_ms = model.ms_per_token
        self.last_cost_ms = 0.0
        self.cache: KVCache | None = None
        self.tokens: list[int] = []  # ids whose keys and values the cache holds, in order
        self._base: list[int] = []  # a history the draft model continued ...
        self._line: list[int] = []  # ... and its greedy continuation, as far as computed
        self._ahead: asyncio.Future | None = None  # the background drafting of draft_ahead()
        self._halt = threading.Event()  # set: the background drafting stops after its pass

    def known(self, history: Sequence[int]) -> list[int]:
        """The greedy drafts after ``history`` already computed (empty when ``history`` is off
        the remembered line)."""
        nb = len(self._base)
        if len(history) < nb or list(history[:nb]) != self._base:
            return []
        done = len(history) - nb
        if self._line[:done] != list(history[nb:]):
            return []
        return self._line[done:]

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    async def prefill(self, history: Sequence[int]) -> None:
        """Cache ``history`` but its last token (whose pass gives the first draft), on the draft
        model's thread: :meth:`propose` then costs one pass per draft."""
        if 1 < len(history) <= self.model.shard.cfg.max_position_embeddings:
            await self.model.executor.run(self._feed, list(history[:-1]))

    async def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy drafts after ``history``, computed on the draft model's thread.

        Drafts already on the remembered line cost nothing; :attr:`last_cost_ms` is the time
        this call spent drafting (0 when all were known). Fewer when the draft model's context
        ends first. Stops a :meth:`draft_ahead` in progress first. Cancelling the caller does not
        stop a pass already running (the next call continues from the cache it left).
        """
        await self.stop_ahead()
        if k <= 0 or not history:
            return []
        history = list(history)
        known = self.known(history)
        if len(known) >= k:
            self.last_cost_ms = 0.0
            return known[:k]
        return await self.model.executor.run(self._propose, history, k)

    def draft_ahead(self, history: Sequence[int], k: int) -> asyncio.Future | None:
        """Extend the remembered line to ``k`` drafts after ``history`` on the draft model's
        thread, pass by pass, until done or :meth:`stop_ahead`. Returns the running future."""
        if k <= 0 or not history or self._ahead is not None:
            return None
        self._halt.clear()
        self._ahead = asyncio.ensure_future(self.model.executor.run(self._propose, list(history), k, True))
        return self._ahead

    async def stop_ahead(self) -> None:
        """Stop :meth:`draft_ahead` after the pass it is in and wait for it; its error, if any,
        is dropped (the next :meth:`propose` meets the same problem and raises it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._halt.set()
            await asyncio.gather(ahead, return_exceptions=True)

    def _propose(self, history: list[int], k: int, ahead: bool = False) -> list[int]:
        """:meth:`propose` (or, ``ahead``, :meth:`draft_ahead`) on the executor thread.
        ``history`` ``(S,)`` ids -> up to ``k`` ids, continuing the remembered line when
        ``history`` is on it; the line then runs from ``history``."""
        k = min(k, self.model.shard.cfg.max_position_embeddings - len(history))
        if k <= 0:
            return []
        vocab = self.model.tokenizer.vocab_size  # ids past it are the embedding's padding rows
        drafts = self.known(history)[:k]
        self._base, self._line = history, drafts
        t0, cost = time.perf_counter(), 0.0
        if not drafts:
            logits, fed = self._feed(history)  # (1, 1, V) float32
            # a pass over a run of unseen tokens (after plain steps) is charged as one draft pass
            cost = (time.perf_counter() - t0) * 1e3 if fed <= 2 else self.model.ms_per_token
            drafts.append(int(logits[0, -1, :vocab].argmax()))
            t0 = time.perf_counter()
        while len(drafts) < k and not (ahead and self._halt.is_set()):
            logits, _ = self._feed(history + drafts)
            drafts.append(int(logits[0, -1, :vocab].argmax()))  # also extends self._line
        if not ahead:
            self.last_cost_ms = cost + (time.perf_counter() - t0) * 1e3
        return list(drafts)

    def _feed(self, history: list[int]) -> tuple[torch.Tensor, int]:
        """Make the cache hold ``history`` (``(S,)`` ids): keep the longest prefix it shares with
        what it holds (dropping rejected drafts), but never all of ``history``, and run the rest
        in chunks. Returns the last position's logits ``(1, 1, V)`` float32 and the tokens run."""
        if self.cache is None:
            self.cache = new_cache(self.model.shard)
        limit = min(len(self.tokens), len(history) - 1)  # feed at least one token: its logits
        keep = limit if self.tokens[:limit] == history[:limit] else 0  # the usual case, compared in C
        while keep < limit and self.tokens[keep] == history[keep]:
            keep += 1
        self.cache.truncate(keep)
        del self.tokens[keep:]
        feed = history[keep:]
        for s in range(0, len(feed), PREFILL_CHUNK):
            chunk = torch.tensor([feed[s:s + PREFILL_CHUNK]], dtype=torch.int64)  # (1, T)
            logits = self.model.shard(chunk, self.cache.length, self.cache)  # (1, 1, V)
        self.tokens.extend(feed)
        return logits, len(feed)

    async def close(self) -> None:
        """Free the KV cache (after any pass still running on the thread). Safe to call twice."""
        await self.stop_ahead()
        if self in self.model.live:
            self.model.live.discard(self)
            await self.model.executor.run(self._free)

    def _free(self) -> None:
        if self.cache is not None:
            self.cache.free()
        self.cache, self.tokens = None, []
        self._base, self._line = [], []


def auto_draft_dtype(path: str | os.PathLike, device: str) -> str:
    """The precision ``--draft-dtype auto`` picks: on a CPU, ``gguf-a16`` for a GGUF file when
    the gguf kernels build here with their integer dot products (the file's own blocks with
    near-exact int16 activations: about 1.4x the speed of ``gguf`` and 3x f32 on one core, with
    drafts an f32 mesh accepts almost always; docs/performance.md), else ``q8-bf16``; on a
    GPU, ``bf16``."""
    if parse_device(device).type != "cpu":
        return "bf16"
    if Path(path).is_file():
        from meshinfer.engine.kernels import native
        lib = native.library()
        if lib is not None:
            return "gguf-a16"
    return "q8-bf16"


def load_draft_model(spec: str | os.PathLike, *, device: str = "cpu", dtype: str = DEFAULT_DRAFT_DTYPE,
                     cache_dir: str | os.PathLike | None = None, threads: int | None = None) -> DraftModel:
    """Load a whole draft model and its tokenizer, checking everything that can be checked without
    the mesh: the file exists (or the name is known and pulled), its weights and tokenizer read.
    The weights are this process's own copy, not the file's memory map: a file written over or
    truncated later changes no draft (:func:`meshinfer.engine.generate.load_shard`).

    Args:
        spec: a GGUF file, a Hugging Face directory, or a known model name (pulled if missing).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        dtype: a precision name (``f32``, ``bf16``, ``q8-bf16``, ``gguf-a16`` ...) or ``auto``
            (:func:`auto_draft_dtype`).
        cache_dir: where converted quantized tensors are kept between loads (None: not kept).
        threads: torch CPU threads of the draft model's thread (None: torch's default).

    Raises:
        ModelNotFound: no such file, or an unknown name; WeightsError: the file does not read as
        a model with a tokenizer (corrupt, truncated); InvalidInput or DeviceError: a bad
        ``dtype`` or ``device``. Every message starts with "draft model".
    """
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.registry import resolve_model

    t0 = time.perf_counter()
    try:
        path = resolve_model(spec, progress=False)
    except ModelNotFound as exc:
        raise ModelNotFound(f"draft model: {exc}") from exc
    try:
        dev = parse_device(device)
    except DeviceError as exc:
        raise DeviceError(f"draft model: {exc}") from exc
    if dtype == "auto":
        dtype = auto_draft_dtype(path, device)
    try:
        src = open_weights(path)
        tok = Tokenizer.from_gguf(src) if Path(path).is_file() else Tokenizer.from_hf_dir(path)
        shard = load_shard(src, dtype=dtype, device=str(dev), cache_dir=cache_dir)  # copies: see load_shard
    except (WeightsError, OSError, ValueError, KeyError, IndexError) as exc:
        if isinstance(exc, InvalidInput) and not isinstance(exc, WeightsError):
            raise InvalidInput(f"draft model: {exc}") from exc
        raise WeightsError(f"draft model {path}: cannot load it: {exc}") from exc
    name = Path(path).name.removesuffix(".gguf")
    model = DraftModel(shard, tok, name=name, executor=DeviceExecutor(dev, threads=threads))
    model.precision = dtype
    ms = model.executor.submit(model.time_pass).result()  # on the thread (and thread count) that drafts
    log.info("draft model %s loaded at %s on %s in %.1f s; %.1f ms per drafted token", name, dtype, dev,
             time.perf_counter() - t0, ms)
    return model
