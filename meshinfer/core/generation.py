"""A generation's result and the context-length check, shared by the single-process baseline
and the mesh client (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from meshinfer.core.errors import ContextOverflow, InvalidInput


def check_context(n_prompt: int, max_tokens: int | None, context: int, *,
                  what: str = "the model's context") -> int:
    """Return the number of tokens that may be generated.

    Raises:
        ContextOverflow: the prompt is empty, longer than the context, or prompt + ``max_tokens``
            exceeds it (``max_tokens=None`` means "up to the context").
    """
    if n_prompt == 0:
        raise InvalidInput("the prompt is empty")
    if n_prompt >= context:
        raise ContextOverflow(f"the prompt has {n_prompt} tokens; {what} is {context} tokens")
    if max_tokens is None:
        return context - n_prompt
    if max_tokens < 1:
        raise InvalidInput(f"max_tokens must be at least 1, got {max_tokens}")
    if n_prompt + max_tokens > context:
        raise ContextOverflow(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                              f"{n_prompt + max_tokens} exceeds {what} of {context} tokens")
    return max_tokens


@dataclass
class Generation:
    """Result of one greedy generation; the fields of ``--json`` output."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0

    def accept(self, token: int, *, budget: int, eos: set[int],
               on_token: Callable[[int], bool | None] | None = None) -> bool:
        """Record a chosen token; return False once generation ends.

        An end-of-generation id ends it with ``finish_reason`` "stop" (the id is not kept);
        so does ``on_token`` returning True (a stop sequence; the id is kept); reaching
        ``budget`` tokens ends it with "length".
        """
        if token in eos:
            self.finish_reason = "stop"
            return False
        self.token_ids.append(token)
        if on_token and on_token(token):
            self.finish_reason = "stop"
            return False
        return len(self.token_ids) < budget

    def set_decode_rate(self, decode_steps: int, elapsed_s: float) -> None:
        """``decode_tokens_per_s`` from the decode steps run and their wall time, seconds."""
        self.decode_tokens_per_s = decode_steps / elapsed_s if decode_steps and elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)
