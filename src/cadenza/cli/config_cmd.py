"""`cadenza config show`: print the resolved job config."""

from __future__ import annotations

import typer

from cadenza.config import ConfigError, dump_yaml, load_config

app = typer.Typer(help="Inspect configs and presets.", no_args_is_help=True)


@app.command("show")
def show(
    config: str = typer.Option(
        "tiny", "--config", "-c", help="Preset name (tiny, k2) or YAML file."
    ),
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. train.steps=50"),
) -> None:
    """Print the config that `cadenza train` would run with."""
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(dump_yaml(cfg), nl=False)
