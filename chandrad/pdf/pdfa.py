"""PDF/A-2b: what in an original keeps the file from being PDF/A without changing its pages, and
the identification (XMP, sRGB output intent) where nothing does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pikepdf
from pikepdf import Array, Dictionary, Name, Pdf
from PIL import ImageCms


def _srgb_profile() -> bytes:
    """An sRGB ICC profile (class mntr, v4), made by littleCMS through Pillow: nothing to ship or find."""
    return bytes(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())


def pdfa_blockers(pdf: Pdf) -> list[str]:
    """What in the original keeps the file from being PDF/A-2b without changing its pages; [] if nothing.

    Looked at: fonts not embedded (in pages, their forms and annotations' appearances), DeviceCMYK
    without a CMYK output intent, an output intent of the original's own (PDF/A wants every intent
    to carry the same profile; the sRGB one added would differ), images to be interpolated,
    annotations that do not print (all but Popup) or lack an appearance (all but Popup and Link),
    JavaScript and launch actions (the document's, its triggers', its pages' and annotations'),
    embedded files, XFA.
    """
    problems: set[str] = set()
    intents = pdf.Root.get("/OutputIntents", Array())
    profiled = [i for i in intents if isinstance(i, Dictionary) and i.get("/DestOutputProfile") is not None]
    has_pdfa_intent = any(i.get("/S") == Name.GTS_PDFA1 for i in profiled)
    if profiled and not has_pdfa_intent:
        problems.add("it has an output intent of its own (a print profile), which a PDF/A one would contradict")
    cmyk_intent = any(i.get("/S") == Name.GTS_PDFA1 and i.DestOutputProfile.get("/N") == 4 for i in profiled)
    names = pdf.Root.get("/Names")
    if isinstance(names, Dictionary):
        if "/EmbeddedFiles" in names:
            problems.add("it has embedded files")
        if "/JavaScript" in names:
            problems.add("it has JavaScript")
    acroform = pdf.Root.get("/AcroForm")
    if isinstance(acroform, Dictionary) and "/XFA" in acroform:
        problems.add("it has an XFA form")
    if _runs_forbidden_action(pdf.Root.get("/OpenAction")) or _triggers_forbidden_action(pdf.Root.get("/AA")):
        problems.add("it runs an action when opened")
    for number, page in enumerate(pdf.pages, start=1):
        if _triggers_forbidden_action(page.obj.get("/AA")):
            problems.add(f"page {number} runs an action")
        visited: set[tuple[int, int]] = set()
        for annot in page.obj.get("/Annots", Array()):
            if not isinstance(annot, Dictionary) or annot.get("/Subtype") == Name.Popup:
                continue
            flags = int(annot.get("/F", 0))
            if not flags & 4 or flags & (1 | 2 | 32):
                problems.add(f"page {number} has an annotation that does not print")
            if annot.get("/Subtype") != Name.Link and "/AP" not in annot:
                problems.add(f"page {number} has an annotation without an appearance")
            if _runs_forbidden_action(annot.get("/A")) or _triggers_forbidden_action(annot.get("/AA")):
                problems.add(f"page {number} has an annotation that runs an action")
            for stream in _appearance_streams(annot):
                for problem in _resource_problems(stream.get("/Resources"), cmyk_intent, 0, visited):
                    problems.add(f"page {number}'s annotation: {problem}")
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


def _appearance_streams(annot: Dictionary) -> list[pikepdf.Stream]:
    """An annotation's normal appearance: one stream, or one per state (a check box's on and off)."""
    appearance = annot.get("/AP")
    normal = appearance.get("/N") if isinstance(appearance, Dictionary) else None
    if isinstance(normal, pikepdf.Stream):
        return [normal]
    if isinstance(normal, Dictionary):
        return [stream for stream in normal.values() if isinstance(stream, pikepdf.Stream)]
    return []


_FORBIDDEN_ACTIONS = (Name.JavaScript, Name.Launch)


def _runs_forbidden_action(action: Any) -> bool:
    """Whether an action (or the chain of actions its /Next holds) runs JavaScript or launches a program."""
    seen = 0
    pending = [action]
    while pending and seen < 64:
        current = pending.pop()
        seen += 1
        if isinstance(current, Array):
            pending.extend(current)
        elif isinstance(current, Dictionary):
            if current.get("/S") in _FORBIDDEN_ACTIONS:
                return True
            if "/Next" in current:
                pending.append(current.Next)
    return False


def _triggers_forbidden_action(triggers: Any) -> bool:
    """Whether an additional-actions dictionary (``/AA``: an action per trigger) holds a forbidden one."""
    return isinstance(triggers, Dictionary) and any(_runs_forbidden_action(action) for action in triggers.values())


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


def make_pdfa(pdf: Pdf) -> None:
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
