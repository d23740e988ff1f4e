"""Helpers for attacking the running daemon: environment control, crash injection, resource
sampling, generated inputs, and one checker that proves every input is accounted for exactly once.

``ChaosDaemon`` is ``tests.conftest.DaemonProcess`` with what the base class cannot do (it passes
``os.environ`` as is): extra environment (a ``PATH`` with fake tools first, ``CHAOS_KILL`` for
crash injection), running as an unprivileged user through ``setpriv``, and sampling the RSS and
open file descriptors of the daemon and its children while it runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from PIL import Image, ImageDraw

from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from tests.conftest import DaemonProcess, wait_for

CHAOS_DIR = Path(__file__).resolve().parent / "chaos"
REPO = Path(__file__).resolve().parents[2]

# Every scenario's figures end up here and in the session's figures file (tests/conftest.py names
# it in PYTEST_CHANDRAD_FIGURES): the tests run in pytest-xdist workers, and the session that prints
# the summary (pytest_terminal_summary in tests/conftest.py) is another process.
FIGURES: list[dict[str, object]] = []


def record_figures(scenario: str, **figures: object) -> None:
    row = {"scenario": scenario, **figures}
    FIGURES.append(row)
    out = os.environ.get("PYTEST_CHANDRAD_FIGURES")
    if out:
        with open(out, "a", encoding="utf-8") as handle:  # one short line per write: appends do not interleave
            handle.write(json.dumps(row, default=str) + "\n")


# -- sampling --------------------------------------------------------------------------------------


@dataclass
class Sampler:
    """Samples the daemon's RSS (VmRSS) and open fds (/proc/PID/fd), and its children's RSS."""

    pid_of: Callable[[], int | None]
    interval: float = 0.2
    max_rss_kb: int = 0
    max_tree_rss_kb: int = 0
    max_fds: int = 0
    samples: int = 0
    fds_series: list[int] = field(default_factory=list)
    rss_series: list[int] = field(default_factory=list)
    extra: Callable[[], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample_once(self) -> None:
        pid = self.pid_of()
        if pid is None:
            return
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as handle:
                rss = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return
        tree = rss
        try:
            for child in psutil.Process(pid).children(recursive=True):
                try:
                    tree += child.memory_info().rss // 1024
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        self.max_rss_kb = max(self.max_rss_kb, rss)
        self.max_tree_rss_kb = max(self.max_tree_rss_kb, tree)
        self.max_fds = max(self.max_fds, fds)
        self.fds_series.append(fds)
        self.rss_series.append(rss)
        self.samples += 1
        if self.extra is not None:
            self.extra()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _sampled(self) -> None:
        # A bound on a peak nobody measured would hold whatever the daemon did.
        assert self.samples > 0, "the sampler took no sample of the daemon (was it started while the daemon ran?)"

    @property
    def max_rss_mb(self) -> float:
        self._sampled()
        return round(self.max_rss_kb / 1024, 1)

    @property
    def max_tree_rss_mb(self) -> float:
        self._sampled()
        return round(self.max_tree_rss_kb / 1024, 1)


# -- the daemon ------------------------------------------------------------------------------------


class ChaosDaemon(DaemonProcess):
    """``chandrad run`` with a controlled environment; see the module docstring."""

    def __init__(self, root: Path, *, env: dict[str, str] | None = None, user: int | None = None, **kwargs: str):
        root.mkdir(parents=True, exist_ok=True)
        extra = str(kwargs.pop("extra_config", ""))
        if "metrics_address" not in extra:  # top-level keys must come before any [section] in extra
            extra = 'metrics_address = ""\n' + extra
        super().__init__(root, extra_config=extra, **kwargs)
        inbox_config = str(kwargs.get("inbox_config", ""))
        if "rescan_seconds" in inbox_config:  # the base config sets 5 s; TOML forbids a second value
            self.config.write_text(self.config.read_text().replace("rescan_seconds = 5\n", "", 1))
        self.env: dict[str, str] = dict(env or {})
        self.user = user
        self.starts = 0
        self.kills = 0
        self.sampler = Sampler(lambda: self.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive and self.proc is not None else None

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> ChaosDaemon:
        run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        command = [sys.executable, "-m", "chandrad", "run", "--config", str(self.config)]
        if self.user is not None:
            command = ["setpriv", f"--reuid={self.user}", f"--regid={self.user}", "--clear-groups",
                       "--inh-caps=-all", "--bounding-set=-all", *command]
        events_before = len(self.events())
        with open(self.log_path, "ab") as log:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_env, cwd=self.root)
        self.starts += 1
        if wait:
            wait_for(lambda: any(e.get("event") == "watching inbox" for e in self.events()[events_before:])
                     or self._died(), 60, "the daemon to start watching", interval=0.05)
            assert self.alive, f"daemon exited at start:\n{self.log_path.read_text(errors='replace')[-3000:]}"
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.kills += 1
        self.proc.wait(10)

    def wait_dead(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def count_rows(self, where: str = "1") -> int:
        rows = self.journal_rows(f"SELECT COUNT(*) AS n FROM documents WHERE {where}")
        return rows[0]["n"] if rows else 0

    def final_count(self) -> int:
        return self.count_rows("state IN ('published', 'failed')")

    def errors(self) -> list[dict]:
        return [e for e in self.events() if e.get("level") in ("error", "critical") or "exception" in e]


def chaos_env(log: Path) -> dict[str, str]:
    """Environment that loads ``chaos/sitecustomize.py`` into the daemon (keeping any PYTHONPATH)."""
    paths = [str(CHAOS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths), "CHAOS_LOG": str(log)}


def fake_tools(folder: Path, **scripts: str) -> dict[str, str]:
    """Shell scripts named like real tools, first on PATH; returns the env to pass to the daemon."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


