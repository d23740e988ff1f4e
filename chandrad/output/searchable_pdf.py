"""A document's pages and their OCR layout → a searchable PDF: the pages as they were, text invisible on top.

Two steps, because the page image exists only while the page is at the engine:

``page_text_lines`` (page time, in a worker thread, image still in memory): each text block's
lines and words, found in the block's own pixels, with the block's words given to them. Row
projection profiles find the lines, column profiles the ink clusters of each line, the gaps
between clusters the words; a dynamic-programming alignment (widths predicted from the word's
characters, merges and splits of up to three words, skips) gives each of the engine's words its
cluster. Words the tesseract engine read carry tesseract's own boxes (``data-lines``, see
``engine/tesseract.py``) and are taken as they are. The result is a few integers per word, JSON
as it is, to be stored with the page's chunks.

``build_searchable_pdf`` (publish time): PDF inputs keep every page object, content stream,
image and font as it is; each page gets one more content stream (the original ones wrapped in
``q``/``Q``) that draws the text in render mode 3 with a glyphless font (one empty glyph, 0.5 em
wide, embedded: the PDF/A rule), each word's string scaled horizontally to its box, a space
glyph spanning each gap so that extraction sees the word breaks. Image inputs become one page
per frame through img2pdf, each image without loss (a JPEG's own bytes, a PNG's own compressed
data, a G4 TIFF frame's own fax data, alpha as a soft mask), upright by ``/Rotate``. The
mapping from image pixels to user space goes through the page's CropBox within its MediaBox (what
PDFium, prepare's renderer, draws), their offsets and ``/Rotate``; ``/UserUnit`` scales both
alike, so proportions suffice.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import img2pdf  # type: ignore[import-untyped]  # img2pdf ships no type hints
import numpy as np
import pikepdf
from bs4 import BeautifulSoup, Tag
from pikepdf import Array, Dictionary, Matrix, Name, Pdf
from pikepdf.canvas import ContentStreamBuilder
from PIL import Image, ImageCms, ImageOps, ImageSequence

__all__ = [
    "BlockLines",
    "PageLayer",
    "PageLines",
    "PdfReport",
    "PlacedLine",
    "block_tokens",
    "build_searchable_pdf",
    "page_text_lines",
    "placed_lines",
    "searchable_base",
]

# One line of a block: [x0, y0, x1, y1, n, s, wx0, wx1, wx0, wx1, ...] in page-image pixels. The
# line runs from x0 to x1; y0 and y1 are its top and bottom at x0, and it slopes by s / 10000 (a
# skewed scan). ``n`` of the block's words lie on it, in order; their x-ranges follow (2n numbers),
# or none when only the line is known (the words are then spread over it by their length).
BlockLines = list[list[int]]
# One entry per chunk, in the chunks' order; [] where the block has no text or nothing was found.
PageLines = list[BlockLines]

# Blocks whose content is not text printed on the page (a figure's description) get no text layer.
_NO_TEXT = frozenset({"Image", "Figure", "Blank-Page"})
_MATH = frozenset({"Equation", "Formula"})
_FONT_NAME = "ChandradInvisible"
# The glyph's advance, its ascent and descent (1/1000 em): glyph boxes are 0.8 em above the
# baseline and 0.2 em below, so a line whose font size is its height has boxes that are its box.
_ADVANCE, _ASCENT, _DESCENT = 500, 800, -200
_SLOPE = 10000  # a line's slope is stored as an integer: dy/dx times this
_WORDS = 6  # index of a line's first word x in BlockLines


# -- the block's words -----------------------------------------------------------------------------


def block_tokens(chunk: dict[str, Any]) -> list[str]:
    """The block's words in reading order, as the text layer carries them: a table's cell by cell,
    math as its LaTeX source; [] for blocks that are not text (figures, blank pages)."""
    if chunk.get("label") in _NO_TEXT:
        return []
    soup = BeautifulSoup(chunk.get("content", ""), "html.parser")
    for image in soup.find_all("img"):
        image.decompose()
    return soup.get_text(" ").split()


def _is_math(chunk: dict[str, Any]) -> bool:
    return chunk.get("label") in _MATH


# -- lines and words from the page image ---------------------------------------------------------


def page_text_lines(
    image: Image.Image, chunks: list[dict[str, Any]], html: str | None = None, *, words: bool = True
) -> PageLines:
    """Each text block's lines (and, with ``words``, each word's x-range) on the page image.

    ``chunks`` are ``chandra.output.parse_chunks(html, image)``. Where ``html`` carries the
    engine's own word boxes (the tesseract engine's ``data-lines``), those are used; elsewhere
    the block's pixels are segmented. Blocking (≈ tens of ms per page): run it in a thread.
    """
    exact = _exact_lines(html, len(chunks)) if html else [None] * len(chunks)
    result: PageLines = [[] for _ in chunks]
    todo: list[tuple[int, list[str], np.ndarray, int, int]] = []
    gray: np.ndarray | None = None
    for index, (chunk, known) in enumerate(zip(chunks, exact, strict=True)):
        tokens = block_tokens(chunk)
        if not tokens:
            continue
        if known is not None and sum(line[4] for line in known) == len(tokens):
            result[index] = known if words else [line[:_WORDS] for line in known]
            continue
        if gray is None:
            gray = np.asarray(image.convert("L"))
        x0, y0, x1, y1 = (max(0, int(v)) for v in chunk["bbox"])
        ink = _ink(gray[y0:y1, x0:x1])
        if ink is not None:
            todo.append((index, tokens, ink, x0, y0))
    if not todo:
        return result
    # One skew for the page, measured on its largest blocks: a scan is skewed as a whole.
    slope = _estimate_slope([ink for _, _, ink, _, _ in sorted(todo, key=lambda t: -t[2].size)[:3]])
    for index, tokens, ink, x0, y0 in todo:
        lines = _segment(ink, slope)
        if lines:
            align = words and not _is_math(chunks[index])
            result[index] = _place_tokens(tokens, lines, x0, y0, slope, ink.shape[1], align)
    return result


def _exact_lines(html: str, count: int) -> list[BlockLines | None]:
    """The engine's own boxes, per top-level block as ``parse_chunks`` lists them (Blank-Page skipped)."""
    soup = BeautifulSoup(html, "html.parser")
    divs = [div for div in soup.find_all("div", recursive=False) if div.get("data-label") != "Blank-Page"]
    if len(divs) != count:
        return [None] * count
    found: list[BlockLines | None] = []
    for div in divs:
        raw = div.get("data-lines") if isinstance(div, Tag) else None
        if not isinstance(raw, str) or not raw.strip():
            found.append(None)
            continue
        try:
            found.append([[int(v) for v in line.split()] for line in raw.split(",") if line.strip()])
        except ValueError:
            found.append(None)
    return found


@dataclass
class _Line:
    y0: int  # top and bottom in the block's deskewed rows (see _shear)
    y1: int
    words: list[tuple[int, int]]  # ink clusters that look like words: (x0, x1), left to right
    edge: bool = False  # cut by the block's top or bottom: likely a neighbour's line (skew, loose boxes)


