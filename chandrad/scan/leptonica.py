"""Leptonica's text orientation test (``pixOrientDetect``), called in this process through ctypes.

Leptonica is the image library tesseract is built on (Debian installs it with tesseract-ocr).
Its test counts ascenders against descenders in the page's text lines, at 0 and at 90 degrees,
with morphology on a 1-bit copy: about 20 ms for a US-Letter page at 192 dpi, against ~0.6 s
for tesseract's OSD, which classifies characters (``bench/orientation.py`` measures both). It
either decides (``makeOrientDecision``'s own thresholds) or says it cannot; ``scan.orientation``
asks tesseract only then. Each of its two tests (across the page, and turned 90 degrees) is about
half the cost; the one along the page's text lines runs first (``_lines_run_across``: which way
the blank gaps between lines run), and the other is skipped when the first alone is beyond doubt
(``BEYOND_DOUBT``): a page of dense print, upright or lying sideways, costs one test.

It runs here, not in a child: its input is the page image chandrad itself rendered and
binarised (a well-formed 1-bit pix of bounded size), not the untrusted file, and ctypes lets
other threads run while it works (the GIL is released for the call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image

# Debian 12's liblept5 is liblept.so.5; Debian 13's libleptonica6 is libleptonica.so.6.
_LIBRARY_NAMES = ("liblept.so.5", "libleptonica.so.6", "lept", "leptonica")
# makeOrientDecision's results: L_TEXT_ORIENT_UNKNOWN, _UP, _LEFT, _DOWN, _RIGHT, as the
# clockwise turn that makes the page upright (LEFT: the text lies turned 90 counter-clockwise).
_TURN_OF = {1: 0, 2: 90, 3: 180, 4: 270}
_SEVERITY_NONE = 6  # L_SEVERITY_NONE: its own messages would go to stderr, the daemon's log
# Darker than this (of 255) is ink in the 1-bit copy: pixConvertTo1's own default threshold.
INK_BELOW = 128
# makeOrientDecision turns a page upright or upside down when |up| > 8 and > 2.5 x |left|, and
# sideways alike with the two swapped. Leptonica's notes call the up/down signal of text lying
# across the test's direction "relatively weak"; on the corpus (bench/orientation.py, 19 pages
# turned four ways) it never passed 7 in size, while ordinary print tested along its lines gave
# 11-39. At 20 the other test could overturn the answer only with 50 or more, i.e. only on a
# page holding as much text the other way as the most text-heavy page of the corpus holds, and
# more (the measure grows as the square root of the count); below 20 both tests run.
BEYOND_DOUBT = 20.0
# Every 4th row and column of the 1-bit page are enough to see which way the gaps between
# lines of text run (a line of 10 pt print at 192 dpi is ~25 rows tall).
_GAPS_SAMPLE = 4


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Leptonica, loaded once and typed; None where it is not installed."""
    for name in _LIBRARY_NAMES:
        path = name if name.startswith("lib") else ctypes.util.find_library(name)
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        try:
            lib.pixCreate.restype = ctypes.c_void_p
            lib.pixCreate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.pixGetData.restype = ctypes.c_void_p
            lib.pixGetData.argtypes = [ctypes.c_void_p]
            lib.pixGetWpl.restype = ctypes.c_int
            lib.pixGetWpl.argtypes = [ctypes.c_void_p]
            lib.pixDestroy.restype = None
            lib.pixDestroy.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.pixOrientDetect.restype = ctypes.c_int
            lib.pixOrientDetect.argtypes = [
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_float),
                ctypes.POINTER(ctypes.c_float),
                ctypes.c_int,
                ctypes.c_int,
            ]
            lib.makeOrientDecision.restype = ctypes.c_int
            lib.makeOrientDecision.argtypes = [
                ctypes.c_float,
                ctypes.c_float,
                ctypes.c_float,
                ctypes.c_float,
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_int,
            ]
            lib.setMsgSeverity.restype = ctypes.c_int
            lib.setMsgSeverity.argtypes = [ctypes.c_int]
        except AttributeError:
            continue  # a build without these: as if it were not installed
        lib.setMsgSeverity(_SEVERITY_NONE)
        return lib
    return None


