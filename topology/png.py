"""A small PNG writer and log-log line plot (no matplotlib): zlib + struct only.

:class:`Canvas` is an RGB raster with lines, filled rectangles and text in a built-in
5x7 bitmap font (upper-case letters, digits and a few signs; lower case is drawn upper
case). :func:`line_plot` draws series of ``(x, y)`` points on log-log axes with ticks,
labels and a legend, and :meth:`Canvas.save` writes an 8-bit RGB PNG.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Optional, Sequence

__all__ = ["Canvas", "line_plot", "encode_png", "PALETTE"]

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]

# 5 columns x 7 rows per glyph, "#" set.
_FONT_ROWS = {
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
    "A": [".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "B": ["####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."],
    "C": [".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."],
    "D": ["####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."],
    "E": ["#####", "#....", "#....", "####.", "#....", "#....", "#####"],
    "F": ["#####", "#....", "#....", "####.", "#....", "#....", "#...."],
    "G": [".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"],
    "H": ["#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "I": [".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "J": ["..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."],
    "K": ["#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"],
    "L": ["#....", "#....", "#....", "#....", "#....", "#....", "#####"],
    "M": ["#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"],
    "N": ["#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"],
    "O": [".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "P": ["####.", "#...#", "#...#", "####.", "#....", "#....", "#...."],
    "Q": [".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"],
    "R": ["####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"],
    "S": [".####", "#....", "#....", ".###.", "....#", "....#", "####."],
    "T": ["#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."],
    "U": ["#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "V": ["#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."],
    "W": ["#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."],
    "X": ["#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"],
    "Y": ["#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."],
    "Z": ["#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"],
    ".": [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."],
    ",": [".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."],
    "-": [".....", ".....", ".....", ".###.", ".....", ".....", "....."],
    "+": [".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."],
    "_": [".....", ".....", ".....", ".....", ".....", ".....", "#####"],
    "/": ["....#", "....#", "...#.", "..#..", ".#...", "#....", "#...."],
    ":": [".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."],
    "%": ["##..#", "##..#", "...#.", "..#..", ".#...", "#..##", "#..##"],
    "(": ["...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."],
    ")": [".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."],
    "=": [".....", ".....", "#####", ".....", "#####", ".....", "....."],
    "'": ["..#..", "..#..", ".#...", ".....", ".....", ".....", "....."],
    " ": ["....."] * 7,
}
_UNKNOWN = ["#####", "#...#", "#...#", "#...#", "#...#", "#...#", "#####"]
GLYPH_W, GLYPH_H = 5, 7


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``width x height`` pixels (``rgb``: rows top to bottom)."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"expected {width * height * 3} bytes of RGB, got {len(rgb)}")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))  # filter 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


class Canvas:
    """An RGB raster, origin at the top left."""

    def __init__(self, width: int, height: int, background: tuple = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: tuple) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple) -> None:
        """Fill the rectangle with corners ``(x0, y0)`` and ``(x1, y1)`` (inclusive)."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple, width: int = 1, dash: int = 0) -> None:
        """A straight line (Bresenham), ``width`` pixels thick, dashed every ``dash`` pixels if > 0."""
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        step = 0
        while True:
            if not dash or (step // dash) % 2 == 0:
                for ox in range(-half, width - half):
                    for oy in range(-half, width - half):
                        self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy
            step += 1

    def text(self, x: int, y: int, s: str, color: tuple = (0, 0, 0), scale: int = 2, anchor: str = "left") -> int:
        """Draw ``s`` with its top at ``y``; ``anchor`` left, center or right of ``x``. Returns its width."""
        w = self.text_width(s, scale)
        if anchor == "center":
            x -= w // 2
        elif anchor == "right":
            x -= w
        for i, ch in enumerate(s.upper()):
            rows = _FONT_ROWS.get(ch, _UNKNOWN)
            gx = x + i * (GLYPH_W + 1) * scale
            for ry, row in enumerate(rows):
                for rx, bit in enumerate(row):
                    if bit == "#":
                        for oy in range(scale):
                            for ox in range(scale):
                                self.set(gx + rx * scale + ox, y + ry * scale + oy, color)
        return w

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return max(0, len(s) * (GLYPH_W + 1) * scale - scale)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.png())


def _log_ticks(lo: float, hi: float, base: float) -> list[float]:
    start = math.floor(math.log(lo, base))
    stop = math.ceil(math.log(hi, base))
    return [base ** k for k in range(start, stop + 1)]


def line_plot(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    x_format,
    y_format,
    width: int = 900,
    height: int = 560,
    x_base: float = 4.0,
    y_base: float = 10.0,
    marks: Optional[Sequence[tuple[float, str]]] = None,
) -> Canvas:
    """Series of positive ``(x, y)`` points on log-log axes; returns the canvas.

    ``x_format``/``y_format`` turn tick values into labels; ``marks`` are vertical dashed
    lines at ``x`` with a label (e.g. a crossover).
    """
    c = Canvas(width, height)
    left, right, top, bottom = 110, 30, 60, 80
    pts = [(x, y) for _, s in series for x, y in s if x > 0 and y > 0]
    if not pts:
        c.text(width // 2, height // 2, "NO DATA", anchor="center")
        return c
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo / 2, x_hi * 2
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo / 2, y_hi * 2
    y_lo, y_hi = y_lo / 1.3, y_hi * 1.3
    lx0, lx1, ly0, ly1 = math.log(x_lo), math.log(x_hi), math.log(y_lo), math.log(y_hi)
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (math.log(x) - lx0) / (lx1 - lx0) * pw

    def py(y: float) -> float:
        return top + ph - (math.log(y) - ly0) / (ly1 - ly0) * ph

    grid, axis = (225, 225, 225), (60, 60, 60)
    for t in _log_ticks(y_lo, y_hi, y_base):
        if y_lo <= t <= y_hi:
            c.line(left, py(t), left + pw, py(t), grid)
            c.line(left - 5, py(t), left, py(t), axis)
            c.text(left - 8, int(py(t)) - 7, y_format(t), anchor="right")
    for t in _log_ticks(x_lo, x_hi, x_base):
        if x_lo * 0.999 <= t <= x_hi * 1.001:
            c.line(px(t), top, px(t), top + ph, grid)
            c.line(px(t), top + ph, px(t), top + ph + 5, axis)
            c.text(int(px(t)), top + ph + 10, x_format(t), anchor="center")
    c.line(left, top, left, top + ph, axis, 2)
    c.line(left, top + ph, left + pw, top + ph, axis, 2)
    for x, label in marks or ():
        if x_lo <= x <= x_hi:
            c.line(px(x), top, px(x), top + ph, (120, 120, 120), 1, dash=4)
            c.text(int(px(x)) + 4, top + 4, label, (90, 90, 90))
    for i, (name, s) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        good = sorted((x, y) for x, y in s if x > 0 and y > 0)
        for (xa, ya), (xb, yb) in zip(good, good[1:]):
            c.line(px(xa), py(ya), px(xb), py(yb), color, 2)
        for x, y in good:
            c.rect(int(px(x)) - 3, int(py(y)) - 3, int(px(x)) + 3, int(py(y)) + 3, color)
        ly = top + 8 + i * 22
        lx = left + pw - 170
        c.line(lx, ly + 7, lx + 30, ly + 7, color, 3)
        c.text(lx + 38, ly, name, color)
    c.text(width // 2, 18, title, anchor="center")
    c.text(left + pw // 2, height - 30, x_label, anchor="center")
    c.text(12, top - 30, y_label)
    return c
