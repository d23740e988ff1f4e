"""Durable filesystem steps, one implementation each: a power cut shows all of a step or none.

Every write chandrad makes that must survive a crash goes through here: a file is written under a
temporary name, fsynced and renamed; a rename makes both directory entries durable (the new one
first, so a power cut in between shows the file twice, never nowhere); new folders have their own
entries fsynced. Blocking: callers run these in a thread.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file (not its directory entry: see write_file_durably)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_file(path: Path) -> None:
    """Make a file another writer wrote (pikepdf's save) durable."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def place_copy(source: Path, folder: Path, name: str, free_name: Callable[[Path, str], Path]) -> Path:
    """Copy ``source`` into ``folder`` as ``name`` (``name (2)`` etc. when taken), whole or not at all:
    written under ``folder/.chandrad/``, fsynced, then linked in (a link never replaces a file). An
    identical copy already there (a retry after a crash) is the copy: returned, not repeated."""
    makedirs_durably(folder / ".chandrad")
    data = source.read_bytes()
    stem, suffix = Path(name).stem, Path(name).suffix
    for existing in folder.glob(f"{glob.escape(stem)}*{glob.escape(suffix)}"):
        if existing.is_file() and existing.stat().st_size == len(data) and existing.read_bytes() == data:
            return existing
    tmp = folder / ".chandrad" / f"{name}.part"
    write_synced(tmp, data)
    try:
        for _ in range(1000):
            target = free_name(folder, name)
            try:
                os.link(tmp, target)
            except FileExistsError:
                continue  # taken between the look and the link
            fsync_dir(folder)
            return target
        raise FileExistsError(f"no free name for {name} in {folder}")
    finally:
        tmp.unlink(missing_ok=True)


def create_exclusively(path: Path, data: bytes, writer: str) -> bool:
    """Make ``path`` hold ``data`` unless it exists (O_EXCL's promise, with its content whole from
    the first moment: written aside, fsynced, then linked in): whether this call created it."""
    tmp = path.with_name(f".{path.name}.{writer}.{os.getpid()}.tmp")
    write_synced(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def reserve_name(target: Path, named_before: bool) -> bool:
    """Take ``target`` for a file about to be renamed there (archive/, failed/), as an empty
    placeholder made with O_CREAT|O_EXCL: a plain rename would silently replace a file another host
    placed there a moment ago; a rename over our own placeholder replaces nothing of anyone's.
    Returns whether the name is ours: created now, or (``named_before``: the journal named
    ``target`` at an earlier attempt) an empty file already there, our placeholder from before a
    crash. False: another file has the name; pick the next one."""
    makedirs_durably(target.parent)
    try:
        fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        if not named_before:
            return False
        try:
            st = target.lstat()
        except FileNotFoundError:
            return reserve_name(target, named_before)  # gone again: try once more
        return stat.S_ISREG(st.st_mode) and st.st_size == 0
    os.close(fd)
    fsync_dir(target.parent)
    return True


def makedirs_durably(folder: Path) -> None:
    """``mkdir -p`` that also makes each new folder's entry durable (fsync of its parent).

    A plain ``mkdir(parents=True)`` before a durable rename leaves the new folders themselves
    undurable: after a power cut the rename's target folder (``archive/sub/``, ``claimed/<id>/``,
    ``outbox/sub/``) could be gone with the file in it, while the removal from the old folder,
    fsynced, had survived: the file lost.
    """
    missing: list[Path] = []
    current = folder
    while not (current.is_dir() or current.is_symlink()) and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            pass  # made by someone else a moment ago; its entry may not be durable yet either
        fsync_dir(path.parent)


def write_file_durably(path: Path, data: bytes, writer: str = "") -> None:
    """Write via a temporary name, fsync, rename: the name shows either nothing or all of it.
    ``writer`` goes into the temporary name where several hosts may write ``path`` at once (each
    must rename its own temporary file)."""
    tmp = path.with_name(f".{path.name}.{writer}.tmp" if writer else f".{path.name}.tmp")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def rename_dir_durably(source: Path, target: Path) -> None:
    """Rename a complete folder to ``target`` (which must not exist) and make both entries durable."""
    makedirs_durably(target.parent)
    os.rename(source, target)
    fsync_dir(target.parent)
    fsync_dir(source.parent)


def move_durably(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (same filesystem) and make both directory entries durable."""
    makedirs_durably(target.parent)
    try:
        os.rename(source, target)
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
        # Inbox on one filesystem, archive on another: copy durably, then remove the original.
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp, follow_symlinks=False)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.rename(tmp, target)
        fsync_dir(target.parent)
        source.unlink()
    fsync_dir(target.parent)
    fsync_dir(source.parent)
