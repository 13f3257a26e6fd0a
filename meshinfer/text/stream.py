"""Streaming detokenization: generated ids to text one token at a time, never showing half a
UTF-8 character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshinfer.text.tokenizer import Tokenizer


class StreamDecoder:
    """Incremental detokenizer: feed generated ids one at a time, get finished text.

    Uses the prefix/read offset technique of text-generation-inference (``decode_token`` in
    ``server/text_generation_server/models/model.py``): decode the ids since the last emitted
    boundary with and without the new id, and emit the difference only when it does not end in
    U+FFFD (an incomplete UTF-8 character). Control and end-of-generation ids are dropped.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tk = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the ids decoded for context
        self._read = 0  # end of the ids whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (may be ``""``).

        Raises:
            InvalidInput: ``token_id`` is not an integer in ``[0, vocab_size)``.
        """
        (token_id,) = self._tk._check_ids([token_id])
        if token_id in self._tk._hidden_ids:
            return ""
        self._ids.append(token_id)
        done = self._tk._decode(self._ids[self._prefix:self._read])
        text = self._tk._decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        # Keep only the ids still needed as context for the next call.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Return the text still held back (an incomplete character shows as U+FFFD) and reset."""
        done = self._tk._decode(self._ids[self._prefix:self._read])
        text = self._tk._decode(self._ids[self._prefix:])
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(done):]
