"""What a PDF input's pages already have: text of their own (visible, or invisible: another OCR's
layer, which can be stripped), and signatures, which the rewritten file would no longer match."""

from __future__ import annotations

import zlib
from typing import Any, Literal

import pikepdf
from pikepdf import Array, Dictionary, Name, Pdf

_TEXT_OPS = "BT ET Tr Tj TJ ' \" q Q"


def text_kind(page: pikepdf.Page) -> Literal["none", "invisible", "visible"]:
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


def strip_invisible_text(pdf: Pdf, page: pikepdf.Page) -> None:
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


def remove_signatures(pdf: Pdf) -> bool:
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
