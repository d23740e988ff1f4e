"""A CPU engine: tesseract's hOCR turned into Chandra-format layout blocks.

For machines without a GPU (and for tests): each tesseract text block (``ocr_carea``) becomes a
``Text`` div with its bounding box normalised to 0–1000, its paragraphs ``<p>`` elements with the
lines joined, as Chandra writes them. It reads text, not layout semantics: no tables, headers or
figures. One tesseract process per page, as many at once as there are cores.

With ``word_boxes`` each div also carries tesseract's own boxes in ``data-lines``, in pixels of
the page image: per line ``x0 y0 x1 y1 n s`` (top and bottom at x0, slope s / 10000) and its
``n`` words' ``x0 x1``, lines separated by commas, the words in the order of the div's text.
A line tesseract read running down or up the page (a margin note, a table's turned heading, a
page read as it lay sideways) gives its words' ``y0 y1`` instead, slope 0, and ends with the
clockwise turn that sets it level, 270 (read downwards) or 90 (upwards): ``pdf.lines`` turns it.
``pdf.lines.page_text_lines`` takes them as they are. ``chandra.output`` reads a div's
contents only, so the Markdown, HTML and JSON outputs never show them.
"""

from __future__ import annotations

import asyncio
import html
import io
import itertools
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET

from PIL import Image

from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from chandrad.errors import ConfigError, PermanentError, TransientError
from chandrad.priority import lower_priority

_BBOX = re.compile(r"bbox (\d+) (\d+) (\d+) (\d+)")


def _bbox(element: ET.Element) -> tuple[int, int, int, int] | None:
    match = _BBOX.search(element.get("title", ""))
    if match is None:
        return None
    x0, y0, x1, y1 = (int(v) for v in match.groups())
    return x0, y0, x1, y1


_BASELINE = re.compile(r"baseline (-?[\d.]+) (-?[\d.]+)")


# A word this many times as tall as the line's median word is not of the line's type size.
TALL_WORD = 1.8
_HAS_TEXT = re.compile(r"[^\W_]")


# A lone word of this many characters or more whose box is this many times as tall as wide runs
# down or up the page; one as wide as tall or wider lies level (set level, a word of four letters
# is about twice as wide as tall). A shorter lone word cannot tell: it goes with its block.
UPRIGHT_WORD_CHARS, UPRIGHT_WORD_RATIO = 4, 1.5


def reading_turn(boxes: list[tuple[int, int, int, int]]) -> int | None:
    """The clockwise turn (0, 90 or 270) that sets a line of words with these boxes level: 270 where
    its words follow each other down the page (text turned a quarter clockwise: a page read as it
    lay sideways), 90 where they follow each other up (a turned table heading), 0 for a level
    line. None for a lone word: one box cannot tell (``lone_word_turn``)."""
    if len(boxes) < 2:
        return None
    steps = [((b[0] + b[2] - a[0] - a[2]) / 2, (b[1] + b[3] - a[1] - a[3]) / 2) for a, b in itertools.pairwise(boxes)]
    if all(dy > abs(dx) for dx, dy in steps):
        return 270
    if all(-dy > abs(dx) for dx, dy in steps):
        return 90
    return 0


def lone_word_turn(box: tuple[int, int, int, int], text: str, block_turns: list[int]) -> int:
    """The turn of a line of one word, given the turns of its block's other lines: a long word
    standing on end runs the way the block's turned lines run (tesseract reads a line down the
    page where it knows no other way: 270); a long word lying down is level; a short one goes
    the way most of its block goes (level in a block of none)."""
    x0, y0, x1, y1 = box
    if len(text) >= UPRIGHT_WORD_CHARS:
        if (y1 - y0) > UPRIGHT_WORD_RATIO * (x1 - x0):
            turned = [turn for turn in block_turns if turn]
            return max(set(turned), key=turned.count) if turned else 270
        if (y1 - y0) <= (x1 - x0):
            return 0
    return max(set(block_turns), key=block_turns.count) if block_turns else 0


