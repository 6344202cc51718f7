"""Corpus -> token stream -> fixed-length packed batches, deterministic and resumable.

Documents are tokenized as ``<|bos|> doc <|eos|>`` and concatenated into one stream S.
The stream is cut into n = (len(S) - 1) // T windows of T + 1 tokens that overlap by one:

    window i = S[i*T : i*T + T + 1],  inputs = window[:-1],  targets = window[1:]

so every token of S[1 : n*T + 1] is a target exactly once per epoch (only the tail of fewer
than T tokens is dropped). Each epoch visits the windows in a fresh permutation drawn from
(seed, epoch); batch b holds windows b*B .. b*B + B - 1 of the concatenated epoch orders.
A batch is a pure function of its position b, so the data position saved in a checkpoint
(the number of batches consumed) is all resuming needs.

The validation split is whole documents, chosen by a seeded permutation, so no validation
text is ever trained on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def pack_documents(docs: Sequence[Sequence[int]], bos_id: int, eos_id: int) -> torch.Tensor:
    """One int64 stream: bos, doc 0, eos, bos, doc 1, eos, ..."""
    if not docs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.tensor([bos_id, *d, eos_id], dtype=torch.long) for d in docs])


def num_windows(stream_len: int, seq_len: int) -> int:
    return max(0, (stream_len - 1) // seq_len)


def windows(stream: torch.Tensor, seq_len: int, ids: torch.Tensor) -> torch.Tensor:
    """Windows `ids` of the stream as a [len(ids), seq_len + 1] tensor (one gather)."""
    offsets = torch.arange(seq_len + 1)
    return stream[ids[:, None] * seq_len + offsets[None, :]]


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of (train, validation) documents; at least one of each when n_docs >= 2."""
    if n_docs < 2:
        raise ValueError(
            f"the corpus has {n_docs} document(s); need at least 2 to hold one out for "
            "validation (add files, or raise data.max_files)"
        )
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_docs, generator=g).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def fingerprint(stream: torch.Tensor) -> str:
    """Short content hash of a stream, stored in checkpoints to detect a changed corpus."""
    return hashlib.sha256(stream.numpy().tobytes()).hexdigest()[:16]


@dataclass
class PackedBatches:
    """Batches of packed windows: `batch(position)` -> (inputs, targets), each [B, T]."""

    stream: torch.Tensor
    seq_len: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        self.n_windows = num_windows(len(self.stream), self.seq_len)
        if self.n_windows < 1:
            raise ValueError(
                f"the token stream has {len(self.stream)} tokens, fewer than one window of "
                f"seq_len+1={self.seq_len + 1}; use more data or a shorter data.seq_len"
            )
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n_windows)
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n_windows, generator=g)
        return self._perms[epoch]

    def window_ids(self, start: int, count: int) -> torch.Tensor:
        """Window indices at global positions start .. start+count-1 (epochs concatenated)."""
        g = torch.arange(start, start + count)
        epochs = g // self.n_windows
        out = torch.empty(count, dtype=torch.long)
        for e in epochs.unique().tolist():
            sel = epochs == e
            out[sel] = self._epoch_order(e)[g[sel] % self.n_windows]
        return out

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.window_ids(position * self.batch_size, self.batch_size)
        w = windows(self.stream, self.seq_len, ids)
        return w[:, :-1], w[:, 1:]

    def epoch_of(self, position: int) -> float:
        return position * self.batch_size / self.n_windows

    def eval_batches(self, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `max_batches` batches in stream order (a fixed validation set)."""
        n = min(max_batches, max(1, self.n_windows // self.batch_size))
        out = []
        for b in range(n):
            ids = torch.arange(b * self.batch_size, (b + 1) * self.batch_size) % self.n_windows
            w = windows(self.stream, self.seq_len, ids)
            out.append((w[:, :-1], w[:, 1:]))
        return out


@dataclass
class CorpusData:
    """Train and validation batches of one corpus, with fingerprints for resuming."""

    train: PackedBatches
    val: PackedBatches
    n_docs: int
    n_val_docs: int

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.train.stream) + fingerprint(self.val.stream)


def build_corpus_data(
    docs: Sequence[Sequence[int]],
    bos_id: int,
    eos_id: int,
    seq_len: int,
    batch_size: int,
    val_fraction: float,
    seed: int,
) -> CorpusData:
    """Split tokenized documents, pack both splits, wrap them as batches."""
    train_idx, val_idx = split_documents(len(docs), val_fraction, seed)
    train_stream = pack_documents([docs[i] for i in train_idx], bos_id, eos_id)
    val_stream = pack_documents([docs[i] for i in val_idx], bos_id, eos_id)
    if num_windows(len(val_stream), seq_len) < 1:
        # Small corpora: the held-out documents may be shorter than one window.
        raise ValueError(
            f"the validation split has {len(val_stream)} tokens, fewer than one window of "
            f"{seq_len + 1}; raise data.val_fraction or data.max_files, or lower data.seq_len"
        )
    return CorpusData(
        train=PackedBatches(train_stream, seq_len, batch_size, seed),
        val=PackedBatches(val_stream, seq_len, batch_size, seed, shuffle=False),
        n_docs=len(docs),
        n_val_docs=len(val_idx),
    )
