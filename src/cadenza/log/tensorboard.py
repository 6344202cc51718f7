"""TensorBoard scalars without TensorBoard: an own writer of its event-file format.

An event file is a sequence of TFRecords, each `len (u64) | masked_crc32c(len) (u32) |
data | masked_crc32c(data) (u32)`, little-endian; `data` is a serialized `Event` protobuf:
wall_time (field 1, double), step (field 2, int64), file_version (field 3, string) or
summary (field 5, message: repeated Value (field 1) with tag (1, string) and
simple_value (2, float)). Only what scalars need is encoded here.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 negatives as two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(
    wall_time: float,
    step: int,
    *,
    file_version: str | None = None,
    scalars: dict[str, float] | None = None,
) -> bytes:
    """Serialized `Event` protobuf."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", v))
            for tag, v in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


def frame(record: bytes) -> bytes:
    """One TFRecord."""
    n = struct.pack("<Q", len(record))
    return (
        n + struct.pack("<I", masked_crc32c(n)) + record + struct.pack("<I", masked_crc32c(record))
    )


class ScalarWriter:
    """Appends scalar summaries to a new event file in `log_dir` (TensorBoard reads every
    file there, so a resumed run simply adds a file)."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.dir / name
        self._f = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._f.write(frame(encode_event(time.time(), 0, file_version="brain.Event:2")))
        self._f.flush()

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if scalars:
            self._f.write(frame(encode_event(time.time(), int(step), scalars=scalars)))
            self._f.flush()

    def close(self) -> None:
        self._f.close()
