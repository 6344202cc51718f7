"""`cadenza bench muon`: Newton-Schulz throughput and Muon step time, against baselines.

1. NS throughput on one step's worth of natural units (one batched call per unit shape) of
   the `tiny` model and of a K2 miniature (K2's head dims and kv_lora_rank, hidden and
   expert widths / 4, 8 heads, 4 experts, one MoE layer), in bf16 GFLOP/s from
   4 m^2 n + 2 m^3 per iteration, as a fraction of this machine's bf16 matmul throughput
   measured in the same run (goal >= 0.7 on the K2 miniature).
2. Full optimizer step time of cadenza's Muon against torch.optim.Muon on the same plain 2-D
   parameters (the model's matrices, each expert as its own matrix), same settings
   (goal <= 0.5, from batching same-shape matrices into one call).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections import Counter

import torch

from cadenza.bench._util import median_time
from cadenza.config.model import ModelConfig, k2_model, tiny_model
from cadenza.model import CausalLM
from cadenza.model.units import param_units
from cadenza.optim.muon import Muon
from cadenza.optim.newton_schulz import newton_schulz_, ns_flops


def k2_miniature() -> ModelConfig:
    k2 = k2_model()
    return dataclasses.replace(
        k2,
        vocab_size=1024,
        hidden_size=k2.hidden_size // 4,
        intermediate_size=k2.intermediate_size // 4,
        moe_intermediate_size=k2.moe_intermediate_size // 4,
        q_lora_rank=k2.q_lora_rank // 4,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=8,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
    )


SETS = {"tiny": tiny_model, "k2-mini": k2_miniature}


def _meta_model(cfg: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(cfg)


def unit_shape_counts(cfg: ModelConfig) -> Counter[tuple[int, int]]:
    """How many Muon units of each (short, long) shape one step orthogonalizes."""
    counts: Counter[tuple[int, int]] = Counter()
    for _, p, units in param_units(_meta_model(cfg)):
        for r, c in units.unit_shapes(p.shape):
            counts[(min(r, c), max(r, c))] += 1
    return counts


def matrices_2d(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The model's Muon matrices as plain 2-D shapes (an [E, out, in] stack gives E matrices)."""
    shapes = []
    for _, p, units in param_units(_meta_model(cfg)):
        if units.kind == "adamw":
            continue
        shapes += [tuple(p.shape[1:])] * p.shape[0] if p.ndim == 3 else [tuple(p.shape)]
    return shapes


def matmul_gflops(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    return 2 * n**3 / median_time(lambda: a @ b, repeats=repeats) / 1e9


def ns_gflops(counts: Counter[tuple[int, int]], steps: int, repeats: int) -> tuple[float, float]:
    """(GFLOP/s, seconds) of one batched NS call per unit shape, bf16."""
    stacks = [torch.randn(k, m, n).bfloat16() for (m, n), k in counts.items()]
    flops = sum(k * ns_flops(m, n, steps) for (m, n), k in counts.items())

    def run() -> None:
        for s in stacks:
            newton_schulz_(s.clone(), steps)

    t = median_time(run, repeats=repeats)
    return flops / t / 1e9, t


def step_times(shapes: list[tuple[int, int]], repeats: int) -> tuple[float, float]:
    """Median step seconds of (cadenza Muon, torch.optim.Muon) on the same 2-D parameters."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]
    out = []
    for cls in (Muon, torch.optim.Muon):
        params = [p.clone().requires_grad_() for p in init]
        for p, g in zip(params, grads):
            p.grad = g
        opt = cls(params, lr=0.02, weight_decay=0.1)
        out.append(median_time(opt.step, repeats=repeats))
    return out[0], out[1]


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="cadenza bench muon", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ns-steps", type=int, default=5)
    ap.add_argument("--matmul-n", type=int, default=2048, help="size of the peak bf16 matmul")
    ap.add_argument("--sets", default="tiny,k2-mini", help=f"comma list of {sorted(SETS)}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    load = os.getloadavg()[0]
    # Other processes on the cores distort every figure (multi-threaded kernels most): say so.
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    peak = matmul_gflops(args.matmul_n, args.repeats)
    print(f"bf16 matmul {args.matmul_n}^3 ({args.threads} threads): {peak:.1f} GFLOP/s (baseline)")
    result: dict = {
        "threads": args.threads,
        "load_average": load,
        "matmul_gflops": peak,
        "sets": {},
    }
    for name in args.sets.split(","):
        if name not in SETS:
            raise SystemExit(f"unknown set {name!r}; expected some of {sorted(SETS)}")
        cfg = SETS[name]()
        counts = unit_shape_counts(cfg)
        gflops, ns_s = ns_gflops(counts, args.ns_steps, args.repeats)
        ours, theirs = step_times(matrices_2d(cfg), args.repeats)
        units = sum(counts.values())
        print(
            f"[{name}] NS on {units} units in {len(counts)} shape buckets: {gflops:.1f} GFLOP/s "
            f"= {gflops / peak:.2f} of matmul peak ({ns_s * 1e3:.1f} ms/step)"
        )
        print(
            f"[{name}] Muon step on {len(matrices_2d(cfg))} 2-D matrices: cadenza {ours * 1e3:.1f} ms "
            f"vs torch.optim.Muon {theirs * 1e3:.1f} ms = {ours / theirs:.2f}x"
        )
        result["sets"][name] = {
            "units": units,
            "shape_buckets": len(counts),
            "ns_gflops": gflops,
            "ns_fraction_of_matmul": gflops / peak,
            "step_s": ours,
            "torch_muon_step_s": theirs,
            "step_ratio_vs_torch": ours / theirs,
        }
    return result
