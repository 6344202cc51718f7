"""Line plots as PNG files, with no plotting library: a tiny rasterizer plus zlib.

`line_plot_png(path, {"adamw": ys, "muon": ys2}, ...)` draws each series as a polyline over
shared axes (x: index or given xs; y: min..max of all finite values), with a frame, grid
lines, tick labels and a legend in a built-in 3x5 pixel font scaled up. A PNG is a signature,
an IHDR chunk (width, height, 8-bit RGB), IDAT (zlib of rows, each prefixed by filter byte
0) and IEND; each chunk is length, type, data, CRC-32 of type+data.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Color = tuple[int, int, int]
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))

# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left pixel).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    " ": (0, 0, 0, 0, 0), "_": (0, 0, 0, 0, 7), ":": (0, 2, 0, 2, 0), "=": (0, 7, 0, 7, 0),
    "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6), "c": (7, 4, 4, 4, 7), "d": (6, 5, 5, 5, 6),
    "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4), "g": (7, 4, 5, 5, 7), "h": (5, 5, 7, 5, 5),
    "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 7), "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7),
    "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5), "o": (7, 5, 5, 5, 7), "p": (7, 5, 7, 4, 4),
    "q": (7, 5, 5, 7, 1), "r": (6, 5, 6, 5, 5), "s": (7, 4, 7, 1, 7), "t": (7, 2, 2, 2, 2),
    "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2), "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5),
    "y": (5, 5, 2, 2, 2), "z": (7, 1, 2, 4, 7), "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4),
    "/": (1, 1, 2, 4, 4), "%": (5, 1, 2, 4, 5), "+": (0, 2, 7, 2, 0), ",": (0, 0, 0, 2, 4),
}  # fmt: skip


class Canvas:
    """An RGB image as a flat bytearray; (x, y) from the top-left corner."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Filled rectangle [x0, x1) x [y0, y1)."""
        x0, x1 = max(0, x0), min(self.width, x1)
        for y in range(max(0, y0), min(self.height, y1)):
            i = 3 * (y * self.width + x0)
            self.pixels[i : i + 3 * (x1 - x0)] = bytes(color) * max(0, x1 - x0)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 2):
        """Segment by uniform sampling (one sample per pixel of its longer extent)."""
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for k in range(n + 1):
            t = k / n
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            self.rect(x - width // 2, y - width // 2, x - width // 2 + width, y - width // 2 + width, color)  # fmt: skip

    def text(self, x: int, y: int, s: str, color: Color = (0, 0, 0), scale: int = 2) -> int:
        """Draw `s` (lowercased; unknown characters as blanks); returns the end x."""
        for ch in s.lower():
            rows = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(rows):
                for c in range(3):
                    if bits & (4 >> c):
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)  # fmt: skip
            x += 4 * scale
        return x

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + kind
                + data
                + struct.pack(">I", zlib.crc32(kind + data))
            )

        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def line_plot_png(
    path: str | os.PathLike,
    series: dict[str, Sequence[float]],
    xs: Sequence[float] | None = None,
    title: str = "",
    width: int = 720,
    height: int = 440,
) -> Path:
    """Write a line plot of `series` (name -> y values) to `path` (atomically)."""
    finite = [v for ys in series.values() for v in ys if math.isfinite(v)]
    if not finite:
        raise ValueError("nothing to plot: every series is empty or non-finite")
    n = max(len(ys) for ys in series.values())
    xs = list(xs) if xs is not None else list(range(1, n + 1))
    x_lo, x_hi = min(xs), max(xs)
    integer_x = all(float(x).is_integer() for x in xs)
    y_lo, y_hi = min(finite), max(finite)
    if y_hi - y_lo < 1e-12:
        y_lo, y_hi = y_lo - 1.0, y_hi + 1.0
    pad = 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad
    left, right, top, bottom = 70, 20, 40, 40
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x_lo) / max(x_hi - x_lo, 1e-12) * pw

    def py(y: float) -> float:
        return top + (y_hi - y) / (y_hi - y_lo) * ph

    c = Canvas(width, height)
    grid, axis = (225, 225, 225), (60, 60, 60)
    for k in range(6):
        y = y_lo + (y_hi - y_lo) * k / 5
        c.rect(left, round(py(y)), left + pw, round(py(y)) + 1, grid)
        c.text(6, round(py(y)) - 5, _fmt(y), axis)
        x = x_lo + (x_hi - x_lo) * k / 5
        if integer_x:
            x = round(x)
        c.rect(round(px(x)), top, round(px(x)) + 1, top + ph, grid)
        c.text(round(px(x)) - 8, top + ph + 8, _fmt(x), axis)
    c.rect(left, top, left + pw, top + 1, axis)
    c.rect(left, top + ph, left + pw + 1, top + ph + 1, axis)
    c.rect(left, top, left + 1, top + ph, axis)
    c.rect(left + pw, top, left + pw + 1, top + ph, axis)
    c.text(left, 12, title, axis)
    lx = left + pw - 10
    for i, (name, ys) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = [(px(x), py(y)) for x, y in zip(xs, ys) if math.isfinite(y)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(x0, y0, x1, y1, color)
        ly = top + 10 + 16 * i
        end = lx - 8 * len(name) - 24
        c.rect(end, ly + 3, end + 16, ly + 7, color)
        c.text(end + 22, ly, name, color)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_bytes(c.png())
    os.replace(tmp, p)
    return p