def _ink(crop: np.ndarray) -> np.ndarray | None:
    """The block's dark pixels (Otsu's threshold on its histogram), or None if it holds no ink."""
    if crop.size == 0:
        return None
    hist = np.bincount(crop.ravel(), minlength=256).astype(np.float64)
    total = hist.sum()
    levels = np.arange(256, dtype=np.float64)
    weight = np.cumsum(hist)
    mass = np.cumsum(hist * levels)
    background = total - weight
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (mass[-1] * weight - mass * total) ** 2 / (weight * background)
    between[~np.isfinite(between)] = 0
    threshold = int(np.argmax(between))
    low, high = int(crop.min()), int(crop.max())
    if high - low < 48:
        return None  # flat: no text here
    ink: np.ndarray = crop <= threshold
    if ink.mean() > 0.5:
        ink = ~ink  # light text on a dark ground
    return ink


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-D mask, end exclusive."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


_STRIPE = 16  # columns sheared together when deskewing


def _shifts(width: int, slope: float) -> np.ndarray:
    """Per stripe of columns, how many rows it is moved up to undo the skew (relative to the lowest)."""
    centres = np.arange(0, width, _STRIPE) + _STRIPE / 2
    shifts: np.ndarray = np.round(slope * centres).astype(np.int64)
    return shifts - int(shifts.min())


def _shear(ink: np.ndarray, slope: float) -> np.ndarray:
    """The block with each stripe of columns moved up by its shift, so skewed lines become rows:
    deskewed row r of stripe k is block row r - max(shifts) + shifts[k] (see ``_block_row``)."""
    if slope == 0:
        return ink
    height, width = ink.shape
    shifts = _shifts(width, slope)
    top = int(shifts.max())
    out = np.zeros((height + top, width), dtype=bool)
    for k, shift in enumerate(shifts):
        start = k * _STRIPE
        out[top - shift : top - shift + height, start : start + _STRIPE] = ink[:, start : start + _STRIPE]
    return out


