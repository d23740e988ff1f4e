"""One page's invisible text layer: where each line and word goes, and the content stream that draws it.

The text is drawn in render mode 3 with the glyphless font (``chandrad.pdf.font``), each word's
string scaled horizontally to its box, a space glyph spanning each gap so that extraction sees the
word breaks. The mapping from image pixels to user space goes through the page's CropBox within its
MediaBox (what PDFium, prepare's renderer, draws), their offsets and ``/Rotate``; ``/UserUnit``
scales both alike, so proportions suffice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pikepdf
from pikepdf import Name

from chandrad.pdf.font import ADVANCE, ASCENT, DESCENT, encode
from chandrad.pdf.lines import SLOPE_SCALE, BlockLines, PageLines, block_tokens, line_turn, line_words, turned_box

# A line this far from its block's median height is set at that height (``_usual_heights``): the
# spread of ascenders and descenders in one size of type, not a heading's larger size.
EVEN_LOW, EVEN_HIGH = 0.75, 1.25


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
    # Clockwise degrees the page image was turned upright before it was read (chandrad.scan): its
    # pixels are the displayed page's turned by that much.
    turn: int = 0


# -- the page's geometry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
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


def page_frame(page: pikepdf.Object, width: int, height: int) -> Frame:
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
    return Frame((x0, y0, x1, y1), angle - angle % 90, width, height)


def turned_frame(frame: Frame, turn: int) -> Frame:
    """The frame of a page image turned ``turn`` degrees clockwise from the displayed page: as if the
    page's /Rotate were ``turn`` more (a /Rotate turns the displayed page clockwise too)."""
    return dataclasses.replace(frame, rotate=(frame.rotate + turn) % 360)


def _line_frame(frame: Frame, turn: int) -> Frame:
    """The frame of ``frame``'s page image turned ``turn`` degrees further clockwise, where a line
    running down or up the page runs level (its numbers are in those pixels: ``pdf.lines.line_turn``)."""
    if not turn:
        return frame
    if turn == 180:
        return turned_frame(frame, turn)
    return dataclasses.replace(turned_frame(frame, turn), width=frame.height, height=frame.width)


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
        xs = line_words(line)
        if len(xs) == 2 * count:
            yield line, [(t, float(xs[2 * k]), float(xs[2 * k + 1])) for k, t in enumerate(mine)]
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
    and bottom there), its slope, and its words' x-ranges. A line running down or up the page is
    in the pixels of the page image (``size``: width, height) turned ``turn`` degrees clockwise."""

    block: int
    x0: float
    top: float
    bottom: float
    slope: float
    words: list[tuple[str, float, float]]
    turn: int = 0
    size: tuple[int, int] = (0, 0)

    def top_at(self, x: float) -> float:
        return self.top + self.slope * (x - self.x0)

    def word_box(self, a: float, b: float) -> tuple[float, float, float, float]:
        """The axis-aligned box around a word's x-range a..b on this line, on the page image."""
        tops = (self.top_at(a), self.top_at(b))
        height = self.bottom - self.top
        box = a, min(tops), b, max(tops) + height
        if not self.turn:
            return box
        width, tall = (self.size[1], self.size[0]) if self.turn in (90, 270) else self.size
        return turned_box(box, (360 - self.turn) % 360, width, tall)


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
        usual = _usual_heights(lines)
        for line, words in _words_of(tokens, lines):
            turn = line_turn(line)
            # the block's box where the line's numbers are: on the page image turned as the line
            bx0, by0, bx1, by1 = turned_box(box, turn, layer.width, layer.height)
            top = min(max(float(line[1]), by0), by1 - 1)
            bottom = max(min(float(line[3]), by1), top + 1)
            slope = line[5] / SLOPE_SCALE if len(line) > 5 else 0.0
            typical = usual.get(turn)
            if typical is not None and EVEN_LOW * typical <= float(line[3]) - float(line[1]) <= EVEN_HIGH * typical:
                # taller only as far as the block's box leaves room where a sloping line is lowest
                lowest = max(0.0, slope * (float(line[2]) - float(line[0])))
                evened = top + typical
                bottom = evened if evened <= bottom else max(bottom, min(evened, by1 - lowest))
            placed = []
            for word, a, b in words:
                a = min(max(a, bx0), bx1 - 1)
                placed.append((word, a, min(max(b, a + 1), bx1)))
            size = (layer.width, layer.height)
            out.append(PlacedLine(index, float(line[0]), top, bottom, slope, placed, turn, size))
    return out


