"""A tiny PNG line-plot writer (zlib only; no plotting dependency).

`line_plot` draws stacked panels of polylines on a white canvas with light grid lines; there
is no text rendering, so callers describe colors and axes where they print results.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]


def encode_png(pixels: list[bytearray], width: int, height: int) -> bytes:
    """RGB rows (3 * width bytes each) -> PNG bytes (8-bit truecolor, filter 0)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


class Canvas:
    def __init__(self, width: int, height: int, bg: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(bg) * width) for _ in range(height)]

    def set(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x : 3 * x + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: Color, thick: int = 1) -> None:
        """Bresenham, optionally thickened by a square brush."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r = thick // 2
        while True:
            for ox in range(-r, r + 1):
                for oy in range(-r, r + 1):
                    self.set(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(encode_png(self.rows, self.width, self.height))
        os.replace(tmp, path)


def line_plot(
    path: str | Path,
    panels: list[dict],
    width: int = 640,
    panel_height: int = 240,
    margin: int = 16,
) -> None:
    """Stacked panels; each is {"series": [(ys, color)], "ylim": (lo, hi), "hlines": [y]}.

    x is the index into ys (the step), scaled to the longest series of the panel.
    """
    canvas = Canvas(width, panel_height * len(panels))
    for k, panel in enumerate(panels):
        top = k * panel_height + margin
        bottom = (k + 1) * panel_height - margin
        left, right = margin, width - margin
        lo, hi = panel.get("ylim", (0.0, 1.0))
        n = max((len(ys) for ys, _ in panel["series"]), default=1)

        def px(i: int, y: float, lo=lo, hi=hi, n=n, top=top, bottom=bottom, left=left, right=right):
            y = min(max(y, lo), hi)
            fx = left + (right - left) * i / max(n - 1, 1)
            fy = bottom - (bottom - top) * (y - lo) / (hi - lo or 1.0)
            return round(fx), round(fy)

        gray = (225, 225, 225)
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            _, gy = px(0, lo + frac * (hi - lo))
            canvas.line(left, gy, right, gy, gray)
        for hy in panel.get("hlines", []):
            _, gy = px(0, hy)
            canvas.line(left, gy, right, gy, (120, 120, 120))
        canvas.line(left, top, left, bottom, (0, 0, 0))
        canvas.line(left, bottom, right, bottom, (0, 0, 0))
        for ys, color in panel["series"]:
            pts = [px(i, y) for i, y in enumerate(ys)]
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                canvas.line(x0, y0, x1, y1, color, thick=2)
    canvas.save(path)
