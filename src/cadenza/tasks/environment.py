"""One virtual environment per project: its test dependencies, never the project itself.

The project is importable only from the workspace (PYTHONPATH); the environment is cached
under <cache>/venvs keyed by project, version, Python and the packages installed.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from cadenza.tasks.errors import TaskError

PROBE_MODULE = "cadenza_probe"


@dataclass
class EnvSpec:
    """What an environment holds; `environment_setup` of each task instance."""

    project: str
    version: str
    python: str
    packages: list[str]

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        probe = (Path(__file__).parent / "pytest_probe.py").read_bytes()
        return hashlib.sha256(blob + probe).hexdigest()[:16]


def _pinned() -> dict[str, str]:
    """Versions pinned in cadenza's constraints.txt (so envs match the tested ones)."""
    path = Path(__file__).resolve().parents[3] / "constraints.txt"
    pins = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def _runtime_deps(root: Path) -> list[str]:
    """The project's declared runtime requirements (pyproject or setup.cfg), no extras."""
    deps: list[str] = []
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        try:
            deps += tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])
        except tomllib.TOMLDecodeError as e:
            raise TaskError(
                f"pyproject.toml does not parse ({e}); fix it or use another version"
            ) from e
    setup_cfg = root / "setup.cfg"
    if setup_cfg.exists():
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read_string(setup_cfg.read_text())
        except configparser.Error:
            pass
        else:
            raw = cp.get("options", "install_requires", fallback="")
            deps += [d.strip() for d in raw.splitlines() if d.strip()]
    return sorted(set(deps))


def spec_for(project: str, version: str, root: Path) -> EnvSpec:
    pins = _pinned()
    test = [f"{n}=={pins[n]}" if n in pins else n for n in ("pytest", "coverage")]
    return EnvSpec(
        project=project,
        version=version,
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        packages=test + _runtime_deps(root),
    )


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise TaskError(f"{venv}: not a virtual environment (no lib/python*/site-packages)")
    return found[0]


def ensure_venv(spec: EnvSpec, cache_dir: Path, timeout: float = 600) -> Path:
    """The cached environment for spec, created (atomically) when missing."""
    venvs = cache_dir / "venvs"
    venvs.mkdir(parents=True, exist_ok=True)
    dest = venvs / f"{spec.project}-{spec.version}-py{spec.python}-{spec.key()}"
    if (dest / ".cadenza-ready").exists():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=venvs))
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run(
            [base, "-m", "venv", "--without-pip", str(tmp)],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(tmp / "bin" / "python"),
                "install",
                "-q",
                *spec.packages,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if r.returncode != 0:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            raise TaskError(
                f"could not install the test environment for {spec.project} "
                f"({', '.join(spec.packages)}): {tail}"
            )
        shutil.copy(
            Path(__file__).parent / "pytest_probe.py", site_packages(tmp) / f"{PROBE_MODULE}.py"
        )
        (tmp / ".cadenza-ready").write_text(json.dumps(asdict(spec)))
        if dest.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(dest)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
