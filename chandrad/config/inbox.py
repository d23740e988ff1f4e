"""``[[inbox]]`` and ``[[inbox.rule]]``: an inbox's folders and output settings, and its rules (the
globs they match with)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from wcmatch import fnmatch as wcfnmatch
from wcmatch import glob as wcglob

from chandrad.config.base import OutputFormat, StrictModel

# One glob dialect for everything an inbox matches (wcmatch's, as in a shell): a rule's ``match``
# on the path relative to the inbox, and the include/ignore patterns on one name. Both are
# case-insensitive and let ``*`` match a leading dot (hidden names are ignored before any pattern
# is asked); ``*`` and ``?`` stay within one folder level, ``[...]`` is a character class
# (``[!...]`` negated), and in a rule ``**`` as a whole level matches any number of levels
# (``invoices/**``: everything under invoices/; ``**/*.tif``: a .tif at any depth, the inbox's top
# level included). A rule without "/" matches files at the top level only.
RULE_GLOB = wcglob.GLOBSTAR | wcglob.IGNORECASE | wcglob.DOTGLOB | wcglob.FORCEUNIX
NAME_GLOB = wcfnmatch.IGNORECASE | wcfnmatch.DOTMATCH | wcfnmatch.FORCEUNIX


def glob_matches(pattern: str, rel_path: str) -> bool:
    """Whether a rule's glob matches ``rel_path`` (relative to the inbox)."""
    return bool(wcglob.globmatch(rel_path.replace(os.sep, "/"), pattern, flags=RULE_GLOB))


def name_matcher(patterns: Sequence[str], *, case: bool = False) -> Callable[[str], bool]:
    """Whether a name matches any of the include/ignore ``patterns`` (``case``: exactly as
    written), compiled once: a watcher asks for every event."""
    if not patterns:
        return lambda name: False
    flags = NAME_GLOB & ~wcfnmatch.IGNORECASE | wcfnmatch.CASE if case else NAME_GLOB
    return wcfnmatch.compile(list(patterns), flags=flags).match


def split_specs(split_on: Iterable[str]) -> tuple[bool, tuple[str, ...], bool]:
    """``split_on``'s grammar, in one place: (PATCH T, the barcode texts, blank); ValueError names a
    spec it cannot read (``scan.separators.SplitRule`` is made from it)."""
    patch_t, blank, texts = False, False, []
    for spec in split_on:
        if spec == "patch-t":
            patch_t = True
        elif spec == "blank":
            blank = True
        elif spec.startswith("barcode:") and spec[len("barcode:") :]:
            texts.append(spec[len("barcode:") :])
        else:
            raise ValueError(f'split_on {spec!r}: use "patch-t", "blank" or "barcode:TEXT"')
    return patch_t, tuple(texts), blank


def _checked_split_on(split_on: tuple[str, ...]) -> tuple[str, ...]:
    split_specs(split_on)
    return split_on


