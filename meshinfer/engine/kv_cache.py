"""Per-conversation KV caches.

A :class:`KVCache` holds keys and values for one conversation and one peer's layers.
It is created on first use, grows with decode in steps of :data:`GROW_TOKENS`, can be
truncated to a position (replay after failover, rejected speculative tokens) and is
freed explicitly. Its memory is counted in bytes of allocated storage.
"""

from __future__ import annotations

import torch

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import CacheFull, PositionError

#: Capacity grows in multiples of this many tokens, so decode re-allocates once every
#: 256 steps instead of every step (a copy of the whole cache each time).
GROW_TOKENS = 256


class KVCache:
    """Keys and values of one conversation for ``layers``.

    Args:
        layers: the layer range cached.
        n_kv_heads: Hkv.
        head_dim: D.
        dtype: storage dtype (the shard's compute dtype).
        device: storage device.
        max_tokens: hard limit on cached tokens (the model's context); exceeding it raises.
        batch: B, sequences in this cache (1 for a conversation).

    Storage per layer: ``k, v`` of shape ``(B, Hkv, capacity, D)``; ``length`` tokens are valid.
    """

    def __init__(self, layers: LayerRange, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_tokens: int = 1 << 20, batch: int = 1) -> None:
        self.layers = layers
        self.n_kv_heads, self.head_dim, self.batch = n_kv_heads, head_dim, batch
        self.dtype, self.device = dtype, torch.device(device)
        self.max_tokens = max_tokens
        self.length = 0
        self.capacity = 0
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes across all cached layers (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.batch * self.n_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Bytes of storage allocated now (capacity, not just the valid length)."""
        return self.capacity * self.bytes_per_token

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more tokens before a forward pass writes them.

        Raises:
            CacheFull: when ``length + n_new`` exceeds ``max_tokens``.
        """
        need = self.length + n_new
        if need > self.max_tokens:
            raise CacheFull(f"KV cache would hold {need} tokens, the limit is {self.max_tokens}")
        self._pending = n_new
        if need <= self.capacity:
            return
        new_cap = min(self.max_tokens, -(-need // GROW_TOKENS) * GROW_TOKENS)
        shape = (self.batch, self.n_kv_heads, new_cap, self.head_dim)
        for layer in range(self.layers.start, self.layers.stop):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if layer in self._kv and self.length:
                old_k, old_v = self._kv[layer]
                k[:, :, :self.length] = old_k[:, :, :self.length]
                v[:, :, :self.length] = old_v[:, :, :self.length]
            self._kv[layer] = (k, v)
        self.capacity = new_cap

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``(B, Hkv, T, D)`` at positions ``length .. length+T-1`` of ``layer``.

        Returns the valid keys and values ``(B, Hkv, length+T, D)`` (views, no copy).
        ``length`` itself only advances in :meth:`commit`, once every layer has run.
        """
        T = k.shape[2]
        end = self.length + T
        if end > self.capacity:  # callers that skip reserve()
            self.reserve(T)
        ck, cv = self._kv[layer]
        ck[:, :, self.length:end] = k
        cv[:, :, self.length:end] = v
        return ck[:, :, :end], cv[:, :, :end]

    def storage(self, layer: int, n_new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s whole key and value storage ``(B, Hkv, capacity, D)``, for a kernel that
        writes ``n_new`` positions after ``length`` itself (``kernels.layer_step``); None when
        they do not fit the capacity (``reserve`` first) or the layer is not held."""
        if layer not in self._kv or self.length + n_new > self.capacity:
            return None
        return self._kv[layer]

    def commit(self, n_new: int) -> None:
        """Mark ``n_new`` tokens written by the last forward pass as valid."""
        self.length += n_new
        self._pending = 0

    def truncate(self, position: int) -> None:
        """Forget every token at ``position`` and after (keeps the storage).

        Raises:
            PositionError: when ``position`` is negative or beyond ``length``.
        """
        if not 0 <= position <= self.length:
            raise PositionError(f"cannot truncate to position {position}: the cache holds {self.length} tokens")
        self.length = position

    def free(self) -> int:
        """Drop all storage; return the bytes released. Safe to call twice."""
        released = self.nbytes
        self._kv.clear()
        self.capacity = 0
        self.length = 0
        return released


class HiddenLog:
    """The hidden states a hop sent to the next hop, kept for replay after failover.

    When a later hop of a route fails, its replacement must rebuild its KV cache from the
    hidden states of every earlier position. A hop that stays on the route keeps its own KV
    cache and resends these instead of recomputing them. float32 on the CPU, ``(1, S, C)``:
    4 * C bytes per token (3,584 for C = 896, about 30% of a half model's KV per token).

    Args:
        width: C, the hidden width.
        max_tokens: most positions kept.
    """

    def __init__(self, width: int, *, max_tokens: int) -> None:
        self.width, self.max_tokens = width, max_tokens
        self.length = 0
        self._buf = torch.empty(1, 0, width)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now."""
        return self._buf.numel() * 4

    def append(self, start: int, hidden: torch.Tensor) -> None:
        """Record ``hidden`` ``(1, T, C)`` float32 for positions ``start .. start+T-1``.

        Raises:
            PositionError: ``start`` is not the current length; CacheFull: past ``max_tokens``.
        """
        if start != self.length:
            raise PositionError(f"hidden log holds {self.length} positions, got a step at {start}")
        end = start + hidden.shape[1]
        if end > self.max_tokens:
            raise CacheFull(f"hidden log would hold {end} tokens, the limit is {self.max_tokens}")
        if end > self._buf.shape[1]:
            cap = min(self.max_tokens, -(-end // GROW_TOKENS) * GROW_TOKENS)
            grown = torch.empty(1, cap, self.width)
            grown[:, :self.length] = self._buf[:, :self.length]
            self._buf = grown
        self._buf[:, start:end] = hidden
        self.length = end

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """Positions ``[start, stop)`` as ``(1, stop-start, C)``. Raises PositionError if not held."""
        if not 0 <= start < stop <= self.length:
            raise PositionError(f"hidden log holds positions 0..{self.length - 1}, asked for {start}..{stop - 1}")
        return self._buf[:, start:stop]

    def truncate(self, position: int) -> None:
        """Forget positions ``>= position`` (no-op past the end)."""
        self.length = min(self.length, max(0, position))

    def free(self) -> int:
        """Drop the storage; return the bytes released. Safe to call twice."""
        released = self.nbytes
        self._buf = torch.empty(1, 0, self.width)
        self.length = 0
        return released
