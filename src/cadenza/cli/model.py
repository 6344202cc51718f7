"""`cadenza model info`: parameter counts of a checkpoint or preset, built on the meta device."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Inspect models: shapes and parameter counts.", no_args_is_help=True)


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@app.command("info")
def info(
    path: Path | None = typer.Argument(
        None, help="Hugging Face checkpoint directory (config.json)."
    ),
    preset: str | None = typer.Option(None, "--preset", help="Model preset instead: tiny or k2."),
) -> None:
    """Print total and activated-per-token parameter counts (no weights are loaded)."""
    from cadenza.config.model import MODEL_PRESETS
    from cadenza.model.counts import param_counts
    from cadenza.model.hf_io import CheckpointError, load_config

    if (path is None) == (preset is None):
        typer.echo("error: give either a checkpoint PATH or --preset (tiny, k2)", err=True)
        raise typer.Exit(2)
    if preset is not None:
        if preset not in MODEL_PRESETS:
            typer.echo(
                f"error: unknown preset {preset!r}; expected one of {sorted(MODEL_PRESETS)}",
                err=True,
            )
            raise typer.Exit(2)
        cfg, source = MODEL_PRESETS[preset](), f"preset {preset}"
    else:
        try:
            cfg = load_config(path)
        except CheckpointError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
        source = str(path)
    counts = param_counts(cfg)
    typer.echo(
        f"{source}: {cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), hidden"
        f" {cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.n_routed_experts} routed"
        f" experts (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, vocab {cfg.vocab_size}"
    )
    for key, n in counts.items():
        typer.echo(f"  {key:<28} {n:>18,}  ({_human(n)})")
    typer.echo(
        "activated = every parameter a token uses: embedding, attention, dense MLPs, shared"
        f" experts, routers, norms, lm_head and {cfg.num_experts_per_tok} of"
        f" {cfg.n_routed_experts} routed experts per MoE layer"
    )
