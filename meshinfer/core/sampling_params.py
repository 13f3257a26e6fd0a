"""How the last hop picks tokens: the parameters a request carries (pure data, no torch).

The choice itself is :func:`meshinfer.engine.sampling.pick_token`; the parameters travel on
the wire (:func:`meshinfer.wire.protocol.sampling_from_wire`) and come from the API.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshinfer.core.errors import InvalidInput


#: Seeds are reduced to this range (``seed % 2**63``) before use.
SEED_MODULUS = 1 << 63


@dataclass(frozen=True)
class SamplingParams:
    """How the last hop picks tokens.

    Attributes:
        temperature: divides the logits before the softmax; 0 means greedy (argmax). At most 100.
        top_p: nucleus sampling: sample among the most likely tokens whose probabilities sum
            to at least ``top_p`` (Holtzman et al. 2019, "The Curious Case of Neural Text
            Degeneration", section 3.1). In (0, 1]; 1 keeps every token.
        seed: integer in ``[0, 2**63)``; with the position it seeds each draw.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInput(f"temperature {self.temperature} must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p {self.top_p} must be in (0, 1]")
        if not 0 <= self.seed < SEED_MODULUS:
            raise InvalidInput(f"seed {self.seed} must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (``temperature`` 0)."""
        return self.temperature == 0.0

    def to_wire(self) -> dict:
        """The ``sampling`` field of a ``step`` frame (see docs/protocol.md)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
