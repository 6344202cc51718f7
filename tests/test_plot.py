import shutil
import struct
import subprocess
import zlib

import pytest

from cadenza.log.plot import PALETTE, line_plot_png


def _decode_png(data: bytes):
    """Minimal PNG reader per the spec: chunks, CRCs, IHDR, filter-0 RGB rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, ctype = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, ctype) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w) : (y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_line_plot_png_is_a_valid_image_with_both_series(tmp_path):
    path = line_plot_png(
        tmp_path / "p.png",
        {
            "adamw": [5.0 - 0.01 * i for i in range(100)],
            "muon": [5.0 - 0.02 * i for i in range(100)],
        },
        title="loss",
        width=300,
        height=200,
    )
    w, h, rows = _decode_png(path.read_bytes())
    assert (w, h) == (300, 200)
    pixels = [bytes(r[i : i + 3]) for r in rows for i in range(0, len(r), 3)]
    for color in PALETTE[:2]:
        assert pixels.count(bytes(color)) > 100
    if shutil.which("file"):
        out = subprocess.run(["file", str(path)], capture_output=True, text=True).stdout
        assert "PNG image data, 300 x 200, 8-bit/color RGB" in out
    with pytest.raises(ValueError, match="nothing to plot"):
        line_plot_png(tmp_path / "q.png", {"a": [float("nan")]})
