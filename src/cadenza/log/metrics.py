"""Metrics as JSON Lines: one object per line, one line per logged step, flushed at once.

A run that is killed loses at most the line being written; a resumed run first cuts the
file back to the checkpoint's step (`truncate_after`) so each step appears once.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from cadenza.log.tensorboard import ScalarWriter


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors and numpy scalars
        return _clean(value.item())
    return value


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (a torn last line is ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsWriter:
    """Append-only JSONL metrics file, mirrored as TensorBoard scalars (numeric fields, at
    the record's `step`) in `tensorboard_dir` (default: `tensorboard/` beside the file;
    None disables)."""

    def __init__(
        self, path: str | os.PathLike, tensorboard_dir: str | os.PathLike | None | bool = True
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard_dir is True:
            tensorboard_dir = self.path.parent / "tensorboard"
        self._tb = ScalarWriter(tensorboard_dir) if tensorboard_dir else None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _clean(v) for k, v in record.items()}
        line = json.dumps(clean, separators=(",", ":"))
        self._f.write(line + "\n")
        self._f.flush()
        if self._tb is not None and isinstance(clean.get("step"), int):
            scalars = {
                k: float(v)
                for k, v in clean.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self._tb.write(clean["step"], scalars)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def truncate_after(path: str | os.PathLike, step: int, key: str = "step") -> int:
    """Keep only records with record[key] <= step (rewritten atomically); returns how many."""
    p = Path(path)
    if not p.exists():
        return 0
    kept = [r for r in read_jsonl(p) if r.get(key, -1) <= step]
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
    os.replace(tmp, p)
    return len(kept)