class InboxRule(StrictModel):
    """``[[inbox.rule]]``: settings for the files of an inbox whose relative path matches ``match``.
    Keys left out keep the inbox's own value; the first rule that matches wins."""

    match: str
    prompt_type: Literal["ocr_layout", "ocr"] | None = None
    formats: tuple[OutputFormat, ...] | None = None
    on_success: Literal["archive", "delete", "keep"] | None = None
    date_prefix: bool | None = None
    duplicates: Literal["skip", "reprocess"] | None = None
    # Which [[webhook]] / [[hook]] names apply to these files (instead of those the inbox gets); [] = none.
    webhooks: tuple[str, ...] | None = None
    hooks: tuple[str, ...] | None = None
    rotate_pages: bool | None = None
    rotate_pdf_pages: bool | None = None
    blank_pages: Literal["keep", "drop"] | None = None
    drop_blank_pdf_pages: bool | None = None
    ocr_mode: Literal["force", "skip", "redo"] | None = None
    split_on: tuple[str, ...] | None = None

    @field_validator("split_on")
    @classmethod
    def _valid_split_on(cls, split_on: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if split_on is None else _checked_split_on(split_on)

    @field_validator("match")
    @classmethod
    def _valid_glob(cls, match: str) -> str:
        if not match or match.startswith("/") or ".." in match.split("/"):
            raise ValueError(f'match {match!r} must be a glob relative to the inbox, such as "invoices/**"')
        # wcmatch reads an unclosed [ as a literal one: a typo would match nothing without a word.
        for segment in match.split("/"):
            opened = segment.find("[")
            if opened != -1 and "]" not in segment[opened + 2 :]:
                raise ValueError(f"match {match!r} is not a valid glob: unclosed [ (write [[] for a literal [)")
        return match

    @field_validator("formats")
    @classmethod
    def _formats_not_empty(cls, formats: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if formats is not None and not formats:
            raise ValueError("list at least one of md, html, json, pdf")
        return formats

    def overrides(self) -> dict[str, Any]:
        """The inbox keys this rule sets: every key but ``match`` is one of the inbox's."""
        keys = (key for key in type(self).model_fields if key != "match")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


class InboxSettings(StrictModel):
    """One watched folder and where its documents go."""

    path: Path
    outbox: Path
    archive: Path | None = None
    failed: Path
    name: str = ""
    recursive: bool = True
    # "auto": polling when the inbox lives on cifs/smb/nfs/fuse (inotify sees no remote writes there).
    polling: Literal["auto"] | bool = "auto"
    poll_interval_seconds: float = Field(default=5.0, gt=0)
    rescan_seconds: float = Field(default=300.0, gt=0)
    settle_seconds: float = Field(default=5.0, ge=0)
    # Scanners that create the name empty and fill it later: an empty file must stay empty this long.
    empty_settle_seconds: float = Field(default=60.0, ge=0)
    include: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()
    on_success: Literal["archive", "delete", "keep"] = "archive"
    prompt_type: Literal["ocr_layout", "ocr"] = "ocr_layout"
    formats: tuple[OutputFormat, ...] = ("md", "html", "json")
    date_prefix: bool = False
    duplicates: Literal["skip", "reprocess"] = "skip"
    compress: Literal["lossless", "ebook", "printer"] = "lossless"
    pdf_password: str | None = None
    # The searchable PDF ("pdf" in formats): PDF/A-2b unless false; a text layer already in the PDF is
    # kept (no doubled text) unless pdf_replace_text; pdf_word_boxes places each word on its own box;
    # pdf_to also drops the PDF into another folder (e.g. a document system's consume folder).
    pdfa: bool = True
    pdf_replace_text: bool = False
    pdf_word_boxes: bool = True
    pdf_to: Path | None = None
    # Scans as they come: each page is turned upright before the model reads it (tesseract's
    # orientation detection); rotate_pdf_pages also turns the searchable PDF's page (a /Rotate:
    # the page's content is never rewritten), else the text layer follows the page as it is.
    rotate_pages: bool = True
    rotate_pdf_pages: bool = False
    # "drop": a blank page (Chandra's Blank-Page; the tesseract engine: an ink measure) is left out
    # of the Markdown, HTML and the JSON's pages (listed in its dropped_pages), and out of the
    # searchable PDF too only with drop_blank_pdf_pages.
    blank_pages: Literal["keep", "drop"] = "keep"
    drop_blank_pdf_pages: bool = False
    # Born-digital pages (chandrad.scan.digital): "force" every page to the model; "skip" a page
    # with text of its own keeps it (only image-only pages are read); "redo" as skip, but a page
    # whose only text is another OCR's invisible layer is read again.
    ocr_mode: Literal["force", "skip", "redo"] = "force"
    # Batch scans (chandrad.document.split): a PDF is cut at its separator sheets into documents of
    # their own: "patch-t" (a PATCH T sheet's barcode), "barcode:TEXT" (a code reading TEXT),
    # "blank" (a blank page). () = never split.
    split_on: tuple[str, ...] = ()
    # Which [[webhook]] / [[hook]] names apply to this inbox's documents. Default (unset): every one
    # whose own `inboxes` list names this inbox or is unset.
    webhooks: tuple[str, ...] | None = None
    hooks: tuple[str, ...] | None = None
    # [[inbox.rule]] tables: settings per sub-folder or kind of file, the first match wins.
    rule: tuple[InboxRule, ...] = ()

    @field_validator("split_on")
    @classmethod
    def _valid_split_on(cls, split_on: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_split_on(split_on)

    @model_validator(mode="before")
    @classmethod
    def _derive_folders(cls, data: Any) -> Any:
        """Only ``path`` is required: outbox/archive/failed default to siblings of the inbox."""
        if isinstance(data, dict) and "path" in data:
            base = Path(data["path"]).parent
            data = dict(data)
            data.setdefault("outbox", base / "outbox")
            data.setdefault("failed", base / "failed")
            rules = data.get("rule") or ()
            wants_archive = [data.get("on_success", "archive")] + [
                rule.get("on_success") if isinstance(rule, dict) else getattr(rule, "on_success", None)
                for rule in rules
            ]
            if "archive" in wants_archive:
                data.setdefault("archive", base / "archive")
            data.setdefault("name", Path(data["path"]).name)
        return data

    @field_validator("formats")
    @classmethod
    def _formats_not_empty(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        if not formats:
            raise ValueError("list at least one of md, html, json, pdf")
        return formats

    @model_validator(mode="after")
    def _archive_needed(self) -> InboxSettings:
        if self.on_success == "archive" and self.archive is None:
            raise ValueError('on_success = "archive" needs an archive folder')
        for rule in self.rule:
            if rule.on_success == "archive" and self.archive is None:
                raise ValueError(f'the rule for {rule.match!r} sets on_success = "archive": give the inbox an archive')
        return self

    def rule_for(self, rel_path: str) -> tuple[int, InboxRule] | None:
        """The first rule matching ``rel_path`` (relative to the inbox) and its number (1, 2, ...)."""
        for number, rule in enumerate(self.rule, start=1):
            if glob_matches(rule.match, rel_path):
                return number, rule
        return None

    def folder_rules(self, rel_folder: str) -> tuple[tuple[int, InboxRule] | None, list[tuple[int, InboxRule]]]:
        """For ``chandrad check``: the rule every file directly in ``rel_folder`` gets ("" is the
        inbox's top level; None: the inbox's own settings), and the earlier rules that take some
        of its files first by their names (such as ``**/*.tif``)."""
        prefix = f"{rel_folder.strip('/')}/" if rel_folder.strip("/") else ""
        anything = prefix + "\x01\x01name"  # stands for any name: matched by * and **, never by *.tif
        by_name: list[tuple[int, InboxRule]] = []
        for number, rule in enumerate(self.rule, start=1):
            if glob_matches(rule.match, anything):
                return (number, rule), by_name
            head, _, last = rule.match.rpartition("/")
            if last != "**" and glob_matches(f"{head}/*" if head else "*", anything):
                by_name.append((number, rule))
        return None, by_name

    def effective(self, rel_path: str) -> InboxSettings:
        """This inbox's settings as they apply to the file at ``rel_path``: the first matching
        rule's keys over the inbox's own. The one place rules are resolved; applying it twice
        gives the same settings (the rules are kept)."""
        found = self.rule_for(rel_path)
        if found is None:
            return self
        return self.model_copy(update=found[1].overrides())

    @property
    def destinations(self) -> dict[str, Path]:
        folders = {"outbox": self.outbox, "failed": self.failed}
        if self.archive is not None:
            folders["archive"] = self.archive
        if self.pdf_to is not None:
            folders["pdf_to"] = self.pdf_to
        return folders
