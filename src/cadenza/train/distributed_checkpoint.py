"""Training checkpoints of a distributed run: DCP shards plus the trainer's state.

Same place and name as the single-process checkpoints (``<out_dir>/checkpoints/step_N/``),
another content::

    step_00000100/
        dcp/                              model + optimizer shards (cadenza.parallel.checkpoint)
        tokenizer.json, tokenizer_config.json
        trainer_state.pt                  RNG, step, data position, config, optimizer counters
        trainer_state.json                the same scalars, human readable
        config.json, model.safetensors    the last step of a run only: the whole model,
                                          gathered on rank 0, in the format transformers loads

Every rank writes its own shards; rank 0 writes the rest into a hidden temporary directory
and renames it into place once all ranks are done, so a kill leaves the complete checkpoint
or none. DCP stores tensors with their global shapes, so a run resumes on another world size
or layout (e.g. saved on 4 ranks with shard=2 x cp=2, ep=4, resumed on 2 with ep=2).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadenza.model import CheckpointError, save_pretrained
from cadenza.model.tokenizer import Tokenizer
from cadenza.parallel import checkpoint as dcp_checkpoint
from cadenza.train.checkpoint import (
    CHECKPOINTS,
    FORMAT_VERSION,
    STATE_FILE,
    _what_to_do,
    checkpoint_dir,
    list_checkpoints,
    read_state_and_tokenizer,
)

DCP_DIR = "dcp"
STATE_KEYS = ("format", "step", "data_position", "optimizer_counters", "rng", "model_config")


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _scalars(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool)) or v is None}


def save_distributed_checkpoint(
    job,
    out_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer,
    tokenizer: Tokenizer,
    state: dict[str, Any],
    keep: int = 0,
    hf_model: nn.Module | None = None,
) -> Path:
    """Write the checkpoint for `step` (collective: every rank calls it).

    `optimizer` is cadenza's ModelOptimizer (its Muon and AdamW go through DCP, its step
    counters into the trainer state); `hf_model` (rank 0 only) is also saved whole.
    """
    root = Path(out_dir) / CHECKPOINTS
    final = checkpoint_dir(out_dir, step)
    tmp = root / f".tmp-{final.name}-dist"  # the same name on every rank
    if job.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    job.barrier()
    dcp_checkpoint.save(tmp / DCP_DIR, model, optimizer.optimizers, extra={"step": step})
    if job.is_main:
        try:
            tokenizer.save(tmp)
            full = {"format": FORMAT_VERSION, "step": step, **state}
            torch.save(full, tmp / STATE_FILE)
            (tmp / "trainer_state.json").write_text(json.dumps(_scalars(full), indent=2) + "\n")
            if hf_model is not None:
                save_pretrained(hf_model, tmp)
            if final.exists():  # re-saving a step (e.g. after resuming): swap, then drop the old
                old = root / f".tmp-old-{final.name}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if keep > 0:
            for _, old_path in list_checkpoints(out_dir)[:-keep]:
                shutil.rmtree(old_path, ignore_errors=True)
    job.barrier()
    return final


def read_distributed_checkpoint(path: str | os.PathLike) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, trainer state) of a distributed checkpoint, each checked."""
    p = Path(path)
    missing = [f for f in ("tokenizer.json", STATE_FILE) if not (p / f).is_file()]
    if not (p / DCP_DIR / ".metadata").is_file():
        missing.append(f"{DCP_DIR}/.metadata")
    if missing:
        raise CheckpointError(
            f"checkpoint {p} is incomplete: missing {', '.join(missing)}; {_what_to_do(p)}"
        )
    return read_state_and_tokenizer(p, STATE_KEYS, "the trainer state of a distributed cadenza run")


def load_distributed_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer, state: dict[str, Any]
) -> None:
    """Load the shards this rank's layout needs into `model` and `optimizer` (collective)."""
    p = Path(path)
    try:
        dcp_checkpoint.load(p / DCP_DIR, model, optimizer.optimizers)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {p}: the model and optimizer shards cannot be loaded "
            f"({type(e).__name__}: {e}); resume with the same model and optim settings, or "
            f"{_what_to_do(p)}"
        ) from e
    counters = state["optimizer_counters"]
    optimizer.restore_counters(counters["steps"], counters.get("skipped_steps", 0))
