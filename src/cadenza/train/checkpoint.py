"""Training checkpoints: a Hugging Face model directory plus the trainer's state.

Layout, one directory per saved step under ``<out_dir>/checkpoints/``::

    step_00000100/
        config.json, model.safetensors     cadenza.model.save_pretrained (transformers loads it)
        tokenizer.json, tokenizer_config.json
        trainer_state.pt                   optimizer, RNG, step, data position, config
        trainer_state.json                 the same scalars, human readable

A checkpoint is written into a hidden temporary directory and renamed into place, so a
kill at any moment leaves either the complete checkpoint or none (a leftover temporary
directory is ignored and cleaned up by the next save).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadenza.model import CheckpointError, from_pretrained, save_pretrained
from cadenza.model.tokenizer import Tokenizer, TokenizerError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})$")
REQUIRED_FILES = ("config.json", "tokenizer.json", STATE_FILE)
STATE_KEYS = ("format", "step", "data_position", "optimizer", "rng", "model_config")


def checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"step_{step:08d}"


def list_checkpoints(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete-looking checkpoint directory, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]


def save_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    tokenizer: Tokenizer,
    state: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Write the checkpoint for `step` atomically; keep only the newest `keep` (0: all)."""
    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = checkpoint_dir(out_dir, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        save_pretrained(model, tmp)
        tokenizer.save(tmp)
        torch.save({"format": FORMAT_VERSION, "step": step, **state}, tmp / STATE_FILE)
        scalars = {
            k: v
            for k, v in {"step": step, **state}.items()
            if isinstance(v, (int, float, str, bool)) or v is None
        }
        (tmp / "trainer_state.json").write_text(json.dumps(scalars, indent=2) + "\n")
        if final.exists():  # re-saving a step (e.g. after resuming): swap, then drop the old
            old = root / f".tmp-old-{final.name}-{os.getpid()}"
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
    return final


def _what_to_do(path: Path) -> str:
    return (
        f"delete {path} to resume from the checkpoint before it, or start a fresh run "
        "without --resume (in an empty train.out_dir)"
    )


def read_state_and_tokenizer(
    p: Path, keys: tuple[str, ...], expected: str
) -> tuple[Tokenizer, dict[str, Any]]:
    """The checked trainer state (with `keys`, in this cadenza's format) and tokenizer of a
    checkpoint directory; `expected` names the kind of state in errors."""
    try:
        state = torch.load(p / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {p}: {STATE_FILE} cannot be read ({type(e).__name__}: {e}); "
            f"{_what_to_do(p)}"
        ) from e
    absent = [k for k in keys if not isinstance(state, dict) or k not in state]
    if absent:
        raise CheckpointError(
            f"checkpoint {p}: {STATE_FILE} lacks {absent} (expected {expected}, "
            f"format {FORMAT_VERSION}); {_what_to_do(p)}"
        )
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {p}: trainer state format {state['format']}, this cadenza reads "
            f"format {FORMAT_VERSION}; start a fresh run"
        )
    try:
        tokenizer = Tokenizer.from_file(p / "tokenizer.json")
    except TokenizerError as e:
        raise CheckpointError(f"checkpoint {p}: {e}; {_what_to_do(p)}") from e
    return tokenizer, state


def load_checkpoint(path: str | os.PathLike) -> tuple[nn.Module, Tokenizer, dict[str, Any]]:
    """(model, tokenizer, trainer state) of a checkpoint directory, each checked."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist; {_what_to_do(p)}")
    missing = [f for f in REQUIRED_FILES if not (p / f).is_file()]
    if not any(p.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise CheckpointError(
            f"checkpoint {p} is incomplete: missing {', '.join(missing)}; {_what_to_do(p)}"
        )
    tokenizer, state = read_state_and_tokenizer(p, STATE_KEYS, "a cadenza trainer state")
    try:
        model = from_pretrained(p)
    except Exception as e:  # CheckpointError from hf_io, or safetensors' own errors
        raise CheckpointError(
            f"checkpoint {p}: the model cannot be loaded ({type(e).__name__}: {e}); "
            f"{_what_to_do(p)}"
        ) from e
    return model, tokenizer, state
