"""`cadenza train`: the main job."""

from __future__ import annotations

import os

import typer

from cadenza.config import ConfigError, load_config


def train(
    overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. train.steps=50"),
    config: str = typer.Option(
        "tiny", "--config", "-c", help="Preset name (tiny, k2) or YAML file."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest checkpoint in train.out_dir."
    ),
) -> None:
    """Run the main job (today: pretraining of the model on the code corpus)."""
    try:
        cfg = load_config(config, (overrides or []) + (["train.resume=true"] if resume else []))
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    from cadenza.model.tokenizer import TokenizerError
    from cadenza.train.checkpoint import CheckpointError
    from cadenza.train.corpus import CorpusError
    from cadenza.train.job import run_job
    from cadenza.train.pretrain import Interrupted, PretrainError

    try:
        run_job(cfg)
    except Interrupted as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; one says so
            typer.echo(f"{e}; continue with: cadenza train --resume (same config)", err=True)
        raise typer.Exit(128 + e.signum) from e
    except (PretrainError, CheckpointError, CorpusError, TokenizerError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
