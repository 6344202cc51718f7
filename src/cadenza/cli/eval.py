"""`cadenza eval TASKS_DIR --endpoint URL --model NAME`: episodes against an OpenAI-compatible
endpoint, SWE-bench predictions and a report."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import typer


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def summarize(episodes: list[Any], model: str) -> tuple[list[dict], dict[str, Any]]:
    """SWE-bench predictions and the report for one episode per instance."""
    preds, per = [], {}
    for ep in episodes:
        preds.append(
            {
                "instance_id": ep.task_id,
                "model_patch": ep.info.get("model_patch", ""),
                "model_name_or_path": model,
            }
        )
        kinds: dict[str, int] = {}
        for t in ep.turns:
            for k in t.error_kinds:
                kinds[k] = kinds.get(k, 0) + 1
        per[ep.task_id] = {
            "resolved": ep.resolved,
            "reward": ep.reward,
            "finish_reason": ep.finish_reason,
            "assistant_turns": len(ep.assistant_turns()),
            "tool_calls": ep.info.get("num_tool_calls", 0),
            "error_kinds": kinds,
            **({"error": ep.info["error"]} if "error" in ep.info else {}),
            **({"grade_error": ep.info["grade_error"]} if "grade_error" in ep.info else {}),
        }
    n = len(per)
    resolved = sum(r["resolved"] for r in per.values())
    report = {
        "model": model,
        "instances": n,
        "resolved": resolved,
        "resolved_rate": resolved / n if n else 0.0,
        "per_instance": per,
    }
    return preds, report


def eval_cmd(
    tasks_dir: Path = typer.Argument(
        ..., help="Task store directory (tasks.jsonl) from `cadenza tasks build`."
    ),
    endpoint: str = typer.Option(
        ..., "--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    ),
    model: str = typer.Option(
        ..., "--model", help="Model name sent to the endpoint and written to predictions."
    ),
    out: Path = typer.Option(Path("eval_out"), "--out", help="Output directory."),
    instance: list[str] = typer.Option(
        None, "--instance", help="Only these instance ids (repeatable)."
    ),
    max_tasks: int = typer.Option(0, "--max-tasks", help="At most this many instances (0: all)."),
    max_turns: int = typer.Option(30, "--max-turns", help="Assistant turns per episode."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Tokens per reply."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature."),
    api_key_env: str = typer.Option(
        "OPENAI_API_KEY", "--api-key-env", help="Environment variable holding the API key, if any."
    ),
    unsafe_sandbox: bool = typer.Option(
        False,
        "--unsafe-sandbox",
        help="Run commands without bubblewrap when it is missing (no isolation).",
    ),
) -> None:
    """Run one episode per task against an endpoint; write predictions.jsonl, episodes.jsonl, report.json."""
    from cadenza.agent.episode import Episode
    from cadenza.agent.policies import HTTPPolicy
    from cadenza.agent.runner import EpisodeRunner
    from cadenza.agent.task_source import load_task_store
    from cadenza.config.agent import AgentConfig

    if not (tasks_dir / "tasks.jsonl").is_file():
        typer.echo(
            f"error: {tasks_dir}/tasks.jsonl not found; build tasks with `cadenza tasks build`",
            err=True,
        )
        raise typer.Exit(2)
    try:
        policy = HTTPPolicy(
            endpoint, model, temperature=temperature, api_key=os.environ.get(api_key_env)
        )
        tasks = load_task_store(tasks_dir, instance or None)
    except ImportError as e:
        typer.echo(f"error: the task factory (cadenza.tasks) is not available: {e}", err=True)
        raise typer.Exit(2) from e
    except (RuntimeError, ValueError, OSError) as e:  # PolicyError, the store's TaskError
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if max_tasks:
        tasks = tasks[:max_tasks]
    cfg = AgentConfig(
        max_turns=max_turns,
        max_new_tokens=max_tokens,
        temperature=temperature,
        unsafe_sandbox=unsafe_sandbox,
    )
    runner = EpisodeRunner(policy, None, cfg)
    episodes = []
    for i, task in enumerate(tasks, 1):
        try:
            (ep,) = runner.run_group(task, 1, out / "workspaces")
        except Exception as e:  # one broken instance must not lose the others' results
            ep = Episode(
                task.instance_id, finish_reason="error", info={"error": f"{type(e).__name__}: {e}"}
            )
        episodes.append(ep)
        typer.echo(
            f"[{i}/{len(tasks)}] {task.instance_id}: resolved={ep.resolved} finish={ep.finish_reason} "
            f"turns={len(ep.assistant_turns())}",
            err=True,
        )
    preds, report = summarize(episodes, model)
    _write_atomic(out / "predictions.jsonl", "".join(json.dumps(p) + "\n" for p in preds))
    _write_atomic(out / "episodes.jsonl", "".join(json.dumps(e.to_dict()) + "\n" for e in episodes))
    _write_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    typer.echo(
        f"resolved {report['resolved']}/{report['instances']}; wrote {out}/predictions.jsonl and report.json"
    )
