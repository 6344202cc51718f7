"""The own TensorBoard writer: CRC-32C against its published check values (RFC 3720 B.4 and
the "123456789" check), and the event records decoded by an independent reading of the
protobuf wire format written here from the spec."""

import struct

from cadenza.log.metrics import MetricsWriter
from cadenza.log.tensorboard import crc32c, masked_crc32c


def test_crc32c_check_values():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(bytes([0xFF] * 32)) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def _varint(buf, i):
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf):
    i, out = 0, []
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 1:
            v, i = buf[i : i + 8], i + 8
        elif wire == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        out.append((field, v))
    return out


def _records(path):
    data = path.read_bytes()
    i, out = 0, []
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == masked_crc32c(data[i : i + 8])
        rec = data[i + 12 : i + 12 + n]
        assert struct.unpack_from("<I", data, i + 12 + n)[0] == masked_crc32c(rec)
        out.append(rec)
        i += 16 + n
    return out


def test_metrics_are_mirrored_as_scalar_events(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"step": 3, "loss": 1.5, "note": "x", "ok": True})
    w.write({"step": 4, "loss": 1.25, "lr": 1e-3})
    w.close()
    (path,) = (tmp_path / "tensorboard").iterdir()
    recs = [dict(_fields(r)) | {"_all": _fields(r)} for r in _records(path)]
    assert recs[0][3] == b"brain.Event:2"
    got = []
    for r in recs[1:]:
        step = r[2]
        for field, value in _fields(r[5]):
            assert field == 1
            v = dict(_fields(value))
            got.append((step, v[1].decode(), struct.unpack("<f", v[2])[0]))
    assert got == [
        (3, "loss", 1.5),
        (4, "loss", 1.25),
        (4, "lr", struct.unpack("<f", struct.pack("<f", 1e-3))[0]),
    ]
