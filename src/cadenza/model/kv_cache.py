"""KV cache for MLA: stores the compressed latent per token, not expanded keys and values.

Per layer and token the cache holds c_kv (after its RMSNorm) and k_pe (after RoPE):
kv_lora_rank + qk_rope_head_dim numbers (576 for DeepSeek-V3 / Kimi K2) instead of
heads * (qk_head_dim + v_head_dim) (40960 for DeepSeek-V3's 128 heads) for expanded K/V.
That is a 35-70x smaller cache, so long agentic contexts and many parallel rollouts fit;
the price is re-expanding K/V through kv_b_proj at each step, which is what the attention
layer does anyway for a fresh sequence.

Layout: slots [0, length) along the sequence are filled for every sequence of the batch.
`valid` [B, capacity] marks which filled slots hold real tokens (left padding and holes are
False and never attended to); each sequence's positions count only its valid tokens, so a
left-padded prompt gets the same RoPE positions as the unpadded one.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's view of the cache; the attention layer calls `update`."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    def update(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's [B, T, *] latents after the filled slots; return all [B, S, *]."""
        c = self.cache
        start, end = c.length, c.length + c_kv.shape[1]
        c.c_kv[self.layer][:, start:end] = c_kv
        c.k_pe[self.layer][:, start:end] = k_pe
        return c.c_kv[self.layer][:, :end], c.k_pe[self.layer][:, :end]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        capacity: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.c_kv = [
            torch.zeros(batch, capacity, kv_lora_rank, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.k_pe = [
            torch.zeros(batch, capacity, rope_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self._pending = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, capacity: int) -> KVCache:
        cfg = model.cfg
        p = model.embed.weight
        return cls(
            cfg.num_hidden_layers,
            batch,
            capacity,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)

    def _grow(self, needed: int) -> None:
        new = max(needed, 2 * self.capacity)

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(t.shape[0], new, *t.shape[2:])
            out[:, : t.shape[1]] = t
            return out

        self.c_kv = [pad(t) for t in self.c_kv]
        self.k_pe = [pad(t) for t in self.k_pe]
        self.valid = pad(self.valid)

    def begin(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start a forward over T new tokens with `valid` [B, T] (False = padding).

        Returns their positions [B, T] and the attention mask [B, 1, T, length + T]
        (True = may attend), or None when plain causal attention is exact."""
        B, T = valid.shape
        if B != self.batch:
            raise ValueError(f"cache holds {self.batch} sequences, got a batch of {B}")
        start, end = self.length, self.length + T
        if end > self.capacity:
            self._grow(end)
        self.valid[:, start:end] = valid
        positions = self.next_pos[:, None] + valid.long().cumsum(1) - 1
        positions = positions.clamp(min=0)
        self._pending = T
        keys = self.valid[:, :end]
        if bool(keys.all()) and (T == 1 or start == 0):
            return positions, None
        j = torch.arange(end, device=valid.device)
        i = torch.arange(start, end, device=valid.device)
        causal = j[None, :] <= i[:, None]
        # Padding queries attend to themselves only, so their (unused) rows stay finite.
        mask = (causal[None] & keys[:, None, :]) | (j[None, :] == i[:, None])[None]
        return positions, mask[:, None]

    def commit(self) -> None:
        """Advance past the tokens of the forward started by `begin`."""
        start = self.length
        self.length += self._pending
        self.next_pos += self.valid[:, start : self.length].sum(1)
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (e.g. to score another continuation of a prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.valid[:, length:] = False
        self.length = length
        self.next_pos = self.valid[:, :length].sum(1)

    def repeat(self, n: int) -> KVCache:
        """A new cache with each sequence repeated n times (batch b -> rows b*n .. b*n+n-1)."""
        out = KVCache.__new__(KVCache)
        out.c_kv = [t.repeat_interleave(n, 0) for t in self.c_kv]
        out.k_pe = [t.repeat_interleave(n, 0) for t in self.k_pe]
        out.valid = self.valid.repeat_interleave(n, 0)
        out.next_pos = self.next_pos.repeat_interleave(n, 0)
        out.length, out._pending = self.length, 0
        return out