@dataclass(frozen=True)
class TextOrientation:
    """Leptonica's answer for one page. ``turn``: the clockwise turn (0, 90, 180 or 270) that makes
    its text upright, with ``confidence``; None where it cannot decide. ``text_found`` False: fewer
    ascenders and descenders than its minimum count (70) both upright and sideways, where it does
    not measure at all (its confidences are exactly 0): a photo, a drawing, a nearly empty page."""

    turn: int | None
    confidence: float = 0.0
    text_found: bool = True


def available() -> bool:
    return _library() is not None


def _ink(grey: Image.Image) -> np.ndarray:
    """Where ``grey`` is ink, as Leptonica's 1-bit copy of it would say."""
    return np.asarray(grey) < INK_BELOW


def _lines_run_across(ink: np.ndarray) -> bool:
    """Whether the page's lines of text seem to run across it (upright or upside down) rather than
    down it (lying sideways): between the first and the last inked row, lines leave blank rows
    where a page lying sideways leaves blank columns. It only chooses which test runs first: the
    answer is the one both tests give, except on a page where both measures pass
    ``BEYOND_DOUBT`` (text tested across its lines stayed under 8 on the corpus), where the first
    decides. A page with no lines to see either way (a photo) is taken as across."""

    def blank_share(inked: np.ndarray) -> float:
        where = np.flatnonzero(inked)
        if where.size == 0:
            return 0.0
        return 1.0 - float(inked[where[0] : where[-1] + 1].mean())

    sample = ink[::_GAPS_SAMPLE, ::_GAPS_SAMPLE]
    return blank_share(np.asarray(sample.any(axis=1))) >= blank_share(np.asarray(sample.any(axis=0)))


def _words(ink: np.ndarray) -> tuple[np.ndarray, int]:
    """``ink`` (``_ink``: True = ink) laid out as a 1-bit pix's data: rows of 32-bit words in the
    machine's byte order, each word's first pixel in its most significant bit; and the words a row."""
    height, width = ink.shape
    words_per_row = (width + 31) // 32
    rows = np.zeros((height, words_per_row * 4), np.uint8)
    rows[:, : (width + 7) // 8] = np.packbits(ink, axis=1)
    return rows.view(">u4").astype(np.uint32), words_per_row


def text_orientation(grey: Image.Image) -> TextOrientation | None:
    """Which clockwise turn makes ``grey``'s text upright, as far as Leptonica can tell (see
    ``TextOrientation``); None where it is not installed or cannot run. ``grey``: an "L" image of
    text at 150-300 dpi."""
    lib = _library()
    if lib is None or grey.width < 32 or grey.height < 32:
        return None
    ink = _ink(grey)
    data, words_per_row = _words(ink)
    pix = ctypes.c_void_p(lib.pixCreate(grey.width, grey.height, 1))
    if not pix.value:
        return None
    try:
        if lib.pixGetWpl(pix) != words_per_row:
            return None
        ctypes.memmove(lib.pixGetData(pix), data.ctypes.data, data.nbytes)
        across = _lines_run_across(ink)
        first = _measure(lib, pix, across=across)
        if first is None:
            return None
        if abs(first) >= BEYOND_DOUBT:
            # makeOrientDecision's UP / DOWN from "up", LEFT / RIGHT from "left"
            turn = (0 if first > 0 else 180) if across else (90 if first > 0 else 270)
            return TextOrientation(turn, round(abs(first), 2))
        second = _measure(lib, pix, across=not across)
        if second is None:
            return None
        up, left = (first, second) if across else (second, first)
        if up == 0.0 and left == 0.0:
            return TextOrientation(None, text_found=False)
        decided = ctypes.c_int(0)
        # 0, 0: Leptonica's own thresholds (a confidence over 8, over 2.5 times the other's).
        if lib.makeOrientDecision(up, left, 0.0, 0.0, ctypes.byref(decided), 0) != 0:
            return None
    finally:
        lib.pixDestroy(ctypes.byref(pix))
    return TextOrientation(_TURN_OF.get(decided.value), round(max(abs(up), abs(left)), 2))


def _measure(lib: ctypes.CDLL, pix: ctypes.c_void_p, *, across: bool) -> float | None:
    """One of ``pixOrientDetect``'s two tests: its "up" measure across the page as it lies, or
    its "left" measure on the page turned 90 degrees; None where Leptonica failed."""
    measure = ctypes.c_float()
    if across:
        failed = lib.pixOrientDetect(pix, ctypes.byref(measure), None, 0, 0)
    else:
        failed = lib.pixOrientDetect(pix, None, ctypes.byref(measure), 0, 0)
    return None if failed else measure.value
