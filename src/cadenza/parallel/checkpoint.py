"""Distributed checkpoints with torch.distributed.checkpoint: save, resume, reshard.

Model and optimizer state are taken as DTensor-sharded state dicts keyed by the model's
parameter names (`get_state_dict`), so every tensor is stored once with its global shape
and each rank writes only its shards. Loading reads whatever slices the *current* layout
needs, so a checkpoint saved on 8 ranks (say dense shard=4 x cp=2, experts ep=8) loads on 4
ranks with another layout, or on one process.

Saving is all-or-nothing: ranks write into `<dir>.tmp-<step>`, and rank 0 renames it to
`<dir>` after every rank has finished (the previous checkpoint, if any, is replaced only
then). DCP's file format needs numpy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

META = "cadenza_meta.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write model (+ optimizer) state to directory `path`; collective on all ranks.

    `extra` is small JSON metadata (step, layout, ...) written by rank 0.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer or [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / META).write_text(json.dumps(extra or {}, indent=2, default=str) + "\n")
    _barrier()
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` into `model` (+ `optimizer`) in the current layout.

    Returns the `extra` metadata. Missing or unexpected tensors are an error naming them.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path}: not a cadenza distributed checkpoint (no .metadata file); expected a "
            "directory written by cadenza.parallel.checkpoint.save"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer or [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    _check_keys(path, state)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer or [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=StateDictOptions(strict=True),
    )
    meta = path / META
    return json.loads(meta.read_text()) if meta.is_file() else {}


def _check_keys(path: Path, state: dict[str, Any]) -> None:
    """Compare the model tensors the job needs with those the checkpoint holds."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    stored_model = {k[len("model.") :] for k in stored if k.startswith("model.")}
    wanted = set(state["model"])
    missing = sorted(wanted - stored_model)
    unexpected = sorted(stored_model - wanted)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"is missing {len(missing)} tensors, e.g. {missing[0]}")
        if unexpected:
            parts.append(f"has {len(unexpected)} tensors the model lacks, e.g. {unexpected[0]}")
        raise ValueError(
            f"checkpoint {path} "
            + " and ".join(parts)
            + "; was it saved from another model config?"
        )
