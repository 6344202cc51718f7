"""`cadenza bench NAME`: benchmarks are modules cadenza.bench.<name> with `run(args) -> dict`."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import typer

import cadenza.bench


def available() -> list[str]:
    return sorted(
        m.name.replace("_", "-")
        for m in pkgutil.iter_modules(cadenza.bench.__path__)
        if not m.name.startswith("_")
    )


def bench(
    name: str = typer.Argument(..., help="Benchmark name; `cadenza bench list` shows them."),
    args: list[str] = typer.Argument(None, help="Arguments passed to the benchmark (after --)."),
    json_out: Path | None = typer.Option(
        None, "--json", help="Also write the results as JSON here."
    ),
) -> None:
    """Run a benchmark: prints figures against a baseline measured in the same run."""
    names = available()
    if name == "list":
        typer.echo("\n".join(names))
        return
    if name not in names:
        typer.echo(f"error: unknown benchmark {name!r}; available: {', '.join(names)}", err=True)
        raise typer.Exit(2)
    module = importlib.import_module(f"cadenza.bench.{name.replace('-', '_')}")
    result = module.run(list(args or []))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        typer.echo(f"wrote {json_out}")
