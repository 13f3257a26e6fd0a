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
    the merges do. Costs one pass over each content at C speed (about a millisecond per MB of
    NFC text; normalizing text that is not NFC costs more).

    Raises:
        InvalidInput: malformed messages (as ``encode_chat``).
    """
    chars = sum(_rendered_chars(m) for m in validate_messages(messages))
    return chars, -(-chars // max(1, max_piece_chars))


def _rendered_chars(message: Mapping[str, Any]) -> int:
    """Characters of ``message``'s content that any chat template renders (see
    :func:`min_chat_tokens`): trimmed, an assistant's from its last ``</think>``, and no more
    than its NFC form holds."""
    content = (message.get("content") or "").strip()
    cut = content.rfind(THINK_END) if message.get("role") == "assistant" else -1
    if cut >= 0:
        content = content[cut + len(THINK_END):].strip()
    if unicodedata.is_normalized("NFC", content):
        return len(content)
    return min(len(content), len(unicodedata.normalize("NFC", content)))