# -- inputs ----------------------------------------------------------------------------------------


def text_png(text: str, size: tuple[int, int] = (360, 60)) -> bytes:
    """A small grayscale PNG with ``text`` on it: unique content per text, fast to OCR."""
    image = Image.new("L", size, 255)
    ImageDraw.Draw(image).text((8, size[1] // 2 - 6), text, fill=0)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def simple_pdf(pages: int, size_pt: tuple[float, float] = (144, 72), label: str = "page",
               declared_pages: int | None = None) -> bytes:
    """A valid PDF with ``pages`` pages of one line of text each (xref offsets computed)."""
    objects: list[bytes] = []
    font_no = 3
    first_page = 4
    kids = " ".join(f"{first_page + 2 * i} 0 R" for i in range(pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {declared_pages or pages} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i in range(pages):
        content = f"BT /F1 12 Tf 6 {size_pt[1] / 2 - 4:.0f} Td ({label} {i + 1}) Tj ET".encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {size_pt[0]} {size_pt[1]}] "
            f"/Resources << /Font << /F1 {font_no} 0 R >> >> /Contents {first_page + 2 * i + 1} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    return assemble_pdf(objects)


def assemble_pdf(objects: list[bytes], root: int = 1) -> bytes:
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, root, xref))
    return out.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width``×``height`` zero pixels; a few hundred KiB for hundreds of MP."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + b"\x00" * width
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def multi_frame_tiff(frames: int, size: tuple[int, int] = (200, 40)) -> bytes:
    images = [Image.new("L", size, 255) for _ in range(frames)]
    for number, image in enumerate(images, start=1):
        ImageDraw.Draw(image).text((4, 14), f"frame {number}", fill=0)
    buffer = io.BytesIO()
    images[0].save(buffer, format="TIFF", save_all=True, append_images=images[1:], compression="tiff_deflate")
    return buffer.getvalue()


def drop_bytes(inbox: Path, name: str | bytes, data: bytes) -> Path:
    """Write ``data`` under a temporary name, then rename it into the inbox (what careful copiers do)."""
    raw_inbox = os.fsencode(inbox)
    raw_name = name if isinstance(name, bytes) else os.fsencode(name)
    target = os.path.join(raw_inbox, raw_name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = os.path.join(raw_inbox, b".incoming-" + hashlib.sha1(raw_name).hexdigest().encode() + b".part")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, target)
    return Path(os.fsdecode(target))


FIGURE_HTML = (
    '<div data-bbox="50 40 950 300" data-label="Text"><p>Quarterly figures</p></div>\n'
    '<div data-bbox="100 350 900 900" data-label="Image"><img alt="a chart"/></div>'
)


class DrawingEngine:
    """Answers every page with a text block and a figure (cropped into images/ by publish)."""

    name = "fake"
    model = "fake-figures"

    async def start(self) -> None:
        return None

    async def ocr(self, request: PageRequest) -> PageResult:
        return PageResult(html=FIGURE_HTML)

    def status(self) -> EngineStatus:
        return EngineStatus()

    async def memory_in_use(self) -> int | None:
        return None

    def stopping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


# -- the checker -----------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Expect:
    """What must become of one input: published with ``pages`` pages, or failed with ``reason`` in it."""

    data: bytes
    pages: int | None = None  # None: must fail
    reason: str = ""
    either: bool = False  # published or failed are both acceptable (e.g. a truncated, repairable PDF)


def published_dirs(outbox: Path) -> list[Path]:
    """Document directories in the outbox: folders holding a ``.json``/``.md``/``.html`` output."""
    found = []
    for path in outbox.rglob("*"):
        if ".chandrad" in path.relative_to(outbox).parts:
            continue
        if path.is_dir() and any(child.suffix in (".json", ".md", ".html") for child in path.iterdir()):
            found.append(path)
    return found


