"""`cadenza tasks build | export | grade`: feature-removal tasks from real codebases."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Build, export and grade feature-removal tasks.", no_args_is_help=True)


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2) from e


@app.command("build")
def build_cmd(
    source: str = typer.Argument(..., help="A project directory or pypi:NAME[==VERSION]."),
    out: Path = typer.Option(..., "--out", help="New directory for tasks.jsonl and workspaces."),
    max_tasks: int = typer.Option(10, "--max-tasks", help="Stop after this many valid tasks."),
    workers: int = typer.Option(1, "--workers", help="Validation processes (at most 2 here)."),
    difficulty: str = typer.Option("any", "--difficulty", help="easy, medium, hard or any."),
    max_candidates: int = typer.Option(
        0, "--max-candidates", help="Candidates to try; 0 = 4 x max-tasks."
    ),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds per test-suite run."),
    no_signature: bool = typer.Option(
        False, "--no-signature", help="Leave the signature out of problem statements."
    ),
    sandbox: bool = typer.Option(
        False, "--sandbox", help="Run the build's test runs in the sandbox too (slower)."
    ),
    exclude_failing: bool = typer.Option(
        False,
        "--exclude-failing",
        help="Leave out tests that fail in the original suite instead of refusing.",
    ),
    remover: str = typer.Option(
        "ast", "--remover", help="ast (exact spans) or agent (a chat model with tools)."
    ),
    endpoint: str = typer.Option(
        "", "--endpoint", help="OpenAI-compatible server for --remover agent, e.g. URL/v1."
    ),
    model: str = typer.Option("", "--model", help="Model name for --remover agent."),
    max_turns: int = typer.Option(40, "--max-turns", help="Model calls per candidate (agent)."),
    api_key_env: str = typer.Option(
        "OPENAI_API_KEY", "--api-key-env", help="Environment variable holding the API key."
    ),
) -> None:
    """Build validated, leak-free tasks from SOURCE into OUT/tasks.jsonl."""
    from cadenza.tasks.build import BuildOptions, build
    from cadenza.tasks.errors import TaskError
    from cadenza.tasks.remove_agent import AgentRemoverOptions

    opts = BuildOptions(
        max_tasks=max_tasks,
        workers=workers,
        difficulty=difficulty,
        timeout=timeout,
        with_signature=not no_signature,
        exclude_failing=exclude_failing,
        sandbox=sandbox,
        max_candidates=max_candidates or None,
        remover=remover,
        agent=AgentRemoverOptions(endpoint, model, api_key_env, max_turns=max_turns)
        if remover == "agent"
        else None,
    )
    try:
        summary = build(source, out, opts, log=lambda m: typer.echo(m, err=True))
    except TaskError as e:
        _fail(e)
    typer.echo(json.dumps({k: summary[k] for k in ("accepted", "rejected", "rejection_reasons")}))


@app.command("export")
def export_cmd(
    task_dir: Path = typer.Argument(..., help="A directory written by `cadenza tasks build`."),
    instance_id: str = typer.Argument(..., help="The task's instance_id."),
    to: Path = typer.Option(..., "--to", help="New directory for the agent's workspace."),
) -> None:
    """Materialize a task's starting workspace (a one-commit git repository)."""
    from cadenza.tasks.errors import TaskError
    from cadenza.tasks.store import export

    try:
        sha = export(task_dir, instance_id, to)
    except TaskError as e:
        _fail(e)
    typer.echo(f"{to} at {sha}")


@app.command("grade")
def grade_cmd(
    task_dir: Path = typer.Argument(..., help="A directory written by `cadenza tasks build`."),
    predictions: Path = typer.Option(
        ..., "--predictions", help="JSONL: instance_id, model_patch, model_name_or_path."
    ),
    out: Path = typer.Option(..., "--out", help="Where to write REPORT.json."),
    workers: int = typer.Option(1, "--workers", help="Grading processes (at most 2 here)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds per test run."),
) -> None:
    """Grade predictions in fresh workspaces; REPORT maps instance_id to {resolved, ...}."""
    from cadenza.tasks.errors import TaskError
    from cadenza.tasks.grade import grade_dir

    try:
        report = grade_dir(task_dir, predictions, out, workers=workers, timeout=timeout)
    except TaskError as e:
        _fail(e)
    resolved = sum(r["resolved"] for r in report.values())
    typer.echo(f"{resolved}/{len(report)} resolved; report in {out}")
