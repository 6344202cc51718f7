"""`cadenza tokenizer`: train and inspect byte-level BPE tokenizers."""

from __future__ import annotations

import time
from pathlib import Path

import typer

app = typer.Typer(help="Train and inspect byte-level BPE tokenizers.", no_args_is_help=True)


@app.command("train")
def train(
    out: Path = typer.Option(Path("runs/tokenizer"), "--out", help="Directory to write into."),
    vocab_size: int = typer.Option(
        4096, "--vocab-size", help="Vocabulary size, specials included."
    ),
    corpus: str = typer.Option(
        "stdlib", "--corpus", help="'stdlib' (this machine's Python standard library) or a DIR."
    ),
    max_bytes: int = typer.Option(8_000_000, "--max-bytes", help="Cap on training text bytes."),
) -> None:
    """Train a byte-level BPE on a code corpus; writes OUT/tokenizer.json."""
    from cadenza.model.tokenizer import TokenizerError, train_tokenizer
    from cadenza.train.corpus import CorpusError, corpus_files

    t0 = time.perf_counter()
    try:
        files = corpus_files(corpus, max_bytes=max_bytes)
        tok = train_tokenizer(files, vocab_size=vocab_size, max_bytes=max_bytes)
    except (CorpusError, TokenizerError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    path = tok.save(out)
    typer.echo(
        f"trained a {tok.vocab_size}-token byte-level BPE on {len(files)} files "
        f"in {time.perf_counter() - t0:.1f}s; wrote {path}"
    )


@app.command("encode")
def encode(
    text: str = typer.Argument(..., help="Text to tokenize."),
    tokenizer: Path = typer.Option(
        Path("runs/tokenizer"), "--tokenizer", help="tokenizer.json or its directory."
    ),
) -> None:
    """Print the token ids and pieces of TEXT."""
    from cadenza.model.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_file(tokenizer)
    except TokenizerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    ids = tok.encode(text)
    typer.echo(" ".join(str(i) for i in ids))
    typer.echo(" | ".join(tok.decode([i]) for i in ids))
