"""`cadenza`: one entry point; each command group lives in its own module under cli/."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="cadenza",
    help="cadenza: an open training stack for agentic coding models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from cadenza.cli import bench, config_cmd, model, parallel, sandbox, tokenizer, train

    app.command("train", context_settings={"allow_extra_args": False})(train.train)
    app.add_typer(config_cmd.app, name="config")
    app.command("bench")(bench.bench)
    app.add_typer(model.app, name="model")
    app.add_typer(tokenizer.app, name="tokenizer")
    app.add_typer(sandbox.app, name="sandbox")
    app.add_typer(parallel.app, name="parallel")


_register()

if __name__ == "__main__":
    app()
