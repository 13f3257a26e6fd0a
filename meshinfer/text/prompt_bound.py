"""A lower bound on the tokens of a chat prompt, found without rendering or tokenizing it, so that
a prompt that cannot fit the model's context is refused before it costs seconds of a core
(:func:`meshinfer.app.reply.check_prompt_fits`)."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from meshinfer.text.template import validate_messages

#: What ends a reasoning block; Qwen3's chat template drops an earlier assistant turn's text up to it.
THINK_END = "</think>"


def min_chat_tokens(messages: Sequence[Mapping[str, Any]], max_piece_chars: int) -> tuple[int, int]:
    """A lower bound on the tokens of ``messages`` rendered and tokenized
    (``len(Tokenizer.encode_chat(messages))``), found without either.

    Args:
        messages: the chat, as :meth:`~meshinfer.text.tokenizer.Tokenizer.encode_chat` takes it.
        max_piece_chars: the longest piece of the vocabulary, characters
            (:attr:`~meshinfer.text.tokenizer.Tokenizer.max_piece_chars`).

    Returns:
        ``(chars, tokens)``: the characters of the messages' contents that every chat template
        renders, and ``ceil(chars / max_piece_chars)``.

    Why it holds: (1) chat templates copy each message's content into the prompt, at most trimmed
    of surrounding whitespace (Llama 3's ``| trim``), and an assistant turn may lose its reasoning
    up to its last ``</think>`` (Qwen3's template); only what is left after both is counted, and
    tools and tool calls are not counted. (2) Tokenizing never turns a character into less than
    one byte, and the only normalization meshinfer's byte-level BPE tokenizers apply, Unicode NFC
    (Qwen2's), is allowed for by counting the shorter of a content and its NFC form (NFC of a
    whole is never longer than NFC of its parts, and the control strings a template adds are
    ASCII, which NFC keeps). (3) A byte-level BPE piece spells one character per byte of the
    text it stands for (GPT-2's byte-to-character table), and an added token's piece is its
    text, so no token stands for more than ``max_piece_chars`` characters. Hence a prompt of
    ``chars`` such characters has at least ``ceil(chars / max_piece_chars)`` tokens, whatever
    the merges do. Costs one pass over each content at C speed: ASCII is counted as it is (NFC
    keeps it); other text is normalized only up to :data:`NFC_BUDGET_CHARS` characters per
    prompt, and beyond that counted as a quarter of its length (:data:`NFC_MAX_SHRINK`), because
    CPython's NFC holds the GIL for a time that grows with the square of a run of combining marks
    (a 240 KB run froze ``serve`` for 16 s).

    Raises:
        InvalidInput: malformed messages (as ``encode_chat``).
    """
    budget = [NFC_BUDGET_CHARS]
    chars = sum(_rendered_chars(m, budget) for m in validate_messages(messages))
    return chars, -(-chars // max(1, max_piece_chars))


#: Non-ASCII characters per prompt that :func:`min_chat_tokens` normalizes to NFC to count them
#: exactly: its worst case (a run of combining marks NFC must reorder) costs about 0.1 s of a
#: core at this size.
NFC_BUDGET_CHARS = 8192
#: Most characters NFC turns into one: a character's full canonical decomposition is at most 4
#: code points long (e.g. U+1F82, Unicode's UnicodeData.txt), and composition only rebuilds such
#: characters, so NFC never shortens a text to less than a quarter of its length.
NFC_MAX_SHRINK = 4


def _rendered_chars(message: Mapping[str, Any], budget: list[int]) -> int:
    """Characters of ``message``'s content that any chat template renders (see
    :func:`min_chat_tokens`): trimmed, an assistant's from its last ``</think>``, and no more
    than its NFC form holds (exactly within ``budget[0]`` non-ASCII characters, which it
    spends; else a quarter of its length)."""
    content = (message.get("content") or "").strip()
    cut = content.rfind(THINK_END) if message.get("role") == "assistant" else -1
    if cut >= 0:
        content = content[cut + len(THINK_END):].strip()
    if content.isascii():
        return len(content)
    if len(content) > budget[0]:
        return -(-len(content) // NFC_MAX_SHRINK)
    budget[0] -= len(content)
    return min(len(content), len(unicodedata.normalize("NFC", content)))
