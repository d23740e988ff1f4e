"""Each text block's lines and words on the page image, found at page time for the text layer.

``page_text_lines`` runs at page time (in a worker thread, image still in memory), because the page
image exists only while the page is at the engine: each text block's lines and words, found in the
block's own pixels (``chandrad.pdf.ink``), with the block's words given to them. A
dynamic-programming alignment (widths predicted from the word's characters, merges and splits of up
to three words, skips) gives each of the engine's words its cluster. Words the tesseract engine read
carry tesseract's own boxes (``data-lines``, see ``engine/tesseract.py``) and are taken as they are.
The result is a few integers per word, JSON as it is, to be stored with the page's chunks; the text
layer (``chandrad.pdf.layer``) is placed from it at publish time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from html import unescape
from typing import Any

import numpy as np
from bs4 import BeautifulSoup, Tag
from PIL import Image

from chandrad.pdf.ink import InkLine, block_row, estimate_slope, ink_mask, segment

# One line of a block: [x0, y0, x1, y1, n, s, wx0, wx1, wx0, wx1, ...] in page-image pixels. The
# line runs from x0 to x1; y0 and y1 are its top and bottom at x0, and it slopes by s / 10000 (a
# skewed scan). ``n`` of the block's words lie on it, in order; their x-ranges follow (2n numbers),
# or none when only the line is known (the words are then spread over it by their length). A line
# that runs down or up the page (the tesseract engine's, see ``engine/tesseract.py``) ends with one
# more number, its turn (``line_turn``): all its numbers are then on the page image turned that
# many degrees clockwise, where the line runs level.
BlockLines = list[list[int]]
# One entry per chunk, in the chunks' order; [] where the block has no text or nothing was found.
PageLines = list[BlockLines]

# Blocks whose content is not text printed on the page (a figure's description) get no text layer.
_NO_TEXT = frozenset({"Image", "Figure", "Blank-Page"})
_MATH = frozenset({"Equation", "Formula"})
SLOPE_SCALE = 10000  # a line's slope is stored as an integer: dy/dx times this
FIRST_WORD = 6  # index of a line's first word x in BlockLines


# -- the block's words -----------------------------------------------------------------------------


def turned_box(box: Sequence[float], turn: int, width: float, height: float) -> tuple[float, float, float, float]:
    """``box`` (x0 y0 x1 y1 on a ``width`` × ``height`` image) on that image turned ``turn`` clockwise."""
    x0, y0, x1, y1 = box
    if turn == 90:
        return height - y1, x0, height - y0, x1
    if turn == 270:
        return y0, width - x1, y1, width - x0
    if turn == 180:
        return width - x1, height - y1, width - x0, height - y0
    return x0, y0, x1, y1


def line_turn(line: list[int]) -> int:
    """The clockwise turn (0, 90 or 270) of the page image whose pixels ``line``'s numbers are in."""
    return line[-1] if len(line) > FIRST_WORD and (len(line) - FIRST_WORD) % 2 == 1 else 0


def line_words(line: list[int]) -> list[int]:
    """The words' x-ranges of ``line``, flat (``x0 x1 x0 x1 ...``); [] where only the line is known."""
    return line[FIRST_WORD : len(line) - (1 if line_turn(line) else 0)]


# Markup whose text needs no HTML parser: tags of text, tables and lists (no attribute holding a
# "<" or ">"), text without "<" or ">", entities. The tesseract engine's blocks are all of this kind, as
# are most of Chandra's; an image, a comment, a script, anything else goes to BeautifulSoup.
_PLAIN_MARKUP = re.compile(
    r"(?:<(?:/?(?:p|br|b|i|u|s|em|strong|sub|sup|small|span|div|h[1-6]|ul|ol|li|table|thead|tbody|tfoot"
    r"|tr|td|th|caption|math|code|pre|blockquote)\b[^<>]*)>|[^<>])*",
    re.IGNORECASE,
)
_TAG = re.compile(r"<[^<>]*>")


