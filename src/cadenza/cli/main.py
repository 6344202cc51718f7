"""`cadenza`: one entry point; each command group lives in its own module under cli/."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a shared or oversubscribed machine a
# spinning torch thread pool made a 2-thread training step 14x slower than 1 thread (measured
# under load); it must be set before torch (libgomp) is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer  # noqa: E402

app = typer.Typer(
    name="cadenza",
    help="cadenza: an open training stack for agentic coding models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from cadenza.cli import bench, config_cmd, model, parallel, sandbox, tasks, tokenizer, train

    app.command("train", context_settings={"allow_extra_args": False})(train.train)
    app.add_typer(config_cmd.app, name="config")
    app.command("bench")(bench.bench)
    app.add_typer(model.app, name="model")
    app.add_typer(tokenizer.app, name="tokenizer")
    app.add_typer(sandbox.app, name="sandbox")
    app.add_typer(parallel.app, name="parallel")
    app.add_typer(tasks.app, name="tasks")


_register()

if __name__ == "__main__":
    app()
