"""DCP: a checkpoint saved on 8 ranks restores identical parameters and AdamW state, both in
the same layout (round trip) and on 4 ranks in another layout (reshard).

Oracle: the full (unsharded) tensors gathered right before saving.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from test_parallel_layouts import _batch, tiny_cadenza_model

SAVE_LAYOUT = dict(shard=4, cp=2, ep=8, expert_shard=1)
LOAD_LAYOUT = dict(replicate=2, shard=2, expert_shard=2, ep=2)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model, optim) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _full(p.detach()).clone()
        for k, v in optim.state.get(p, {}).items():
            out[f"optim/{name}/{k}"] = _full(v).clone()
    return out


def _build(layout, seed, factory):
    from cadenza.config.parallel import ParallelConfig
    from cadenza.parallel import init_distributed, parallelize

    torch.manual_seed(seed)
    cfg = ParallelConfig(**layout)
    meshes = init_distributed(cfg, n_routed_experts=8)
    model = parallelize(factory(), cfg, meshes)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim, meshes


def _train_step(model, optim, meshes):
    from cadenza.parallel import global_token_count, shard_batch

    ids, labels = _batch()
    ids, labels, pos = shard_batch(ids, labels, meshes)
    logits = model(ids, positions=pos)
    n = global_token_count(labels.numel())
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
    loss.backward()
    optim.step()
    optim.zero_grad()


def _diff(a: dict, b: dict) -> dict[str, float]:
    assert a.keys() == b.keys(), f"state keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}


def _save_and_round_trip(rank, ws, path):
    from cadenza.parallel import checkpoint

    model, optim, meshes = _build(SAVE_LAYOUT, 0, tiny_cadenza_model)
    for _ in range(2):
        _train_step(model, optim, meshes)
    saved = _snapshot(model, optim)
    checkpoint.save(path, model, optim, extra={"step": 2})
    fresh, fresh_optim, _ = _build(SAVE_LAYOUT, 1, tiny_cadenza_model)
    meta = checkpoint.load(path, fresh, fresh_optim)
    assert meta == {"step": 2}
    return saved if rank == 0 else None, max(_diff(saved, _snapshot(fresh, fresh_optim)).values())


def _reshard_load(rank, ws, path, saved):
    from cadenza.parallel import checkpoint

    model, optim, meshes = _build(LOAD_LAYOUT, 1, tiny_cadenza_model)
    checkpoint.load(path, model, optim)
    errs = _diff(saved, _snapshot(model, optim))
    _train_step(model, optim, meshes)  # the restored state is usable for training
    return max(errs.values())


@pytest.mark.distributed
@pytest.mark.slow
def test_dcp_round_trip_and_reshard_8_to_4(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_save_and_round_trip, 8, path, timeout=240)
    saved = results[0][0]
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in saved)
    assert all(err == 0.0 for _, err in results), [err for _, err in results]
    errs = run_distributed(_reshard_load, 4, path, saved, timeout=240)
    assert all(err == 0.0 for err in errs), errs


def test_load_rejects_a_directory_that_is_not_a_checkpoint(tmp_path):
    from cadenza.parallel import checkpoint

    with pytest.raises(FileNotFoundError, match="not a cadenza distributed checkpoint"):
        checkpoint.load(tmp_path, tiny_cadenza_model())