def check_accounted(daemon: ChaosDaemon, inputs: dict[str, Expect], formats: tuple[str, ...] = ("md", "html", "json"),
                    allow_extra_failed: int = 0) -> dict[str, int]:
    """Prove: every input is published exactly once or failed exactly once, nothing is half-written,
    nothing was left behind. Returns counts of losses and duplicates (asserted zero by callers)."""
    by_sha: dict[str, list[str]] = {}
    for name, expect in inputs.items():
        by_sha.setdefault(sha(expect.data), []).append(name)
    rows = daemon.journal_rows("SELECT * FROM documents")
    assert all(row["state"] in ("published", "failed") for row in rows), \
        [(row["rel_path"], row["state"]) for row in rows if row["state"] not in ("published", "failed")]

    # Outbox: one complete directory per published document, each JSON naming its source file.
    outputs: dict[str, list[Path]] = {}
    half_written = []
    for folder in published_dirs(daemon.outbox):
        names = {child.name for child in folder.iterdir() if child.is_file()}
        json_files = [folder / n for n in names if n.endswith(".json")]
        if "json" in formats:
            if len(json_files) != 1:
                half_written.append(folder)
                continue
            try:
                document = json.loads(json_files[0].read_text())
            except (OSError, ValueError):
                half_written.append(folder)
                continue
            base = json_files[0].stem
            if {f"{base}.{fmt}" for fmt in formats} - names:
                half_written.append(folder)
            outputs.setdefault(document["doc_id"], []).append(folder)
    assert half_written == [], f"half-written output directories: {half_written}"

    published_rows = [row for row in rows if row["state"] == "published"]
    failed_rows = [row for row in rows if row["state"] == "failed"]
    duplicates = sum(len(folders) - 1 for folders in outputs.values())
    orphans = [folders for doc_id, folders in outputs.items() if doc_id not in {r["id"] for r in published_rows}]
    assert orphans == [], f"outbox directories no published journal row owns: {orphans}"

    # Archive and failed hold the originals, byte for byte: content hashes tell which input each is.
    def originals(folder: Path) -> dict[str, list[Path]]:
        found: dict[str, list[Path]] = {}
        if not folder.exists():
            return found
        for path in folder.rglob("*"):
            if path.is_symlink() or not path.is_file() or path.name.endswith((".error.json", ".tmp")):
                continue
            found.setdefault(sha(path.read_bytes()), []).append(path)
        return found

    archived = originals(daemon.archive)
    failed_files = originals(daemon.failed)
    losses, dupes = 0, duplicates
    for digest, names in by_sha.items():
        count = len(names)
        expects = [inputs[n] for n in names]
        n_archived = len(archived.get(digest, []))
        n_failed = len(failed_files.get(digest, []))
        if n_archived + n_failed < count and not any(e.data == b"" for e in expects):
            losses += count - n_archived - n_failed
        if n_archived + n_failed > count:
            dupes += n_archived + n_failed - count
    for name, expect in inputs.items():
        rows_for = [row for row in rows if os.path.basename(row["rel_path"]) == _display(name)]
        if expect.either:
            continue
        if expect.pages is None:
            assert any(row["state"] == "failed" for row in rows_for), (name, [dict(r) for r in rows_for])
            if expect.reason:
                reports = [json.loads(Path(row["final_path"] + ".error.json").read_text()) for row in rows_for
                           if row["state"] == "failed" and row["final_path"]]
                assert any(expect.reason.lower() in r["reason"].lower() for r in reports), (name, reports)
        else:
            ok = [row for row in rows_for if row["state"] == "published"]
            assert ok, (name, [(r["state"], r["error"]) for r in rows_for])
            for row in ok:
                document = json.loads(next(Path(row["output_dir"]).glob("*.json")).read_text())
                assert document["num_pages"] == expect.pages, (name, document["num_pages"])
    assert losses == 0, f"{losses} input(s) neither archived nor in failed/"
    assert dupes == 0, f"{dupes} duplicate output(s)/original(s)"
    assert len(rows) <= len(inputs) + allow_extra_failed, (
        f"{len(rows)} journal rows for {len(inputs)} inputs: "
        f"{[(r['rel_path'], r['state'], r['error']) for r in rows]}")
    assert (left := daemon.leftovers_once_cleared()) == [], f"leftovers: {left}"
    work = daemon.state / "work"
    assert not work.exists() or list(work.iterdir()) == [], f"work dirs left: {list(work.iterdir())}"
    return {"losses": losses, "duplicates": dupes, "published": len(published_rows), "failed": len(failed_rows)}


def _display(name: str) -> str:
    return os.path.basename(name)


def files_outside(root: Path, allowed: tuple[str, ...]) -> list[Path]:
    """Top-level entries of a test tree other than the ones the daemon may write to."""
    return [p for p in root.iterdir() if p.name not in allowed]


def corpus_bytes(name: str) -> bytes:
    from tests.conftest import corpus_file

    return corpus_file(name).read_bytes()


__all__ = [
    "CHAOS_DIR",
    "ChaosDaemon",
    "DrawingEngine",
    "Expect",
    "Sampler",
    "assemble_pdf",
    "chaos_env",
    "check_accounted",
    "corpus_bytes",
    "drop_bytes",
    "fake_tools",
    "multi_frame_tiff",
    "png_bomb",
    "published_dirs",
    "record_figures",
    "sha",
    "simple_pdf",
    "text_png",
    "wait_for",
]
