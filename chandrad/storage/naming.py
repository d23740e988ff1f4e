"""Names that come from an inbox made safe, and free names found, for every folder chandrad writes.

Nothing chandrad writes lands outside its outbox, archive or failed folders: every name coming
from an inbox passes through ``safe_component``; and nothing earlier is overwritten: a taken name
gets `` (2)``, `` (3)``… (``free_name``).
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path, PurePath

_UNSAFE = re.compile(r"[\x00-\x1f\x7f/\\:*?\"<>|]+")
_MAX_NAME_BYTES = 180


def safe_component(name: str) -> str:
    """One path component that is safe on Linux and SMB clients: no separators, controls or dots-only."""
    # Names arrive from os.fsdecode: undecodable bytes are surrogates; make them visible, not fatal.
    name = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    name = unicodedata.normalize("NFC", name)
    name = _UNSAFE.sub("_", name).strip().strip(".")
    while len(name.encode("utf-8")) > _MAX_NAME_BYTES:
        name = name[:-1]
    return name or "document"


def safe_relative(rel_path: PurePath) -> Path:
    """A relative path made of safe components only (``..`` and absolute parts cannot survive)."""
    parts = [safe_component(part) for part in rel_path.parts if part not in ("", ".", "..", "/")]
    return Path(*parts) if parts else Path("document")


def free_name(folder: Path, name: str, is_dir: bool = False) -> Path:
    """``folder/name``, or ``folder/name (2)`` etc. if taken: nothing earlier is ever overwritten."""
    candidate = folder / name
    stem, suffix = (name, "") if is_dir else (Path(name).stem, Path(name).suffix)
    counter = 2
    while candidate.exists() or candidate.is_symlink():
        candidate = folder / f"{stem} ({counter}){suffix}"
        counter += 1
    return candidate


def is_document_dir(path: Path) -> bool:
    """A published document's folder holds files; the outbox's sub-folders hold only folders."""
    try:
        with os.scandir(path) as entries:
            return any(entry.is_file(follow_symlinks=False) for entry in entries)
    except OSError:
        return False


def output_folder(base: Path, rel_dir: PurePath) -> Path:
    """``base / rel_dir``, except that no component may be a published document's folder.

    Without this, ``inbox/a/b.pdf`` published into ``outbox/a/b/`` *inside* the folder of an
    earlier ``inbox/a.pdf`` (``outbox/a/``): a published document changed after the fact, with a
    foreign folder in it. Such a component becomes ``a (2)`` (the first that is not a document),
    the same for every later file of that sub-folder.
    """
    current = base
    for part in rel_dir.parts:
        candidate, counter = current / part, 2
        while is_document_dir(candidate):
            candidate = current / f"{part} ({counter})"
            counter += 1
        current = candidate
    return current
