"""Duplicates across hosts: ``seen/ab/cd/<sha256>``, created with O_EXCL after a successful claim,
names the document that first took that content in, whichever host it was (an older chandrad's
flat ``seen/<sha256>`` counts too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chandrad.runtime import now_iso
from chandrad.storage import folders
from chandrad.storage.durable import create_exclusively, makedirs_durably
from chandrad.storage.journal import Document


def mark_seen(inbox_path: Path, sha256: str, host_id: str, doc: Document) -> dict[str, Any] | None:
    """Record that ``doc`` took this content in, unless a marker is there already (blocking).
    Returns the marker of another document if there is one (ours: None).

    An older chandrad's flat marker (``seen/<sha256>``) is looked at first and counts like one of
    ours. New markers are only ever made in the sharded layout (``seen/ab/cd/<sha256>``), so
    between hosts of this version the one exclusive link there decides who was first."""
    flat = _marker_content(folders.flat_seen_marker(inbox_path, sha256))
    if flat is not None:
        return None if flat.get("doc_id") == doc.id else flat
    marker = folders.seen_marker(inbox_path, sha256)
    content = {"host_id": host_id, "doc_id": doc.id, "rel_path": doc.rel_path, "at": now_iso(doc.created_at)}
    makedirs_durably(marker.parent)
    if create_exclusively(marker, json.dumps(content, ensure_ascii=False).encode("utf-8"), host_id):
        return None
    try:
        existing = json.loads(marker.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return mark_seen(inbox_path, sha256, host_id, doc)  # removed meanwhile (its document failed)
    except (OSError, ValueError):
        return None  # unreadable: it cannot name a twin
    if not isinstance(existing, dict) or existing.get("doc_id") == doc.id:
        return None
    return existing


def _marker_content(marker: Path) -> dict[str, Any] | None:
    """A seen marker's content, or None if it is absent or unreadable."""
    try:
        content = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def forget_seen(inbox_path: Path, sha256: str, doc_id: str) -> None:
    """Remove the content's marker, sharded or flat, if it names ``doc_id`` (which failed: a copy
    dropped again is processed again). Blocking."""
    if not sha256:
        return
    for marker in (folders.seen_marker(inbox_path, sha256), folders.flat_seen_marker(inbox_path, sha256)):
        content = _marker_content(marker)
        if content is not None and content.get("doc_id") == doc_id:
            try:
                marker.unlink(missing_ok=True)
            except OSError:
                pass