def _line_boxes(
    line: ET.Element, words: list[str], word_boxes: list[tuple[int, int, int, int]], turn: int
) -> str | None:
    """One entry of ``data-lines``: ``x0 y0 x1 y1 n s`` (top and bottom at x0, slope s / 10000, from
    hOCR's baseline) and each word's ``x0 x1``; for a line running down or up the page (``turn``
    90 or 270), its box, slope 0, each word's ``y0 y1``, and the turn last. ``word_boxes``: the
    boxes of ``words`` that have one (None unless every word has)."""
    box = _bbox(line)
    if box is None or len(word_boxes) < len(words):
        return None
    x0, y0, x1, y1 = box
    if turn:
        # tesseract's baseline of a turned line is not on the page's axes: the line is set straight
        ys = " ".join(f"{b[1]} {b[3]}" for b in word_boxes)
        return f"{x0} {y0} {x1} {y1} {len(words)} 0 {ys} {turn}"
    # The line's type size: the median height of its words with a letter or a digit (dots of a
    # leader or a lone dash are lower than the line's text), the upper one of two.
    heights = sorted(b[3] - b[1] for b, w in zip(word_boxes, words, strict=True) if _HAS_TEXT.search(w))
    usual = heights[len(heights) // 2] if heights else 0
    if usual > 0 and len(heights) > 1 and heights[-1] > TALL_WORD * usual:
        # A drop cap (or an initial) makes the line's box as tall as itself, two to four lines: a
        # text layer that tall is joined by text extraction to whatever lies beside it. The line is
        # as tall as its other words.
        kept = [b for b in word_boxes if b[3] - b[1] <= TALL_WORD * usual]
        y0, y1 = min(b[1] for b in kept), max(b[3] for b in kept)
    match = _BASELINE.search(line.get("title", ""))
    slope = float(match.group(1)) if match else 0.0
    # The bbox holds the whole skewed line; its height at one x is what the slope leaves of it.
    rise = min(abs(slope) * (x1 - x0), (y1 - y0) * 0.7)
    top, bottom = (y0, y1 - rise) if slope >= 0 else (y0 + rise, y1)
    xs = " ".join(f"{b[0]} {b[2]}" for b in word_boxes)
    return f"{x0} {round(top)} {x1} {round(bottom)} {len(words)} {round(slope * 10000)} {xs}"


# A word broken at the end of a line: a letter and its hyphen.
_BROKEN_AT_END = re.compile(r"[^\W\d_]-$")


# hOCR's classes: a block, a paragraph, a line of text (tesseract writes the last three for lines it
# sets apart), a word
_AREA, _PARAGRAPH, _WORD = frozenset({"ocr_carea"}), frozenset({"ocr_par"}), frozenset({"ocrx_word"})
_LINE_CLASSES = frozenset({"ocr_line", "ocr_caption", "ocr_textfloat", "ocr_header"})
# What XML 1.0 does not allow in a document: the one thing that could keep tesseract's hOCR from parsing.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _within(element: ET.Element, classes: frozenset[str]) -> list[ET.Element]:
    """The elements under ``element`` (at any depth, in document order) of one of ``classes``."""
    return [e for e in element.iter() if e is not element and not classes.isdisjoint(e.get("class", "").split())]


def _hocr_tree(hocr: str) -> ET.Element:
    """tesseract's hOCR as an element tree. It writes XHTML, so the C XML parser reads it: five to
    ten times faster than an HTML parser in Python, whose time a page held the GIL that every other
    page's work shares (bench/NOTES-overhead.md, 16 cores)."""
    try:
        return ET.fromstring(hocr)
    except ET.ParseError:
        pass
    try:
        return ET.fromstring(_NOT_XML.sub("", hocr))
    except ET.ParseError as error:
        raise PermanentError(f"tesseract's hOCR could not be read ({error})", stage="engine") from None


def hocr_to_chandra_html(hocr: str, width: int, height: int, word_boxes: bool = False) -> str:
    """Convert tesseract hOCR into Chandra's layout-block HTML (bbox in 0–1000 page units); with
    ``word_boxes``, each block's line and word boxes in ``data-lines`` (pixels)."""
    tree = _hocr_tree(hocr)
    blocks = []
    for area in _within(tree, _AREA):
        paragraphs: list[str] = []
        boxes: list[str | None] = []
        pars = []
        for par in _within(area, _PARAGRAPH):
            found = []
            for line in _within(par, _LINE_CLASSES):
                words, tag_boxes = [], []
                for word in _within(line, _WORD):
                    # One word, one token: whitespace inside a word (rare) would split it in the text.
                    text = "".join("".join(word.itertext()).split())
                    if text:
                        words.append(text)
                        if (box := _bbox(word)) is not None:
                            tag_boxes.append(box)
                if words:
                    turn = reading_turn(tag_boxes) if len(tag_boxes) == len(words) else 0
                    found.append((line, words, turn, tag_boxes))
            pars.append(found)
        # tesseract reads a block one way: a line of one word, which cannot tell, goes with it
        block_turns = [turn for found in pars for *_, turn, _ in found if turn is not None]
        for found in pars:
            lines = []
            for line, words, turn, tag_boxes in found:
                lines.append(" ".join(words))
                if turn is None:
                    turn = lone_word_turn(tag_boxes[0], words[0], block_turns) if tag_boxes else 0
                boxes.append(_line_boxes(line, words, tag_boxes, turn))
            if not lines:
                continue
            text = html.escape(" ".join(lines), quote=False)
            if paragraphs and _BROKEN_AT_END.search(paragraphs[-1]) and text[:1].islower():
                # A paragraph does not end inside a word: tesseract splits one where a line
                # beside a drop cap ends "organi-" and the next begins "sations".
                paragraphs[-1] += " " + text
            else:
                paragraphs.append(text)
        box = _bbox(area)
        if not paragraphs or box is None:
            continue
        x0, y0, x1, y1 = box
        scaled = (
            round(x0 * 1000 / width),
            round(y0 * 1000 / height),
            round(x1 * 1000 / width),
            round(y1 * 1000 / height),
        )
        body = "".join(f"<p>{text}</p>" for text in paragraphs)
        lines_attr = ""
        if word_boxes and boxes and all(b is not None for b in boxes):
            lines_attr = f' data-lines="{",".join(b for b in boxes if b is not None)}"'
        blocks.append(f'<div data-bbox="{" ".join(map(str, scaled))}" data-label="Text"{lines_attr}>{body}</div>')
    if not blocks:
        return '<div data-bbox="0 0 1000 1000" data-label="Blank-Page"></div>'
    return "\n".join(blocks)


def _grey_ppm(image: Image.Image) -> bytes:
    """The page in grey as PPM: uncompressed, as encoding PNG would cost more than OCR'ing it."""
    buffer = io.BytesIO()
    image.convert("L").save(buffer, format="PPM")
    return buffer.getvalue()


class TesseractEngine:
    name = "tesseract"

    def __init__(
        self,
        languages: str = "eng",
        timeout_s: float = 600.0,
        concurrency: int | None = None,
        word_boxes: bool = True,
    ) -> None:
        self.languages = languages
        self.word_boxes = word_boxes
        self.timeout_s = timeout_s
        self.model = f"tesseract:{languages}"
        self._slots = asyncio.Semaphore(concurrency or os.cpu_count() or 1)

    async def start(self) -> None:
        if shutil.which("tesseract") is None:
            raise RuntimeError("tesseract is not installed: apt-get install tesseract-ocr tesseract-ocr-eng")
        version = await self._run(["tesseract", "--version"], b"")
        self.model = f"tesseract {version.decode(errors='replace').split()[1]}:{self.languages}"
        # A blank page through the command every page runs (its resolution given: a PPM has none,
        # and tesseract would warn): a language not installed, or a tessdata without its hocr
        # config (tesseract then writes plain text), is said once, at start, instead of failing
        # every document.
        blank = _grey_ppm(Image.new("L", (64, 32), 255))
        try:
            probe = await self._run([*self._command(), "--dpi", "70"], blank)
        except PermanentError as error:
            raise ConfigError(
                f"tesseract cannot read pages in {self.languages!r} ({' '.join(error.reason.split())}); "
                "Debian: apt-get install tesseract-ocr-<lang> for each language of engine.tesseract_languages"
            ) from None
        if b"ocr_page" not in probe:
            raise ConfigError(
                "tesseract wrote no hOCR: its tessdata has no configs/hocr "
                f"(TESSDATA_PREFIX={os.environ.get('TESSDATA_PREFIX', 'unset')}); reinstall tesseract-ocr"
            )

    def _command(self) -> list[str]:
        return ["tesseract", "-", "-", "-l", self.languages, "hocr"]

    async def _run(self, args: list[str], stdin: bytes) -> bytes:
        # One thread per process: we run one process per core instead.
        env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        lower_priority(proc.pid)  # beside intake and the loop, the daemon's own threads come first
        try:
            async with asyncio.timeout(self.timeout_s):
                out, err = await proc.communicate(stdin)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise TransientError(f"tesseract took longer than {self.timeout_s:.0f} s", stage="engine") from None
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode is not None and proc.returncode < 0:
            # Killed by a signal (the OOM killer, an admin): nothing wrong with the page, try again.
            raise TransientError(f"tesseract was killed (signal {-proc.returncode})", stage="engine")
        if proc.returncode != 0:
            raise PermanentError(
                f"tesseract could not read the page: {err.decode(errors='replace').strip()[-200:]}", stage="engine"
            )
        return out

    async def ocr(self, request: PageRequest) -> PageResult:
        started = time.monotonic()
        width, height = request.image.size
        ppm = await asyncio.to_thread(_grey_ppm, request.image)  # conversions and parsing: off the event loop
        async with self._slots:
            hocr = await self._run(self._command(), ppm)
        html = await asyncio.to_thread(
            hocr_to_chandra_html, hocr.decode("utf-8", errors="replace"), width, height, self.word_boxes
        )
        return PageResult(html=html, latency_s=time.monotonic() - started)

    def status(self) -> EngineStatus:
        return EngineStatus()

    async def memory_in_use(self) -> int | None:
        return None  # no accelerator

    def stopping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
