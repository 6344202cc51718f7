"""`cadenza parallel plan N`: check a dual-mesh layout and print its rank groups (no processes)."""

from __future__ import annotations

import typer

from cadenza.config import ConfigError, load_config

app = typer.Typer(
    help="Parallel layouts: dense and expert meshes over the same ranks.", no_args_is_help=True
)


@app.command("plan")
def plan(
    world_size: int = typer.Argument(..., help="Number of ranks (torchrun's nproc x nodes)."),
    overrides: list[str] = typer.Argument(
        None, help="key=value overrides, e.g. parallel.cp=2 parallel.ep=8"
    ),
    config: str = typer.Option("tiny", "--config", "-c", help="Preset name or YAML file."),
) -> None:
    """Validate the layout of `parallel.*` for WORLD_SIZE ranks and print both meshes' groups."""
    from cadenza.parallel.mesh import LayoutError, check_layout, describe

    try:
        cfg = load_config(config, overrides or [])
        layout = check_layout(
            world_size, cfg.parallel.dense, cfg.parallel.expert, cfg.model.n_routed_experts
        )
    except (ConfigError, LayoutError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(describe(layout))
    typer.echo(
        f"experts per ep rank: {cfg.model.n_routed_experts // layout.ep}; "
        f"batch rows split {layout.dp} ways, each sequence {layout.cp} ways"
    )
