"""Cross-entropy over the output head without keeping the logits (fused linear + CE).

For rows h_i with targets y_i (those equal to ignore_index skipped), n counted rows:

    L = (1/n) sum_i [logsumexp(W h_i) - (W h_i)_{y_i}]
    dL/dz_i = (softmax(z_i) - onehot(y_i)) / n,   dL/dh_i = W^T dL/dz_i,   dL/dW = sum_i dL/dz_i h_i^T

The forward pass computes these gradients chunk by chunk (z_i never exists for all rows at
once, and no separate log-softmax backward pass runs); backward only scales them.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk_rows: int):
        valid = targets != ignore_index
        n = valid.sum().clamp(min=1)
        safe = torch.where(valid, targets, 0)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            h, y, v = hidden[sl], safe[sl], valid[sl]
            z = (h @ weight.T).float()
            lse = z.logsumexp(-1)
            total += ((lse - z.gather(-1, y[:, None])[:, 0]) * v).sum()
            if not (want_h or want_w):
                continue
            p = z.sub_(lse[:, None]).exp_()  # softmax, in place
            p[torch.arange(p.shape[0], device=p.device), y] -= 1.0
            p *= (v.float() / n)[:, None]
            p = p.to(hidden.dtype)
            if want_h:
                grad_h[sl] = p @ weight
            if want_w:
                grad_w += (p.T @ h).float()
        ctx.save_for_backward(
            grad_h if want_h else None, grad_w.to(weight.dtype) if want_w else None
        )
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out if grad_h is not None else None,
            grad_w * grad_out if grad_w is not None else None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_bytes: int = 2**26,
) -> torch.Tensor:
    """Mean cross-entropy of logits hidden @ weight.T [N, V] against targets [N] (ignoring
    `ignore_index`), equal to F.cross_entropy on the full logits, with fp32 softmax."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {targets.shape[0]} targets")
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_rows)
