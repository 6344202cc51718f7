"""The code corpus: which source files, in which order.

`corpus_files("stdlib")` lists the Python standard library's own .py files found on this
machine (sysconfig's 'stdlib' path, without site-packages); `corpus_files(DIR)` lists a
directory's source files. The order is deterministic and machine independent: files are
sorted by a hash of their path relative to the root, which spreads any prefix of the list
across the whole library (sorted by name, the first megabytes would be mostly `asyncio/`
and the codec tables in `encodings/`).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

SOURCE_SUFFIXES = (".py",)
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git", ".venv", "venv"})
MAX_FILE_BYTES = 256_000  # generated tables (pydoc topics, unicode data) are not code


class CorpusError(ValueError):
    """A corpus that cannot be used; the message says what was expected and what to do."""


def corpus_root(corpus: str) -> Path:
    """The directory a corpus name stands for: "stdlib" or a path."""
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    root = Path(corpus).expanduser()
    if not root.is_dir():
        raise CorpusError(
            f"corpus {corpus!r}: expected 'stdlib' or a directory of .py files, "
            "but no such directory exists"
        )
    return root


def _order_key(rel: str) -> str:
    return hashlib.sha1(rel.encode("utf-8")).hexdigest()


def corpus_files(
    corpus: str = "stdlib",
    max_files: int | None = None,
    max_bytes: int | None = None,
    suffixes: tuple[str, ...] = SOURCE_SUFFIXES,
) -> list[Path]:
    """Source files of `corpus` in deterministic hashed order, capped by count and bytes."""
    root = corpus_root(corpus)
    found: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if not name.endswith(suffixes):
                continue
            p = Path(dirpath, name)
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if size == 0 or size > MAX_FILE_BYTES:
                continue
            found.append((_order_key(p.relative_to(root).as_posix()), p, size))
    if not found:
        raise CorpusError(
            f"corpus {corpus!r}: no {'/'.join(suffixes)} files found under {root}; "
            "point data.corpus at a directory of source files"
        )
    found.sort()
    out: list[Path] = []
    total = 0
    for _, p, size in found:
        if max_files is not None and len(out) >= max_files:
            break
        if max_bytes is not None and out and total + size > max_bytes:
            break
        out.append(p)
        total += size
    return out