def _usual_heights(lines: BlockLines) -> dict[int, float]:
    """The median height of a block's lines, for each turn they run at (blocks of two lines or more).

    A line's box reaches only as far as its own letters do: one without descenders is ~15 % shorter
    than the next, and its text would be drawn that much smaller. pdftotext starts a new block
    wherever two lines' sizes differ by more than 5 %: a column came out as one-line blocks, whose
    order it got wrong in text running down the page (a hyphenated word's halves apart). So a line
    of about the usual height is drawn at exactly that height, from its top (capitals and ascenders:
    nearly every line has some); a heading's larger type keeps its own.
    """
    by_turn: dict[int, list[float]] = {}
    for line in lines:
        by_turn.setdefault(line_turn(line), []).append(float(line[3]) - float(line[1]))
    return {turn: sorted(heights)[len(heights) // 2] for turn, heights in by_turn.items() if len(heights) > 1}


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


def text_layer(frame: Frame, layer: PageLayer, font: str) -> tuple[bytes, int]:
    """The page's invisible text as content-stream bytes, and how many words it holds.

    Written as text directly, the very bytes pikepdf's ContentStreamBuilder wrote: its objects a
    glyph run cost ~15 times more, and on 16 cores this step's share of the GIL bound the CPU path
    (bench/NOTES-overhead.md).
    """
    parts = ["q\nBT\n3 Tr\n", f"{Name(font).unparse().decode('ascii')} 1 Tf\n"]
    count = 0
    for line in placed_lines(layer):
        line_frame = _line_frame(frame, line.turn)
        for k, (word, a, b) in enumerate(line.words):
            parts.append(_show(line_frame, line, word, a, b))
            count += 1
            if k + 1 < len(line.words):
                # A space glyph over the gap: extraction and copying see the word break.
                parts.append(_show(line_frame, line, " ", b, max(line.words[k + 1][1], b + 0.5)))
    parts.append("ET\nQ\n")
    return "".join(parts).encode("ascii"), count


def _number(value: float) -> str:
    """A number as a content stream holds it (as qpdf writes it: no trailing zeros, "-0" kept)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _show(frame: Frame, line: PlacedLine, text: str, a: float, b: float) -> str:
    """One string whose glyph boxes span pixels a..b of the line: baseline 4/5 down, font size its
    height (its ``Tm`` and ``TJ``; nothing where the box is empty).

    A skewed line is drawn as level words at the line's height under each word's middle: glyphs
    on one baseline are what text extraction joins into one word.
    """
    height = line.bottom - line.top
    top = line.top_at((a + b) / 2)
    baseline = top + height * ASCENT / (ASCENT - DESCENT)
    origin = frame.point(a, baseline)
    end = frame.point(b, baseline)
    up = frame.point(a, top)
    low = frame.point(a, top + height)
    length = math.hypot(end[0] - origin[0], end[1] - origin[1])
    size = math.hypot(up[0] - low[0], up[1] - low[1])
    if length <= 0 or size <= 0:
        return ""
    dx, dy = (end[0] - origin[0]) / length, (end[1] - origin[1]) / length
    ux, uy = (up[0] - low[0]) / size, (up[1] - low[1]) / size
    encoded = encode(text)
    scale = length / (len(encoded) / 2 * ADVANCE / 1000)
    matrix = (
        round(scale * dx, 3),
        round(scale * dy, 3),
        round(size * ux, 3),
        round(size * uy, 3),
        round(origin[0], 2),
        round(origin[1], 2),
    )
    return f"{' '.join(map(_number, matrix))} Tm\n[ <{encoded.hex()}> ] TJ\n"
