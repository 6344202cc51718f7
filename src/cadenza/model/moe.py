"""DeepSeek-V3 mixture of experts: sigmoid router with group-limited top-k, stacked routed
experts computed with grouped matmuls, shared experts, aux-loss-free load balancing.

Routing for token x (E experts in G groups, k experts per token, g groups kept):

    s = sigmoid(W_r x)                        affinities, fp32
    c = s + b                                 b = e_score_correction_bias (selection only)
    group score = sum of the top-2 c in the group; keep the g best groups
    top-k experts by c among the kept groups; weights w_i = s_i (/ sum_j s_j if norm_topk_prob)
    y = shared(x) + routed_scaling_factor * sum_i w_i * expert_i(x)

Balancing (DeepSeek-V3, "auxiliary-loss-free"): count tokens per expert during training, then
b_e += speed * sign(mean load - load_e), so underloaded experts become more attractive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.config.model import ModelConfig
from cadenza.model.mlp import MLP
from cadenza.model.units import ADAMW, EXPERTS, Units


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (fp32) -> (weights [N, k] fp32, expert indices [N, k])."""
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(N, E)
    idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, idx


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        # fp32 whatever the model dtype: routing decisions are sensitive to rounding.
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return route(
            logits,
            self.e_score_correction_bias.float(),
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scaling,
        )

    def param_units(self) -> dict[str, Units]:
        return {"weight": ADAMW}


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The kernel needs 16-byte aligned row strides for x, w and the output.
    align = 16 // x.element_size()
    if w.shape[1] % align or w.shape[2] % align:
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, in] sorted by group, `counts` [E] rows per group: row r of group e maps to
    x[r] @ w[e].T with w [E, out, in]. One grouped matmul, no loop over groups."""
    E = w.shape[0]
    if x.shape[0] <= E and not torch.is_grad_enabled():
        # Decoding: fewer rows than experts. The CPU grouped kernel runs one matmul per
        # group; gathering each row's expert weights and one batched matmul is cheaper.
        group = torch.repeat_interleave(
            torch.arange(E, device=x.device), counts, output_size=x.shape[0]
        )
        return torch.bmm(w[group], x[:, :, None])[:, :, 0]
    if _use_grouped_mm(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    # Fallback: scatter into a [E, max_count, in] batch padded with zeros, one bmm.
    group = torch.repeat_interleave(
        torch.arange(E, device=x.device), counts, output_size=x.shape[0]
    )
    starts = counts.cumsum(0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[group]
    padded = x.new_zeros(E, int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded = padded.index_put((group, slot), x)
    return torch.bmm(padded, w.transpose(-2, -1))[group, slot]


class Experts(nn.Module):
    """Routed experts stacked as w_gate, w_up [E, I, H] and w_down [E, H, I].

    forward takes tokens already sorted by expert and the count per expert, so an expert-
    parallel wrapper can exchange tokens around this module without changing it.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_linear(x, self.w_gate, counts)) * grouped_linear(x, self.w_up, counts)
        return grouped_linear(h, self.w_down, counts)

    def param_units(self) -> dict[str, Units]:
        return {"w_gate": EXPERTS, "w_up": EXPERTS, "w_down": EXPERTS}


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.bias_update_speed = cfg.bias_update_speed
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )
        # Tokens routed to each expert since the last bias update (training forwards only).
        self.tokens_per_expert = nn.Buffer(torch.zeros(cfg.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.router(x)
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        # Dispatch: sort the N*k (token, expert) pairs by expert; combine: undo the sort and
        # sum each token's k outputs weighted by its routing weights.
        order = flat.argsort(stable=True)
        routed = self.experts(x[order // self.top_k], counts)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        routed = routed[unsort].view(-1, self.top_k, shape[-1])
        y = torch.bmm(weights.unsqueeze(1).to(routed.dtype), routed).squeeze(1)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    @torch.no_grad()
    def update_router_bias(self, speed: float | None = None) -> None:
        """b += speed * sign(mean load - load) from the counted tokens, then reset the counts.

        Under data parallelism, sum `tokens_per_expert` over ranks before calling this."""
        load = self.tokens_per_expert
        if load.sum() == 0:
            return
        speed = self.bias_update_speed if speed is None else speed
        bias = self.router.e_score_correction_bias
        bias += (speed * torch.sign(load.mean() - load)).to(bias.dtype)
        load.zero_()
