"""Context parallelism: the sequence split over cp ranks, attention over all-gathered K/V.

Load balance (head-tail): a causal sequence of length T is cut into 2 cp chunks of T/(2 cp);
rank i keeps chunks i and 2 cp - 1 - i. An early chunk has few keys to attend to and a late
one many, so every rank does the same attention work:

    T = 8, cp = 2:  chunks [0 1][2 3][4 5][6 7]  ->  rank 0: 0 1 6 7,  rank 1: 2 3 4 5

Each rank runs the model on its tokens with their true `positions` (RoPE and the causal
mask use them). Attention all-gathers what keys and values are made from (for MLA, the
small latent and the rotary key part) with their positions, and masks key j for query i
unless pos_k[j] <= pos_q[i]. The all-gather's backward is a reduce-scatter (sum), so each
rank gets the gradient of its own tokens from every rank's queries: gradients equal the
single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(out, inp, group):
    # torch 2.13 renamed it (the old name warns); looked up per call so tools can wrap it
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group)


def _reduce_scatter(out, inp, op, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group)


def load_balanced_positions(seq_len: int, cp: int) -> torch.Tensor:
    """[cp, seq_len / cp] positions each cp rank holds (head-tail split)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"rule 'sequence length divisible by 2 x cp': seq_len={seq_len} cannot be split "
            f"into {2 * cp} equal chunks for cp={cp}; pad the batch to a multiple of {2 * cp}"
        )
    chunks = torch.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return torch.cat([chunks[:cp], chunks[cp:].flip(0)], dim=1)


def split_sequence(
    x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of `x` along `dim`, and the positions it holds ([T / cp])."""
    positions = load_balanced_positions(x.shape[dim], cp)[cp_rank]
    return x.index_select(dim, positions.to(x.device)), positions


class _GatherSequence(torch.autograd.Function):
    """Concatenate every rank's tensor along `dim`; backward reduce-scatters (sums) grads."""

    @staticmethod
    def forward(ctx, x, dim: int, group):
        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((n * front.shape[0], *front.shape[1:]))
        _all_gather(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        front = grad.movedim(ctx.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
        _reduce_scatter(out, front, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Autograd-aware all-gather of the sequence dimension over the cp group (rank order)."""
    return _GatherSequence.apply(x, dim, group)


class KVGather:
    """The attention hook for CP: `kv_gather(c_kv, k_pe, mask)` -> the same over the sequence.

    The two tensors (for MLA the normalized latent [B, T, r] and the rotary key [B, T, d];
    any two [B, T, ...] tensors keys and values are made from) are all-gathered along the
    sequence, and the mask [1, 1, T_local, T] is built from the head-tail positions: query i
    may attend key j iff pos_k[j] <= pos_q[i]. Only unpadded (packed) sequences are split,
    so an incoming padding mask is an error.
    """

    def __init__(self, group, dim: int = 1) -> None:
        self.group, self.dim = group, dim
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None):
        if mask is not None:
            raise ValueError(
                "context parallelism splits unpadded sequences, but attention got a padding "
                "mask; pack the batch (no `valid`) or run with parallel.cp=1"
            )
        local = a.shape[self.dim]
        table = load_balanced_positions(local * self.cp, self.cp).to(a.device)
        mask = causal_mask(table[self.rank], table.flatten())[None, None]
        return (
            gather_sequence(a, self.group, self.dim),
            gather_sequence(b, self.group, self.dim),
            mask,
        )


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask [..., Tq, Tk], True where query i may attend key j (pos_k <= pos_q)."""
    return k_positions.unsqueeze(-2) <= q_positions.unsqueeze(-1)
