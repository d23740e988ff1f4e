"""A layout block's pixels → its lines and the ink clusters that look like words, deskewed.

Row projection profiles find the lines, column profiles the ink clusters of each line, the gaps
between clusters the words; ``chandrad.pdf.lines`` gives the engine's words to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class InkLine:
    """One line of a block as its pixels show it, and the ink clusters on it."""

    y0: int  # top and bottom in the block's deskewed rows (see _shear)
    y1: int
    words: list[tuple[int, int]]  # ink clusters that look like words: (x0, x1), left to right
    edge: bool = False  # cut by the block's top or bottom: likely a neighbour's line (skew, loose boxes)


def ink_mask(crop: np.ndarray) -> np.ndarray | None:
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
    deskewed row r of stripe k is block row r - max(shifts) + shifts[k] (see ``block_row``)."""
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


def block_row(row: int, x: int, slope: float, width: int) -> int:
    """The block row of deskewed row ``row`` at column ``x``."""
    if slope == 0:
        return row
    shifts = _shifts(width, slope)
    return row - int(shifts.max()) + int(shifts[min(x // _STRIPE, len(shifts) - 1)])


def estimate_slope(blocks: list[np.ndarray]) -> float:
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


def segment(ink: np.ndarray, slope: float) -> list[InkLine]:
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
    lines: list[InkLine] = []
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
        lines.append(InkLine(a, b, merged, edge))
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
