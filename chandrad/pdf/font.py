"""The glyphless font the text layer is drawn in: one empty glyph, 0.5 em wide, embedded (the
PDF/A rule), with the encoding of the strings drawn in it."""

from __future__ import annotations

import struct
import zlib
from functools import cache

import pikepdf
from pikepdf import Dictionary, Name, Pdf

_FONT_NAME = "ChandradInvisible"
# The glyph's advance, its ascent and descent (1/1000 em): glyph boxes are 0.8 em above the
# baseline and 0.2 em below, so a line whose font size is its height has boxes that are its box.
ADVANCE, ASCENT, DESCENT = 500, 800, -200


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
    adv, asc, desc = ADVANCE, ASCENT, DESCENT
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


def add_font(pdf: Pdf) -> pikepdf.Object:
    """The glyphless font as a Type0/CIDFontType2 font: every CID drawn with glyph 1 (never .notdef)."""
    descriptor = pdf.make_indirect(
        Dictionary(
            Type=Name.FontDescriptor,
            FontName=Name("/" + _FONT_NAME),
            Flags=5,  # fixed pitch, symbolic
            FontBBox=[0, DESCENT, ADVANCE, ASCENT],
            ItalicAngle=0,
            Ascent=ASCENT,
            Descent=DESCENT,
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
            DW=ADVANCE,
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


def encode(text: str) -> bytes:
    """UTF-16BE code units; characters beyond the BMP become U+FFFD (the code space is two bytes)."""
    return "".join(c if ord(c) < 0x10000 and not 0xD800 <= ord(c) < 0xE000 else "\ufffd" for c in text).encode(
        "utf-16-be"
    )