def block_tokens(chunk: dict[str, Any]) -> list[str]:
    """The block's words in reading order, as the text layer carries them: a table's cell by cell,
    math as its LaTeX source; [] for blocks that are not text (figures, blank pages)."""
    if chunk.get("label") in _NO_TEXT:
        return []
    content = chunk.get("content", "")
    if _PLAIN_MARKUP.fullmatch(content):
        # What BeautifulSoup's get_text(" ") gives such markup, without building its tree: three
        # times a page for every block (lines, layer, build), that parse was a share of the GIL.
        return unescape(_TAG.sub(" ", content)).split()
    soup = BeautifulSoup(content, "html.parser")
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
    # Only the tesseract engine gives boxes: a Chandra page's HTML is not parsed once more for none.
    exact = _exact_lines(html, len(chunks), image.size) if html and "data-lines" in html else [None] * len(chunks)
    result: PageLines = [[] for _ in chunks]
    todo: list[tuple[int, list[str], np.ndarray, int, int]] = []
    gray: np.ndarray | None = None
    for index, (chunk, known) in enumerate(zip(chunks, exact, strict=True)):
        tokens = block_tokens(chunk)
        if not tokens:
            continue
        if known is not None and sum(line[4] for line in known) == len(tokens):
            result[index] = known if words else [_without_words(line) for line in known]
            continue
        if gray is None:
            gray = np.asarray(image.convert("L"))
        x0, y0, x1, y1 = (max(0, int(v)) for v in chunk["bbox"])
        ink = ink_mask(gray[y0:y1, x0:x1])
        if ink is not None:
            todo.append((index, tokens, ink, x0, y0))
    if not todo:
        return result
    # One skew for the page, measured on its largest blocks: a scan is skewed as a whole.
    slope = estimate_slope([ink for _, _, ink, _, _ in sorted(todo, key=lambda t: -t[2].size)[:3]])
    for index, tokens, ink, x0, y0 in todo:
        lines = segment(ink, slope)
        if lines:
            align = words and not _is_math(chunks[index])
            result[index] = _place_tokens(tokens, lines, x0, y0, slope, ink.shape[1], align)
    return result


def _without_words(line: list[int]) -> list[int]:
    turn = line_turn(line)
    return line[:FIRST_WORD] + ([turn] if turn else [])


def _exact_lines(html: str, count: int, size: tuple[int, int]) -> list[BlockLines | None]:
    """The engine's own boxes, per top-level block as ``parse_chunks`` lists them (Blank-Page skipped);
    a line running down or up the page put on the page image turned as its last number says."""
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
            lines = [[int(v) for v in line.split()] for line in raw.split(",") if line.strip()]
        except ValueError:
            found.append(None)
            continue
        found.append([_level(line, *size) for line in lines])
    return found


def _level(line: list[int], width: int, height: int) -> list[int]:
    """A line the engine gave in page pixels, on the page image turned as ``line_turn`` says: its box
    turned, its words' ranges down the page (``y0 y1``) become ranges along it."""
    turn = line_turn(line)
    if turn not in (90, 270):
        return line
    x0, y0, x1, y1 = (round(v) for v in turned_box(line[:4], turn, width, height))
    spans = line_words(line)
    along = []
    for a, b in zip(spans[0::2], spans[1::2], strict=True):
        along += [a, b] if turn == 270 else [height - b, height - a]
    return [x0, y0, x1, y1, line[4], 0, *along, turn]


# -- the block's words given their lines and clusters -------------------------------------------


def _place_tokens(
    tokens: list[str], lines: list[InkLine], ox: int, oy: int, slope: float, width: int, align: bool
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
        top, bottom = block_row(line.y0, x0, slope, width), block_row(line.y1, x0, slope, width)
        entry = [ox + x0, oy + top, ox + x1, oy + bottom, len(mine), round(slope * SLOPE_SCALE)]
        if align:
            for _, (a, b) in mine:
                entry += [ox + a, ox + b]
        out.append(entry)
    return out


def _by_length(tokens: list[str], lines: list[InkLine]) -> list[tuple[int, tuple[int, int]]]:
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


def _align(tokens: list[str], lines: list[InkLine]) -> list[tuple[int, tuple[int, int]]]:
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
    lines: list[InkLine],
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
