"""Byte-level BPE tokenizer: a thin wrapper over a Hugging Face `tokenizer.json`.

Byte-level means every string (any Unicode, any whitespace, code indentation included)
round-trips exactly: text -> bytes -> BPE tokens -> bytes -> text, with no normalization.

Special tokens (fixed ids 0..8, in this order, in every tokenizer cadenza trains):

==================  =====================================================================
``<|pad|>``         padding in batches; never trained on
``<|bos|>``         start of a document / of a conversation
``<|eos|>``         end of a document; generation stops here
``<|im_start|>``    start of a chat message; the role follows as text, then a newline
``<|im_end|>``      end of a chat message
``<|tool_call|>``   start of a tool call inside an assistant message (JSON follows)
``<|/tool_call|>``  end of a tool call
``<|tool_result|>`` start of a tool's output inside a ``tool`` message
``<|/tool_result|>`` end of a tool's output
==================  =====================================================================

The chat tokens are reserved for the agent harness: pretraining never produces them, so a
pretrained model meets them first in RL, as Hugging Face chat models do.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<|tool_call|>", "<|/tool_call|>"
TOOL_RESULT, TOOL_RESULT_END = "<|tool_result|>", "<|/tool_result|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    BOS,
    EOS,
    IM_START,
    IM_END,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESULT,
    TOOL_RESULT_END,
)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message says what is wrong and what to do."""


class Tokenizer:
    """Encode/decode text with a byte-level BPE `tokenizer.json` and cadenza's special tokens."""

    def __init__(self, hf: _HFTokenizer, source: str = "<memory>") -> None:
        self.hf = hf
        self.source = source
        missing = [t for t in (PAD, BOS, EOS) if hf.token_to_id(t) is None]
        if missing:
            raise TokenizerError(
                f"tokenizer {source} lacks the special token(s) {missing}; expected a tokenizer "
                f"trained by `cadenza tokenizer train` (specials {list(SPECIAL_TOKENS)})"
            )
        self.pad_id: int = hf.token_to_id(PAD)
        self.bos_id: int = hf.token_to_id(BOS)
        self.eos_id: int = hf.token_to_id(EOS)

    # ---- loading and saving -------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `path` (a tokenizer.json, or a directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(
                f"no tokenizer at {p}: expected a tokenizer.json file (or a directory holding "
                "one); train one with `cadenza tokenizer train --out DIR`"
            )
        try:
            hf = _HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust library raises plain Exception on bad JSON
            raise TokenizerError(
                f"{p} is not a valid tokenizer.json ({e}); retrain it with `cadenza tokenizer train`"
            ) from e
        return cls(hf, source=str(p))

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json (+ tokenizer_config.json for transformers) into `directory`.

        Each file is written to a temporary name and renamed, so a reader never sees half a file.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write(d / "tokenizer.json", self.hf.to_str(pretty=False))
        hf_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        _atomic_write(d / "tokenizer_config.json", json.dumps(hf_config, indent=2) + "\n")
        return d / "tokenizer.json"

    # ---- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        i = self.hf.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the vocabulary of {self.source}")
        return i

    @property
    def special_ids(self) -> dict[str, int]:
        """Special token -> id, for the specials this tokenizer has."""
        return {t: i for t in SPECIAL_TOKENS if (i := self.hf.token_to_id(t)) is not None}

    # ---- encoding -----------------------------------------------------------------------

    def encode(
        self, text: str, add_bos: bool = False, add_eos: bool = False, allow_special: bool = True
    ) -> list[int]:
        """Token ids of `text`.

        allow_special=True maps the literal strings of special tokens (e.g. "<|im_end|>") to
        their ids, as the chat template needs; False encodes them as ordinary bytes, for
        untrusted text such as a tool's output.
        """
        return self.encode_batch([text], add_bos, add_eos, allow_special)[0]

    def encode_batch(
        self,
        texts: Sequence[str],
        add_bos: bool = False,
        add_eos: bool = False,
        allow_special: bool = True,
    ) -> list[list[int]]:
        self.hf.encode_special_tokens = not allow_special
        try:
            encodings = self.hf.encode_batch(list(texts), add_special_tokens=False)
        finally:
            self.hf.encode_special_tokens = False
        head = [self.bos_id] if add_bos else []
        tail = [self.eos_id] if add_eos else []
        return [head + e.ids + tail for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return self.hf.decode_batch([list(b) for b in batch], skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def new_byte_level_bpe() -> _HFTokenizer:
    """An untrained byte-level BPE pipeline: no normalizer, GPT-2 style pre-tokenization."""
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def read_texts(files: Iterable[str | os.PathLike], max_bytes: int | None = None) -> Iterator[str]:
    """Yield the UTF-8 text of each file in order, until `max_bytes` of text have been yielded.

    Files that are not valid UTF-8 are skipped (a few stdlib test files are deliberately not).
    """
    total = 0
    for f in files:
        try:
            raw = Path(f).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if max_bytes is not None and total + len(raw) > max_bytes and total > 0:
            return
        total += len(raw)
        yield text


def train_tokenizer(
    files: Iterable[str | os.PathLike],
    vocab_size: int = 4096,
    max_bytes: int | None = None,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> Tokenizer:
    """Train a byte-level BPE on the text of `files` (in order, capped at `max_bytes`).

    The vocabulary holds the specials first (ids 0..len(specials)-1), the 256 byte symbols,
    then merges up to `vocab_size` (fewer if the corpus runs out of pairs seen
    `min_frequency` times). Deterministic for the same files and settings.
    """
    floor = len(special_tokens) + 256
    if vocab_size < floor:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {floor} "
            f"ids ({len(special_tokens)} specials + 256 bytes); use a larger --vocab-size"
        )
    texts = list(read_texts(files, max_bytes))
    if not texts:
        raise TokenizerError(
            "no training text: none of the given files could be read as UTF-8; "
            "point the corpus at a directory of source files"
        )
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return Tokenizer(tok, source="<trained>")


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a tokenizer is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
