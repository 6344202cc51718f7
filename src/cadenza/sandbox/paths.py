"""Host-side access to a workspace that sandboxed code has written: no symlink escapes.

Inside the sandbox a symlink to /etc/shadow dangles; on the HOST, where agent tools and
graders read and write workspace files with the runner's privileges, it does not. Every
host-side path into a workspace should go through `inside()`, which resolves symlinks
and refuses anything that lands outside. There is no race with the sandboxed code: a run
returns only once every process it started is gone.
"""

from __future__ import annotations

import os
from pathlib import Path


class PathEscape(ValueError):
    """A workspace path that resolves outside the workspace."""


def inside(workspace: Path | str, path: Path | str) -> Path:
    """`path` (relative to `workspace`, or absolute) resolved, if it stays in `workspace`.

    Symlinks are followed the way the host would follow them, so a link (or a link in a
    parent directory) pointing out of the workspace raises PathEscape. The path need not
    exist (for writes); its existing part is what gets resolved.
    """
    root = Path(os.path.realpath(workspace))
    p = Path(path)
    target = Path(os.path.realpath(p if p.is_absolute() else root / p))
    if target != root and root not in target.parents:
        raise PathEscape(
            f"{path}: resolves to {target}, outside the workspace {root}; expected a path "
            "inside it (symlinks pointing out of the workspace are refused)"
        )
    return target
