"""`torchrun --nproc-per-node N -m cadenza.parallel [--config tiny] [parallel.cp=2 ...]`

A launch self-check: joins torchrun's process group (gloo on CPU), builds both meshes from
`parallel.*`, runs one training step of the configured model on a random batch, and compares
the loss and every gradient with the same step on one process (computed on every rank, so
it is only for small models). Rank 0 prints the rank groups and the result; the exit status
is 0 when everything matches to `--tol`, 1 otherwise, 2 on a bad layout.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from cadenza.config import ConfigError, load_config
from cadenza.parallel.mesh import LayoutError
from cadenza.parallel.parallelize import (
    init_distributed,
    parallel_lm_loss,
    parallelize,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cadenza.parallel", description=__doc__.split("\n")[0]
    )
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. parallel.cp=2 parallel.ep=8")
    ap.add_argument("--config", default="tiny", help="preset or YAML file")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument(
        "--fail-on-rank",
        type=int,
        default=None,
        help="drill: this rank raises before the step while the others wait in collectives; "
        "the launcher must end them all with that error",
    )
    args = ap.parse_args(argv)
    # gathering strided expert shards for the comparison warns that it takes two steps
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        cfg = load_config(args.config, args.overrides)
        cfg.parallel.print_groups = True
        meshes = init_distributed(cfg.parallel, n_routed_experts=cfg.model.n_routed_experts)
    except (ConfigError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cadenza.model import CausalLM

    torch.manual_seed(cfg.train.seed)
    base = CausalLM(cfg.model)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    ids, labels = seq[:, :-1], seq[:, 1:]

    ref = copy.deepcopy(base)
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
    ref_loss.backward()

    model = parallelize(base, cfg.parallel, meshes)
    if dist.is_initialized() and dist.get_rank() == args.fail_on_rank:
        raise RuntimeError(f"failure drill on rank {args.fail_on_rank} (--fail-on-rank)")
    loss = parallel_lm_loss(model, ids, labels, meshes)
    loss.backward()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    worst, worst_name = abs(total.item() - ref_loss.item()), "loss"
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        err = (grad - ref_grads[name].grad).abs().max().item()
        if err > worst:
            worst, worst_name = err, name
    ok = worst <= args.tol
    if not dist.is_initialized() or dist.get_rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(
            f"{world} ranks ({dist.get_backend() if dist.is_initialized() else 'one process'}): "
            f"loss {total.item():.6f} vs one process {ref_loss.item():.6f}; largest error "
            f"{worst:.2e} ({worst_name}) -> {'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