def _block_row(row: int, x: int, slope: float, width: int) -> int:
    """The block row of deskewed row ``row`` at column ``x``."""
    if slope == 0:
        return row
    shifts = _shifts(width, slope)
    return row - int(shifts.max()) + int(shifts[min(x // _STRIPE, len(shifts) - 1)])


def _estimate_slope(blocks: list[np.ndarray]) -> float:
    """The skew (dy/dx) that makes the blocks' row profiles sharpest, within ±5°, to 0.1°."""
    profiles = []
    for ink in blocks:
        height, width = ink.shape
        if height < 8 or width < 4 * _STRIPE:
            continue
        stripes = np.add.reduceat(ink, np.arange(0, width, _STRIPE), axis=1).T.astype(np.float64)
        centres = np.arange(0, width, _STRIPE) + _STRIPE / 2
        profiles.append((stripes, centres, height))
    if not profiles:
        return 0.0

    def score(slope: float) -> float:
        total = 0.0
        for stripes, centres, height in profiles:
            shifts = np.round(slope * centres).astype(np.int64)
            shifts -= shifts.min()
            rows = (np.arange(height)[None, :] - shifts[:, None] + int(shifts.max())).ravel()
            profile = np.bincount(rows, weights=stripes.ravel())
            total += float(np.square(np.diff(profile)).sum())
        return total

    best = max(np.arange(-5.0, 5.01, 0.5), key=lambda angle: score(math.tan(math.radians(angle))))
    best = max(np.arange(best - 0.4, best + 0.41, 0.1), key=lambda angle: score(math.tan(math.radians(angle))))
    return 0.0 if abs(best) < 0.05 else math.tan(math.radians(float(best)))


def _segment(ink: np.ndarray, slope: float) -> list[_Line]:
    """Lines (row profile) and word-like clusters (column profile, gaps) of one block, deskewed."""
    block_height = ink.shape[0]
    ink = _shear(ink, slope)
    _height, width = ink.shape
    shifts = _shifts(width, slope) if slope else np.zeros(len(range(0, width, _STRIPE)), dtype=np.int64)
    region_top = int(shifts.max()) - shifts  # the block's first row, per stripe, in deskewed rows
    rows = ink.sum(axis=1)
    bands = _runs(rows > max(1, width // 500))
    if not bands:
        return []
    bands = _split_tall(bands, rows)
    bands = [(a, b) for a, b in bands if rows[a:b].max() > max(1, width // 500)]
    tall = sorted(b - a for a, b in bands)
    typical = tall[len(tall) * 3 // 4] if tall else 1
    lines: list[_Line] = []
    for a, b in bands:
        if b - a < max(2, typical * 0.35):
            continue  # specks, rules, the dots of a line's i's: no line of their own
        columns: np.ndarray = np.asarray(ink[a:b].any(axis=0))
        clusters = _runs(columns)
        if not clusters:
            continue
        gap_min = max(2, round((b - a) * 0.22))
        merged = [clusters[0]]
        for x0, x1 in clusters[1:]:
            if x0 - merged[-1][1] < gap_min:
                merged[-1] = (merged[-1][0], x1)
            else:
                merged.append((x0, x1))
        stripes = slice(merged[0][0] // _STRIPE, merged[-1][1] // _STRIPE + 1)
        edge = a <= int(region_top[stripes].max()) + 1 or b >= int(region_top[stripes].min()) + block_height - 1
        lines.append(_Line(a, b, merged, edge))
    return lines


def _split_tall(bands: list[tuple[int, int]], rows: np.ndarray) -> list[tuple[int, int]]:
    """Split bands that hold several lines (touching by descenders and ascenders, or joined by a
    little skew) at their row profile's valleys: a row much emptier than the peaks on both sides."""
    smooth = np.convolve(rows.astype(np.float64), np.ones(3) / 3, mode="same")
    out: list[tuple[int, int]] = []
    stack = list(reversed(bands))
    while stack:
        a, b = stack.pop()
        if b - a < 12:
            out.append((a, b))
            continue
        inner = smooth[a + 4 : b - 4]
        left_peak = np.maximum.accumulate(smooth[a : b - 4])[3:-1] if b - a > 8 else inner
        right_peak = np.maximum.accumulate(smooth[a + 4 : b][::-1])[::-1][1:-3] if b - a > 8 else inner
        size = min(len(inner), len(left_peak), len(right_peak))
        if size <= 0:
            out.append((a, b))
            continue
        depth = inner[:size] / np.maximum(np.minimum(left_peak[:size], right_peak[:size]), 1e-9)
        k = int(np.argmin(depth))
        if depth[k] > 0.3:
            out.append((a, b))
            continue
        cut = a + 4 + k
        stack.extend([(cut + 1, b), (a, cut)])
    return out


def _place_tokens(
    tokens: list[str], lines: list[_Line], ox: int, oy: int, slope: float, width: int, align: bool
) -> BlockLines:
    """Give each token a line (and with ``align`` an x-range), in page pixels."""
    spans = _align(tokens, lines) if align else _by_length(tokens, lines)
    out: BlockLines = []
    for index, line in enumerate(lines):
        mine = [(t, span) for t, (li, span) in enumerate(spans) if li == index]
        if not mine:
            continue
        x0 = line.words[0][0]
        x1 = line.words[-1][1]
        top, bottom = _block_row(line.y0, x0, slope, width), _block_row(line.y1, x0, slope, width)
        entry = [ox + x0, oy + top, ox + x1, oy + bottom, len(mine), round(slope * _SLOPE)]
        if align:
            for _, (a, b) in mine:
                entry += [ox + a, ox + b]
        out.append(entry)
    return out


def _by_length(tokens: list[str], lines: list[_Line]) -> list[tuple[int, tuple[int, int]]]:
    """Tokens to lines in proportion to each line's ink width (no word boxes)."""
    widths = [line.words[-1][1] - line.words[0][0] for line in lines]
    total_w = sum(widths) or 1
    chars = [len(t) + 1 for t in tokens]
    total_c = sum(chars)
    bounds = np.cumsum(widths) / total_w
    out = []
    position = 0.0
    for count in chars:
        centre = (position + count / 2) / total_c
        index = min(int(np.searchsorted(bounds, centre)), len(lines) - 1)
        out.append((index, (0, 0)))
        position += count
    return out


_MERGES = ((1, 1), (2, 1), (3, 1), (1, 2), (1, 3))


def _align(tokens: list[str], lines: list[_Line]) -> list[tuple[int, tuple[int, int]]]:
    """Monotone alignment of tokens to word clusters: (line, (x0, x1)) per token, block-relative.

    Costs: |log(width / predicted width)| per match, where the prediction is the token's length
    times the block's width per character; joining several tokens into one cluster (words set
    close) or one token over several clusters (a word set wide) costs a little more; a token no
    cluster matches, or a cluster no token matches, costs a fixed amount. Vectorised over clusters.
    """
    clusters = [(li, a, b) for li, line in enumerate(lines) for a, b in line.words]
    n, m = len(tokens), len(clusters)
    lengths = np.array([len(t) for t in tokens], dtype=np.float64)
    starts = np.array([c[1] for c in clusters], dtype=np.float64)
    ends = np.array([c[2] for c in clusters], dtype=np.float64)
    line_of = np.array([c[0] for c in clusters])
    heights = np.array([lines[c[0]].y1 - lines[c[0]].y0 for c in clusters], dtype=np.float64)
    per_char = max((ends - starts).sum() / max(lengths.sum(), 1.0), 1.0)
    space = per_char * 0.9
    big = 1e9
    # span[b][j]: width of clusters j-b+1..j when on one line, else inf
    span: dict[int, np.ndarray] = {}
    for b in (1, 2, 3):
        width = np.full(m, np.inf)
        if m >= b:
            same = line_of[b - 1 :] == line_of[: m - b + 1]
            width[b - 1 :] = np.where(same, ends[b - 1 :] - starts[: m - b + 1], np.inf)
        span[b] = width
    cum = np.concatenate(([0.0], np.cumsum(lengths)))
    skip_token, skip_cluster = 1.2, 0.9
    small = np.minimum((ends - starts) / np.maximum(heights, 1.0), 1.0)  # specks are cheap to skip
    small *= np.array([0.15 if lines[c[0]].edge else 1.0 for c in clusters])  # so are a neighbour's lines
    cost = np.full((n + 1, m + 1), big)
    move = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 start, 1..5 merges, 6 skip token, 7 skip cluster
    cost[0, 0] = 0.0
    cluster_skip = np.concatenate(([0.0], np.cumsum(skip_cluster * small)))
    cost[0, 1:] = cluster_skip[1:]
    move[0, 1:] = 7
    for i in range(1, n + 1):
        row = np.full(m + 1, big)
        choice = np.zeros(m + 1, dtype=np.int8)
        row[0] = cost[i - 1, 0] + skip_token
        choice[0] = 6
        skipped = cost[i - 1, :] + skip_token
        better = skipped < row
        row[better], choice[better] = skipped[better], 6
        for k, (a, b) in enumerate(_MERGES, start=1):
            if i < a:
                continue
            predicted = (cum[i] - cum[i - a]) * per_char + (a - 1) * space
            width = span[b]
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.abs(np.log(np.maximum(width, 1.0) / max(predicted, 1.0)))
            step = np.where(np.isfinite(width), step, big) + 0.35 * (a - 1) + 0.5 * (b - 1)
            candidate = np.full(m + 1, big)
            candidate[b:] = cost[i - a, : m + 1 - b] + step[b - 1 :]
            better = candidate < row
            row[better], choice[better] = candidate[better], k
        # a cluster no token matches: row[j] from row[j-1] (left to right, so it chains)
        skip_costs = skip_cluster * small
        for j in range(1, m + 1):
            value = row[j - 1] + skip_costs[j - 1]
            if value < row[j]:
                row[j], choice[j] = value, 7
        cost[i], move[i] = row, choice
    # back-track
    assigned: list[tuple[int, int, int] | None] = [None] * n  # (first cluster, last cluster, share index)
    shares: list[tuple[int, int]] = [(0, 1)] * n
    i, j = n, m
    while i > 0 or j > 0:
        k = int(move[i, j])
        if k == 7:
            j -= 1
        elif k == 6:
            i -= 1
        else:
            a, b = _MERGES[k - 1]
            for s in range(a):
                assigned[i - a + s] = (j - b, j - 1, s)
                shares[i - a + s] = (s, a)
            i, j = i - a, j - b
    return _spans(tokens, assigned, shares, clusters, lines, per_char)


def _spans(
    tokens: list[str],
    assigned: list[tuple[int, int, int] | None],
    shares: list[tuple[int, int]],
    clusters: list[tuple[int, int, int]],
    lines: list[_Line],
    per_char: float,
) -> list[tuple[int, tuple[int, int]]]:
    """Token x-ranges from the alignment: a cluster shared by k tokens is cut by their lengths; a
    token without a cluster goes after its left neighbour (or before its right one)."""
    out: list[tuple[int, tuple[int, int]] | None] = [None] * len(tokens)
    for t, place in enumerate(assigned):
        if place is None:
            continue
        first, last, _ = place
        line = clusters[first][0]
        x0, x1 = clusters[first][1], clusters[last][2]
        share, count = shares[t]
        if count > 1:
            group = range(t - share, t - share + count)
            weights = [len(tokens[g]) + (0.9 if g != group[-1] else 0) for g in group]
            total = sum(weights)
            before = sum(weights[:share])
            a = x0 + (x1 - x0) * before / total
            b = x0 + (x1 - x0) * (before + len(tokens[t])) / total
            x0, x1 = round(a), max(round(b), round(a) + 1)
        out[t] = (line, (x0, x1))
    for t in range(len(tokens)):
        if out[t] is not None:
            continue
        width = max(1, round(len(tokens[t]) * per_char))
        left = next((out[s] for s in range(t - 1, -1, -1) if out[s] is not None), None)
        if left is not None:
            line, (_, end) = left
            limit = lines[line].words[-1][1]
            a = min(end + round(per_char), limit - 1)
            out[t] = (line, (a, max(a + 1, min(a + width, limit))))
            continue
        right = next((out[s] for s in range(t + 1, len(tokens)) if out[s] is not None), None)
        line, (start, _) = right if right is not None else (0, (lines[0].words[0][0], 0))
        begin = lines[line].words[0][0]
        b = max(start - round(per_char), begin + 1)
        out[t] = (line, (max(begin, b - width), b))
    return [entry for entry in out if entry is not None]


def _estimated_lines(tokens: list[str], bbox: Sequence[float]) -> BlockLines:
    """Lines for a block whose pixels were not looked at: the text set in lines of equal height
    that fill the box (characters half as wide as the font is high, lines 1.2 font sizes apart)."""
    x0, y0, x1, y1 = (float(v) for v in bbox)
    width, height = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
    chars = sum(len(t) + 1 for t in tokens)
    font = math.sqrt(width * height / (0.6 * max(chars, 1)))
    count = max(1, min(len(tokens), round(height / (1.2 * font))))
    pitch = height / count
    per_line = chars / count
    out: BlockLines = []
    position, start = 0.0, 0
    for index in range(count):
        end = start
        while end < len(tokens) and (position + len(tokens[end]) / 2 < per_line * (index + 1) or index == count - 1):
            position += len(tokens[end]) + 1
            end += 1
        if end > start:
            top = y0 + index * pitch
            out.append([round(x0), round(top), round(x1), round(top + pitch * 0.9), end - start, 0])
        start = end
    return out


# -- the glyphless font ------------------------------------------------------------------------------


def _checksum(data: bytes) -> int:
    data += b"\0" * (-len(data) % 4)
    return int(sum(struct.unpack(f">{len(data) // 4}I", data))) & 0xFFFFFFFF


@cache
def glyphless_font() -> bytes:
    """A TrueType font of two empty glyphs (.notdef and one every code maps to), 0.5 em wide.

    Written here rather than shipped: 752 bytes of tables that a viewer (FreeType, pdf.js) and a
    PDF/A validator need, no outlines. Text in it draws nothing in any render mode.
    """
    names = {1: _FONT_NAME, 2: "Regular", 3: f"chandrad:{_FONT_NAME}", 4: _FONT_NAME, 5: "Version 1.0", 6: _FONT_NAME}
    records, strings = b"", b""
    for name_id, text in names.items():
        encoded = text.encode("utf-16-be")
        records += struct.pack(">6H", 3, 1, 0x409, name_id, len(encoded), len(strings))
        strings += encoded
    adv, asc, desc = _ADVANCE, _ASCENT, _DESCENT
    os2 = struct.pack(
        ">HhHHHhhhhhhhhhhh10sIIII4sHHHhhhHHIIhhHHH",
        *(4, adv, 400, 5, 0, 650, 600, 0, 75, 650, 600, 0, 350, 50, 300, 0, bytes(10), 0, 0, 0, 0, b"NONE"),
        *(0x40, 0x20, 0x20, asc, desc, 0, asc, -desc, 1, 0, 500, 700, 0, 0x20, 1),
    )
    cmap = (
        struct.pack(">HHHHI", 0, 1, 3, 1, 12)
        + struct.pack(">7H", 4, 32, 0, 4, 4, 1, 0)
        + struct.pack(">2H", 0x20, 0xFFFF)
        + b"\0\0"
        + struct.pack(">2H", 0x20, 0xFFFF)
        + struct.pack(">2h", 1 - 0x20, 1)
        + struct.pack(">2H", 0, 0)
    )
    tables = {
        b"OS/2": os2,
        b"cmap": cmap,
        b"glyf": b"",
        b"head": struct.pack(
            ">IIIIHHqqhhhhHHhhh",
            0x00010000,
            0x00010000,
            0,
            0x5F0F3CF5,
            0x000B,
            1000,
            0,
            0,
            0,
            desc,
            adv,
            asc,
            *(0, 8, 2, 0, 0),
        ),
        b"hhea": struct.pack(">IhhhHhhhhhhhhhhhH", 0x00010000, asc, desc, 0, adv, *([0] * 3), 1, *([0] * 7), 2),
        b"hmtx": struct.pack(">HhHh", adv, 0, adv, 0),
        b"loca": struct.pack(">3H", 0, 0, 0),
        b"maxp": struct.pack(">IHHHHHHHHHHHHHH", 0x00010000, 2, 0, 0, 0, 0, 2, *([0] * 8)),
        b"name": struct.pack(">3H", 0, len(names), 6 + 12 * len(names)) + records + strings,
        b"post": struct.pack(">IIhhIIIII", 0x00030000, 0, -100, 50, 1, 0, 0, 0, 0),
    }
    count = len(tables)
    power = count.bit_length() - 1
    header = struct.pack(">IHHHH", 0x00010000, count, 16 << power, power, count * 16 - (16 << power))
    offset = 12 + 16 * count
    directory, body, head_at = b"", b"", 0
    for tag in sorted(tables):
        data = tables[tag]
        if tag == b"head":
            head_at = offset + len(body)
        directory += struct.pack(">4sIII", tag, _checksum(data), offset + len(body), len(data))
        body += data + b"\0" * (-len(data) % 4)
    font = bytearray(header + directory + body)
    font[head_at + 8 : head_at + 12] = struct.pack(">I", (0xB1B0AFBA - _checksum(bytes(font))) & 0xFFFFFFFF)
    return bytes(font)


def _to_unicode_cmap() -> bytes:
    """Code = UTF-16 code unit = Unicode (BMP), as ranges that each vary only in their last byte."""
    ranges = [f"<{hi:02X}00> <{hi:02X}FF> <{hi:02X}00>" for hi in range(256)]
    sections = []
    for start in range(0, 256, 100):
        chunk = ranges[start : start + 100]
        sections.append(f"{len(chunk)} beginbfrange\n" + "\n".join(chunk) + "\nendbfrange")
    return (
        "/CIDInit /ProcSet findresource begin\n12 dict begin\nbegincmap\n"
        "/CIDSystemInfo << /Registry (Adobe) /Ordering (UCS) /Supplement 0 >> def\n"
        "/CMapName /Adobe-Identity-UCS def\n/CMapType 2 def\n"
        "1 begincodespacerange\n<0000> <FFFF>\nendcodespacerange\n"
        + "\n".join(sections)
        + "\nendcmap\nCMapName currentdict /CMap defineresource pop\nend\nend\n"
    ).encode("ascii")


def _add_font(pdf: Pdf) -> pikepdf.Object:
    """The glyphless font as a Type0/CIDFontType2 font: every CID drawn with glyph 1 (never .notdef)."""
    descriptor = pdf.make_indirect(
        Dictionary(
            Type=Name.FontDescriptor,
            FontName=Name("/" + _FONT_NAME),
            Flags=5,  # fixed pitch, symbolic
            FontBBox=[0, _DESCENT, _ADVANCE, _ASCENT],
            ItalicAngle=0,
            Ascent=_ASCENT,
            Descent=_DESCENT,
            CapHeight=700,
            StemV=80,
            FontFile2=pdf.make_stream(zlib.compress(glyphless_font()), Filter=Name.FlateDecode),
        )
    )
    cid_font = pdf.make_indirect(
        Dictionary(
            Type=Name.Font,
            Subtype=Name.CIDFontType2,
            BaseFont=Name("/" + _FONT_NAME),
            CIDSystemInfo=Dictionary(Registry="Adobe", Ordering="Identity", Supplement=0),
            FontDescriptor=descriptor,
            DW=_ADVANCE,
            CIDToGIDMap=pdf.make_stream(zlib.compress(b"\x00\x01" * 65536, 9), Filter=Name.FlateDecode),
        )
    )
    return pdf.make_indirect(
        Dictionary(
            Type=Name.Font,
            Subtype=Name.Type0,
            BaseFont=Name("/" + _FONT_NAME),
            Encoding=Name("/Identity-H"),
            DescendantFonts=[cid_font],
            ToUnicode=pdf.make_stream(zlib.compress(_to_unicode_cmap()), Filter=Name.FlateDecode),
        )
    )


def _encode(text: str) -> bytes:
    """UTF-16BE code units; characters beyond the BMP become U+FFFD (the code space is two bytes)."""
    return "".join(c if ord(c) < 0x10000 and not 0xD800 <= ord(c) < 0xE000 else "\ufffd" for c in text).encode(
        "utf-16-be"
    )


# -- the page's geometry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frame:
    """Page-image pixels → user space for one page: the rendered box and the page's /Rotate."""

    box: tuple[float, float, float, float]
    rotate: int
    width: int
    height: int

    def point(self, px: float, py: float) -> tuple[float, float]:
        u, v = px / self.width, py / self.height
        x0, y0, x1, y1 = self.box
        bw, bh = x1 - x0, y1 - y0
        if self.rotate == 90:
            return x0 + v * bw, y0 + u * bh
        if self.rotate == 180:
            return x1 - u * bw, y0 + v * bh
        if self.rotate == 270:
            return x1 - v * bw, y1 - u * bh
        return x0 + u * bw, y1 - v * bh


def _inherited(page: pikepdf.Object, key: str) -> Any:
    node: Any = page
    for _ in range(64):
        if node is None:
            return None
        if key in node:
            return node[key]
        node = node.get("/Parent")
    return None


def _page_frame(page: pikepdf.Object, width: int, height: int) -> _Frame:
    """What the page image shows: the CropBox within the MediaBox, as PDFium (prepare's renderer) renders."""
    media = _inherited(page, "/MediaBox")
    box = [float(v) for v in media] if media is not None and len(media) == 4 else [0.0, 0.0, 612.0, 792.0]
    x0, x1 = sorted(box[0::2])
    y0, y1 = sorted(box[1::2])
    crop = _inherited(page, "/CropBox")
    if crop is not None and len(crop) == 4:
        cx0, cx1 = sorted(float(v) for v in crop[0::2])
        cy0, cy1 = sorted(float(v) for v in crop[1::2])
        if min(cx1, x1) > max(cx0, x0) and min(cy1, y1) > max(cy0, y0):
            x0, y0, x1, y1 = max(cx0, x0), max(cy0, y0), min(cx1, x1), min(cy1, y1)
    rotate = _inherited(page, "/Rotate")
    angle = int(rotate) % 360 if rotate is not None else 0
    return _Frame((x0, y0, x1, y1), angle - angle % 90, width, height)


# -- the text layer --------------------------------------------------------------------------------------


def _words_of(tokens: list[str], lines: BlockLines) -> Iterator[tuple[list[int], list[tuple[str, float, float]]]]:
    """(line, [(word, x0, x1)]) for each line: the given x-ranges, or the words spread by length."""
    index = 0
    for line in lines:
        count = line[4]
        mine = tokens[index : index + count]
        index += count
        if not mine:
            continue
        if len(line) == _WORDS + 2 * count:
            yield line, [(t, float(line[_WORDS + 2 * k]), float(line[_WORDS + 1 + 2 * k])) for k, t in enumerate(mine)]
            continue
        x0, x1 = float(line[0]), float(line[2])
        total = sum(len(t) for t in mine) + 0.9 * (len(mine) - 1)
        unit = (x1 - x0) / max(total, 1.0)
        placed, position = [], x0
        for t in mine:
            placed.append((t, position, position + len(t) * unit))
            position += (len(t) + 0.9) * unit
        yield line, placed


@dataclass(frozen=True)
class PlacedLine:
    """One line of the text layer in page-image pixels: its block, where it starts (x0, and its top
    and bottom there), its slope, and its words' x-ranges."""

    block: int
    x0: float
    top: float
    bottom: float
    slope: float
    words: list[tuple[str, float, float]]

    def top_at(self, x: float) -> float:
        return self.top + self.slope * (x - self.x0)

    def word_box(self, a: float, b: float) -> tuple[float, float, float, float]:
        """The axis-aligned box around a word's x-range a..b on this line."""
        tops = (self.top_at(a), self.top_at(b))
        height = self.bottom - self.top
        return a, min(tops), b, max(tops) + height


def placed_lines(layer: PageLayer) -> list[PlacedLine]:
    """The text layer of one page as the PDF places it, in reading order (blocks, then lines, then words):
    the given lines and words, or lines estimated from the block's box; each inside its block's box."""
    out: list[PlacedLine] = []
    for index, chunk in enumerate(layer.chunks):
        tokens = block_tokens(chunk)
        if not tokens:
            continue
        box = [float(v) for v in chunk["bbox"]]
        known = layer.lines[index] if layer.lines is not None and index < len(layer.lines) else None
        lines = known if known and sum(line[4] for line in known) == len(tokens) else _estimated_lines(tokens, box)
        for line, words in _words_of(tokens, lines):
            top = min(max(float(line[1]), box[1]), box[3] - 1)
            bottom = max(min(float(line[3]), box[3]), top + 1)
            slope = line[5] / _SLOPE if len(line) > 5 else 0.0
            placed = []
            for word, a, b in words:
                a = min(max(a, box[0]), box[2] - 1)
                placed.append((word, a, min(max(b, a + 1), box[2])))
            out.append(PlacedLine(index, float(line[0]), top, bottom, slope, placed))
    return out


def _text_layer(frame: _Frame, layer: PageLayer, font: str) -> tuple[bytes, int]:
    """The page's invisible text as content-stream bytes, and how many words it holds."""
    builder = ContentStreamBuilder()
    builder.push()
    builder.begin_text()
    builder.set_text_rendering(3)
    builder.set_text_font(Name(font), 1)
    count = 0
    for line in placed_lines(layer):
        for k, (word, a, b) in enumerate(line.words):
            _show(builder, frame, line, word, a, b)
            count += 1
            if k + 1 < len(line.words):
                # A space glyph over the gap: extraction and copying see the word break.
                _show(builder, frame, line, " ", b, max(line.words[k + 1][1], b + 0.5))
    builder.end_text()
    builder.pop()
    return builder.build(), count


def _show(builder: ContentStreamBuilder, frame: _Frame, line: PlacedLine, text: str, a: float, b: float) -> None:
    """One string whose glyph boxes span pixels a..b of the line: baseline 4/5 down, font size its height.

    A skewed line is drawn as level words at the line's height under each word's middle: glyphs
    on one baseline are what text extraction joins into one word.
    """
    height = line.bottom - line.top
    top = line.top_at((a + b) / 2)
    baseline = top + height * _ASCENT / (_ASCENT - _DESCENT)
    origin = frame.point(a, baseline)
    end = frame.point(b, baseline)
    up = frame.point(a, top)
    low = frame.point(a, top + height)
    length = math.hypot(end[0] - origin[0], end[1] - origin[1])
    size = math.hypot(up[0] - low[0], up[1] - low[1])
    if length <= 0 or size <= 0:
        return
    dx, dy = (end[0] - origin[0]) / length, (end[1] - origin[1]) / length
    ux, uy = (up[0] - low[0]) / size, (up[1] - low[1]) / size
    encoded = _encode(text)
    scale = length / (len(encoded) / 2 * _ADVANCE / 1000)
    builder.set_text_matrix(
        Matrix(
            round(scale * dx, 3),
            round(scale * dy, 3),
            round(size * ux, 3),
            round(size * uy, 3),
            round(origin[0], 2),
            round(origin[1], 2),
        )
    )
    builder.show_text(encoded)


# -- what the original already has --------------------------------------------------------------------

_TEXT_OPS = "BT ET Tr Tj TJ ' \" q Q"


def _text_kind(page: pikepdf.Page) -> Literal["none", "invisible", "visible"]:
    """Whether the page draws text (in its content or its forms), and whether all of it is invisible."""
    seen: set[str] = set()
    _scan_text(page, seen, 0)
    if "visible" in seen:
        return "visible"
    return "invisible" if "invisible" in seen else "none"


_SHOW_TEXT = ("Tj", "TJ", "'", '"')


class _RenderMode:
    """The text render mode as a content stream sets it (``Tr``), saved and restored by ``q``/``Q``."""

    def __init__(self) -> None:
        self.mode = 0
        self._saved: list[int] = []

    def follow(self, op: str, operands: list[Any]) -> None:
        if op == "Tr" and operands:
            self.mode = int(operands[0])
        elif op == "q":
            self._saved.append(self.mode)
        elif op == "Q" and self._saved:
            self.mode = self._saved.pop()

    @property
    def invisible(self) -> bool:
        return self.mode == 3


def _scan_text(owner: Any, seen: set[str], depth: int) -> None:
    try:
        instructions = pikepdf.parse_content_stream(owner, _TEXT_OPS)
    except (pikepdf.PdfError, TypeError, ValueError):
        return
    render = _RenderMode()
    for instruction in instructions:
        operands, op = list(instruction.operands), str(instruction.operator)
        render.follow(op, operands)
        if op in _SHOW_TEXT:
            seen.add("invisible" if render.invisible else "visible")
    if depth > 4 or "visible" in seen:
        return
    resources = owner.get("/Resources") if hasattr(owner, "get") else None
    xobjects = resources.get("/XObject") if isinstance(resources, Dictionary) else None
    if isinstance(xobjects, Dictionary):
        for xobject in xobjects.values():
            if isinstance(xobject, pikepdf.Stream) and xobject.get("/Subtype") == Name.Form:
                _scan_text(xobject, seen, depth + 1)


def _strip_invisible_text(pdf: Pdf, page: pikepdf.Page) -> None:
    """Drop the page's text objects drawn in render mode 3 (another OCR's layer); nothing visible changes."""
    kept: list[Any] = []
    held: list[Any] = []
    in_text, shown_visible = False, False
    render = _RenderMode()
    for instruction in pikepdf.parse_content_stream(page):
        operands, operator = list(instruction.operands), instruction.operator
        op = str(operator)
        render.follow(op, operands)
        if not in_text:
            if op == "BT":
                in_text, held, shown_visible = True, [(operands, operator)], False
            else:
                kept.append((operands, operator))
            continue
        held.append((operands, operator))
        if op in _SHOW_TEXT and not render.invisible:
            shown_visible = True
        if op == "ET":
            in_text = False
            if shown_visible:
                kept.extend(held)
            else:
                kept.extend(instr for instr in held if str(instr[1]) in ("Tr", "q", "Q", "BT", "ET"))
    page.obj.Contents = pdf.make_stream(zlib.compress(pikepdf.unparse_content_stream(kept)), Filter=Name.FlateDecode)


def _remove_signatures(pdf: Pdf) -> bool:
    """Unsign the signature fields (their values would no longer match the rewritten bytes); True if any."""
    removed = False
    acroform = pdf.Root.get("/AcroForm")
    if isinstance(acroform, Dictionary):
        stack = list(acroform.get("/Fields", Array()))
        visited: set[tuple[int, int]] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node, Dictionary):
                continue
            if node.is_indirect:
                if node.objgen in visited:
                    continue
                visited.add(node.objgen)
            if node.get("/FT") == Name.Sig and "/V" in node:
                del node["/V"]
                removed = True
            stack.extend(node.get("/Kids", Array()))
        if "/SigFlags" in acroform:
            removed = removed or bool(int(acroform.SigFlags) & 1)
            del acroform["/SigFlags"]
    if "/Perms" in pdf.Root:
        del pdf.Root["/Perms"]
        removed = True
    return removed


# -- PDF/A -------------------------------------------------------------------------------------------------


def _srgb_profile() -> bytes:
    """An sRGB ICC profile (class mntr, v4), made by littleCMS through Pillow: nothing to ship or find."""
    return bytes(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())


def _pdfa_blockers(pdf: Pdf) -> list[str]:
    """What in the original keeps the file from being PDF/A-2b without changing its pages; [] if nothing.

    Looked at: fonts not embedded, DeviceCMYK without a CMYK output intent, images to be
    interpolated, annotations that do not print, JavaScript, launch actions, embedded files, XFA.
    """
    problems: set[str] = set()
    intents = pdf.Root.get("/OutputIntents", Array())
    cmyk_intent = any(
        isinstance(i, Dictionary) and i.get("/DestOutputProfile") is not None and i.DestOutputProfile.get("/N") == 4
        for i in intents
    )
    names = pdf.Root.get("/Names")
    if isinstance(names, Dictionary):
        if "/EmbeddedFiles" in names:
            problems.add("it has embedded files")
        if "/JavaScript" in names:
            problems.add("it has JavaScript")
    acroform = pdf.Root.get("/AcroForm")
    if isinstance(acroform, Dictionary) and "/XFA" in acroform:
        problems.add("it has an XFA form")
    for action_owner in (pdf.Root.get("/OpenAction"), pdf.Root.get("/AA")):
        if isinstance(action_owner, Dictionary) and action_owner.get("/S") in (Name.JavaScript, Name.Launch):
            problems.add("it runs an action when opened")
    for number, page in enumerate(pdf.pages, start=1):
        for annot in page.obj.get("/Annots", Array()):
            if not isinstance(annot, Dictionary) or annot.get("/Subtype") in (Name.Popup, Name.Link):
                continue
            flags = int(annot.get("/F", 0))
            if "/AP" not in annot or not flags & 4 or flags & (1 | 2 | 32):
                problems.add(f"page {number} has an annotation without a printable appearance")
        for problem in _resource_problems(page.obj.get("/Resources"), cmyk_intent, 0, set()):
            problems.add(f"page {number}: {problem}")
        if not cmyk_intent:
            try:
                uses_cmyk = bool(pikepdf.parse_content_stream(page, "k K"))
            except pikepdf.PdfError:
                uses_cmyk = False
            if uses_cmyk:
                problems.add(f"page {number} paints in DeviceCMYK")
    return sorted(problems)


def _resource_problems(resources: Any, cmyk_intent: bool, depth: int, visited: set[tuple[int, int]]) -> Iterator[str]:
    if not isinstance(resources, Dictionary) or depth > 6:
        return
    if resources.is_indirect:
        if resources.objgen in visited:
            return
        visited.add(resources.objgen)
    fonts = resources.get("/Font")
    if isinstance(fonts, Dictionary):
        for name, font in fonts.items():
            if isinstance(font, Dictionary) and not _font_embedded(font):
                yield f"font {font.get('/BaseFont', name)} is not embedded"
    xobjects = resources.get("/XObject")
    if isinstance(xobjects, Dictionary):
        for xobject in xobjects.values():
            if not isinstance(xobject, pikepdf.Stream):
                continue
            if xobject.get("/Subtype") == Name.Image:
                if bool(xobject.get("/Interpolate", False)):
                    yield "an image is marked for interpolation"
                if not cmyk_intent and _is_cmyk(xobject.get("/ColorSpace")):
                    yield "an image is in DeviceCMYK"
            elif xobject.get("/Subtype") == Name.Form:
                yield from _resource_problems(xobject.get("/Resources"), cmyk_intent, depth + 1, visited)


def _is_cmyk(space: Any) -> bool:
    if space == Name.DeviceCMYK:
        return True
    if isinstance(space, Array) and len(space) >= 2 and space[0] == Name.Indexed:
        return bool(space[1] == Name.DeviceCMYK)
    return False


def _font_embedded(font: Dictionary) -> bool:
    if font.get("/Subtype") == Name.Type3:
        return True
    if font.get("/Subtype") == Name.Type0:
        descendants = font.get("/DescendantFonts", Array())
        return all(isinstance(d, Dictionary) and _font_embedded(d) for d in descendants)
    descriptor = font.get("/FontDescriptor")
    return isinstance(descriptor, Dictionary) and any(
        k in descriptor for k in ("/FontFile", "/FontFile2", "/FontFile3")
    )


def _make_pdfa(pdf: Pdf) -> None:
    """PDF/A-2b identification (XMP, kept in step with the Info dictionary) and an sRGB output intent."""
    intents = pdf.Root.get("/OutputIntents")
    has_pdfa_intent = isinstance(intents, Array) and any(
        isinstance(i, Dictionary) and i.get("/S") == Name.GTS_PDFA1 for i in intents
    )
    if not has_pdfa_intent:
        profile = pdf.make_stream(_srgb_profile(), N=3)
        intent = pdf.make_indirect(
            Dictionary(
                Type=Name.OutputIntent,
                S=Name.GTS_PDFA1,
                OutputConditionIdentifier="sRGB",
                RegistryName="http://www.color.org",
                Info="sRGB IEC61966-2.1",
                DestOutputProfile=profile,
            )
        )
        if isinstance(intents, Array):
            intents.append(intent)
        else:
            pdf.Root.OutputIntents = Array([intent])
    with pdf.open_metadata(set_pikepdf_as_editor=False, update_docinfo=True) as meta:
        if not pdf.Root.get("/Metadata"):
            meta.load_from_docinfo(pdf.docinfo)
        meta["pdfaid:part"] = "2"
        meta["pdfaid:conformance"] = "B"
        meta["xmp:CreatorTool"] = "chandrad"


# -- image inputs --------------------------------------------------------------------------------------------

DEFAULT_IMAGE_DPI = 300.0  # a frame that states none (or less than 10): a scan's usual resolution

# EXIF orientations that mirror the image: img2pdf turns pages by /Rotate, which cannot mirror.
_MIRRORED = frozenset({2, 4, 5, 7})


def _frame_facts(source: Path) -> tuple[list[float], bool, bool]:
    """Each frame's DPI (the page size: pixels at this DPI), whether a frame is mirrored by its
    EXIF orientation, and whether the file has frames beyond its first that are pages (TIFF only:
    prepare reads a GIF's or an MPO's first frame alone)."""
    dpis, mirrored = [], False
    with Image.open(source) as opened:
        paged = opened.format == "TIFF"
        frames = ImageSequence.Iterator(opened) if paged else iter([opened])
        for frame in frames:
            stated = frame.info.get("dpi")
            dpi = float(stated[0]) if isinstance(stated, tuple) and stated[0] else DEFAULT_IMAGE_DPI
            dpis.append(dpi if dpi >= 10 else DEFAULT_IMAGE_DPI)
            mirrored = mirrored or int(frame.getexif().get(0x0112, 1) or 1) in _MIRRORED
    return dpis, mirrored, paged


def _upright_pngs(source: Path, paged: bool) -> list[bytes]:
    """Each frame turned upright by Pillow and stored as PNG (lossless; alpha kept): for what img2pdf
    refuses as it is (a palette with transparency, a mirroring EXIF orientation)."""
    pngs = []
    with Image.open(source) as opened:
        for frame in ImageSequence.Iterator(opened) if paged else iter([opened]):
            upright = ImageOps.exif_transpose(frame)
            if upright.mode not in ("1", "L", "LA", "RGB", "RGBA"):
                has_alpha = "A" in upright.getbands() or "transparency" in upright.info
                upright = upright.convert("RGBA" if has_alpha else "RGB")
            buffer = io.BytesIO()
            upright.save(buffer, format="PNG")
            pngs.append(buffer.getvalue())
    return pngs


def _image_document(source: Path) -> Pdf:
    """One page per frame, made by img2pdf: a JPEG's own bytes, a plain PNG's own compressed data, a
    CCITT G4 TIFF frame's own fax data; anything else losslessly as PNG data, alpha as an /SMask.
    Each page is the frame at its DPI (DEFAULT_IMAGE_DPI without one), upright through /Rotate as
    its EXIF orientation says, as prepare showed it to the model."""
    dpis, mirrored, paged = _frame_facts(source)
    sizes = iter(dpis)

    def page_at_own_dpi(width_px: int, height_px: int, _stated: Any) -> tuple[float, float, float, float]:
        # img2pdf asks frame by frame, in file order; its own default for "no DPI" is 96.
        dpi = next(sizes, DEFAULT_IMAGE_DPI)
        width_pt, height_pt = width_px * 72.0 / dpi, height_px * 72.0 / dpi
        return width_pt, height_pt, width_pt, height_pt

    options: dict[str, Any] = {
        "layout_fun": page_at_own_dpi,
        "rotation": img2pdf.Rotation.ifvalid,
        "first_frame_only": not paged,
        "nodate": True,
    }
    try:
        made = None if mirrored else img2pdf.convert(source.read_bytes(), **options)
    except (img2pdf.AlphaChannelError, img2pdf.ExifOrientationError, img2pdf.UnsupportedColorspaceError):
        made = None
    if made is None:
        sizes = iter(dpis)
        made = img2pdf.convert(_upright_pngs(source, paged), **{**options, "first_frame_only": False})
    return Pdf.open(io.BytesIO(made))


# -- the document ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageLayer:
    """What the PDF step needs of one page: the rendered page image's size (pixels), its chunks,
    their lines (``page_text_lines``, or None: then estimated from the boxes), and its error (a gap
    page gets no text)."""

    width: int
    height: int
    chunks: list[dict[str, Any]]
    lines: PageLines | None = None
    error: str | None = None


@dataclass
class PdfReport:
    """What the PDF step did, for the document's JSON and the log."""

    pages: int = 0
    words: int = 0
    text_pages: list[int] = field(default_factory=list)  # pages given a text layer
    kept_text_pages: list[int] = field(default_factory=list)  # pages whose own text was kept (no layer added)
    replaced_text_pages: list[int] = field(default_factory=list)  # another OCR's invisible text replaced
    gap_pages: list[int] = field(default_factory=list)  # pages that could not be read: no text
    pdfa: bool = False  # the file declares PDF/A-2b
    pdfa_blockers: list[str] = field(default_factory=list)  # why it does not, when PDF/A was asked for
    signature_removed: bool = False  # the original was signed; the copy's pages are the same, unsigned
    decrypted: bool = False  # the original was encrypted; the copy is not

    def as_json(self) -> dict[str, Any]:
        return {
            "pages": self.pages,
            "words": self.words,
            "text_pages": self.text_pages,
            "kept_text_pages": self.kept_text_pages,
            "replaced_text_pages": self.replaced_text_pages,
            "gap_pages": self.gap_pages,
            "pdfa": self.pdfa,
            "pdfa_blockers": self.pdfa_blockers,
            "signature_removed": self.signature_removed,
            "decrypted": self.decrypted,
        }


ASPECT_TOLERANCE = 0.05  # of the larger aspect ratio: a page image more than 5 % off is another page


class PageCountMismatch(ValueError):
    """The page results do not match the document's pages (their number, or a page's shape)."""


def searchable_base(original: Path, rendered_from: Path, password: str | None = None) -> Path:
    """The PDF to put the text on: the original when ``prepare`` rendered a Ghostscript rewrite of it
    only to flatten its form fields (lossless), so that its pages stay as they were; the rewrite when
    the original cannot be opened or does not have the rewrite's pages (repaired, lossy compress:
    the caller passes the rewrite then). Blocking."""
    if original == rendered_from:
        return original
    try:
        with Pdf.open(original, password=password or "") as first, Pdf.open(rendered_from) as second:
            if len(first.pages) != len(second.pages):
                return rendered_from
            for a, b in zip(first.pages, second.pages, strict=True):
                if abs(_aspect(a.obj) - _aspect(b.obj)) > 0.01:
                    return rendered_from
    except (pikepdf.PdfError, OSError):
        return rendered_from
    return original


def _aspect(page: pikepdf.Object) -> float:
    """The displayed page's width / height (MediaBox, /Rotate)."""
    frame = _page_frame(page, 1, 1)
    x0, y0, x1, y1 = frame.box
    width, height = (y1 - y0, x1 - x0) if frame.rotate in (90, 270) else (x1 - x0, y1 - y0)
    return width / max(height, 1e-9)


def build_searchable_pdf(
    source: Path,
    doc_type: Literal["pdf", "image"],
    pages: list[PageLayer],
    out: Path,
    *,
    pdfa: bool,
    replace_text: bool,
    password: str | None = None,
) -> PdfReport:
    """Write ``out``: ``source``'s pages with an invisible text layer from ``pages`` (one per page, in order).

    PDF inputs: every page object kept (content, images, fonts, annotations as they were); a page
    that has text of its own keeps it and gets no layer, unless ``replace_text`` and that text is
    invisible (another OCR's layer), which is then replaced. Image inputs: one page per frame.
    ``pdfa``: PDF/A-2b (XMP identification, sRGB output intent), unless the original holds what
    PDF/A forbids and only re-rendering could change (``PdfReport.pdfa_blockers`` says what).
    The output is never encrypted. Blocking: run it in a thread. Raises ``PageCountMismatch``.
    """
    report = PdfReport(pages=len(pages))
    if doc_type == "pdf":
        pdf = Pdf.open(source, password=password or "")
        report.decrypted = pdf.is_encrypted
    else:
        pdf = _image_document(source)
    with pdf:
        if len(pdf.pages) != len(pages):
            raise PageCountMismatch(f"{source.name} has {len(pdf.pages)} pages, {len(pages)} page results were given")
        report.signature_removed = doc_type == "pdf" and _remove_signatures(pdf)
        font_ref = _add_font(pdf)
        for number, (page, layer) in enumerate(zip(pdf.pages, pages, strict=True), start=1):
            if layer.error is not None:
                report.gap_pages.append(number)
                continue
            if doc_type == "pdf":
                kind = _text_kind(page)
                if kind == "visible" or (kind == "invisible" and not replace_text):
                    report.kept_text_pages.append(number)
                    continue
                if kind == "invisible":
                    _strip_invisible_text(pdf, page)
                    report.replaced_text_pages.append(number)
            if not any(block_tokens(chunk) for chunk in layer.chunks):
                continue
            frame = _page_frame(page.obj, layer.width, layer.height)
            # Relative, and loose enough for the model input's 28-pixel grid (chandra's scale_to_fit),
            # which stretches a thin strip by up to ~3 % (a 360 × 60 receipt is read at 6 132 × 1 008).
            page_aspect, image_aspect = _aspect(page.obj), layer.width / max(layer.height, 1)
            if abs(page_aspect - image_aspect) > ASPECT_TOLERANCE * max(page_aspect, image_aspect):
                raise PageCountMismatch(
                    f"page {number} is shaped {_aspect(page.obj):.3f}, its image {layer.width}×{layer.height}: "
                    f"not the page the layout was read from"
                )
            name = page.add_resource(font_ref, Name.Font, prefix="FChandrad")
            content, words = _text_layer(frame, layer, str(name))
            if words:
                _append_content(pdf, page, content)
                report.text_pages.append(number)
                report.words += words
        if pdfa:
            report.pdfa_blockers = _pdfa_blockers(pdf)
            if not report.pdfa_blockers:
                _make_pdfa(pdf)
                report.pdfa = True
        version = pdf.pdf_version
        pdf.save(
            out,
            encryption=False,
            force_version="1.7" if report.pdfa and version > "1.7" else "",
            min_version="1.5" if doc_type == "image" else "",
        )
    return report


def _append_content(pdf: Pdf, page: pikepdf.Page, content: bytes) -> None:
    """The original content wrapped in q/Q (its graphics state cannot leak into ours), then ours."""
    page.contents_add(pdf.make_stream(b"q\n"), prepend=True)
    page.contents_add(pdf.make_stream(b"\nQ\n"), prepend=False)
    page.contents_add(pdf.make_stream(zlib.compress(content), Filter=Name.FlateDecode), prepend=False)
