"""`cadenza serve CKPT --port P`: an OpenAI-compatible chat-completions server."""

from __future__ import annotations

from pathlib import Path

import typer


def serve(
    ckpt: Path = typer.Argument(
        ..., help="Checkpoint directory (config.json, safetensors, tokenizer.json)."
    ),
    port: int = typer.Option(8000, "--port", help="TCP port; 0 picks a free one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    model_name: str | None = typer.Option(
        None, "--model-name", help="Name clients use; default: the directory name."
    ),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Default reply length limit."),
) -> None:
    """Serve a cadenza checkpoint at /v1/chat/completions (streaming, tool calls) and /v1/models."""
    from cadenza.agent.chat_format import ChatFormatError
    from cadenza.agent.serve import load_service, make_server

    if not ckpt.is_dir():
        typer.echo(f"error: {ckpt} is not a checkpoint directory", err=True)
        raise typer.Exit(2)
    try:
        service = load_service(ckpt, model_name, max_new_tokens=max_new_tokens)
    except (ChatFormatError, ValueError, OSError) as e:
        typer.echo(f"error: cannot serve {ckpt}: {e}", err=True)
        raise typer.Exit(2) from e
    server = make_server(service, host, port)
    h, p = server.server_address[:2]
    typer.echo(f"serving {service.model_name} on http://{h}:{p}/v1 (Ctrl-C stops)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
