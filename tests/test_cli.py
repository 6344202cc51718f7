import subprocess
import sys


def _cadenza(*args):
    return subprocess.run(
        [sys.executable, "-m", "cadenza.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_on_every_command():
    import typer.main

    from cadenza.cli.main import app

    root = typer.main.get_command(app)
    paths = [[]]
    stack = [([], root)]
    while stack:
        prefix, cmd = stack.pop()
        for name, sub in getattr(cmd, "commands", {}).items():
            paths.append(prefix + [name])
            stack.append((prefix + [name], sub))
    for path in paths:
        r = _cadenza(*path, "--help")
        assert r.returncode == 0, (path, r.stderr)
        assert "Usage" in r.stdout


def test_config_show_reports_bad_override():
    r = _cadenza("config", "show", "train.steps=abc")
    assert r.returncode == 2
    assert "train.steps: expected an int" in r.stderr
