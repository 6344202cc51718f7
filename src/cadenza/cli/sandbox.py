"""`cadenza sandbox`: run one command the way agent tools and graders run it; check isolation."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(help="Isolated command execution (bubblewrap + limits).", no_args_is_help=True)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_cmd(
    cmd: list[str] = typer.Argument(..., help="The command and its arguments, after `--`."),
    workspace: Path = typer.Option(..., "--workspace", "-w", help="The only writable directory."),
    timeout: float = typer.Option(60.0, help="Wall-clock seconds; exit status 124 when exceeded."),
    memory_mb: int | None = typer.Option(None, help="Address-space limit per process, MiB."),
    ro_bind: list[Path] = typer.Option(
        [], "--ro-bind", help="Extra read-only path (e.g. a venv); repeatable."
    ),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for the command; repeatable."),
    cwd: Path | None = typer.Option(None, help="Working directory (default: the workspace)."),
    stdin: bool = typer.Option(False, "--stdin", help="Forward this process's stdin."),
    unsafe: bool = typer.Option(
        False, "--unsafe", help="Run WITHOUT isolation (only limits and timeout apply)."
    ),
) -> None:
    """Run CMD in a sandbox over --workspace; exits with its status (124 on timeout)."""
    from cadenza.sandbox import SandboxError, run

    pairs = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            typer.echo(f"error: --env {item!r}: expected KEY=VALUE", err=True)
            raise typer.Exit(2)
        pairs[key] = value
    data = sys.stdin.buffer.read() if stdin else None
    try:
        r = run(
            cmd,
            workspace,
            timeout=timeout,
            memory_mb=memory_mb,
            env=pairs,
            ro_binds=ro_bind,
            cwd=cwd,
            unsafe=unsafe,
            stdin=data,
        )
    except SandboxError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    sys.stdout.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.write(r.stderr)
    if r.truncated:
        sys.stderr.write("cadenza sandbox: output truncated (over the per-stream cap)\n")
    if r.timed_out:
        sys.stderr.write(f"cadenza sandbox: timed out after {timeout:g} s\n")
    elif r.killed_by:
        sys.stderr.write(f"cadenza sandbox: killed by {r.killed_by}\n")
    sys.stderr.flush()
    raise typer.Exit(r.returncode)


@app.command("check")
def check_cmd() -> None:
    """Say what this machine's sandbox isolates, and what it does not."""
    from cadenza.sandbox import isolation

    iso = isolation()
    typer.echo(f"bwrap:        {iso.bwrap or 'not installed'}")
    typer.echo(f"namespaces:   {', '.join(iso.namespaces) or 'none'}")
    typer.echo(f"missing:      {', '.join(iso.missing) or 'none'}")
    typer.echo(f"tmpfs sizes:  {'capped' if iso.tmpfs_size else 'not capped'}")
    typer.echo(f"seccomp:      {'filter loaded' if iso.seccomp else 'none'}")
    typer.echo(f"cgroups:      {', '.join(iso.cgroups) or 'none'}")
    for note in iso.notes:
        typer.echo(f"NOT ISOLATED: {note}")
    typer.echo("usable:       " + ("yes" if iso.available else "no (only with --unsafe)"))
    raise typer.Exit(0 if iso.available else 1)
