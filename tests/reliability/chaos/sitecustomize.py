"""Crash injection for the reliability suite, loaded only into daemons started with it on PYTHONPATH.

``CHAOS_KILL="<call>:<substring>:<when>:<nth>"`` makes the daemon ``SIGKILL`` itself (exactly a
``kill -9``: no cleanup, no flush, no ``finally``) at the ``nth`` call of ``os.<call>`` whose path
argument contains ``substring``, ``before`` or ``after`` the call itself ran. ``<call>`` is one of
``rename``, ``replace``, ``fsync`` (the path is read back from ``/proc/self/fd``), ``mkdir`` or ``rmdir``;
a substring ending in ``$`` must end the path instead.
Several points may be given, separated by ``;``. Each hit is appended to ``CHAOS_LOG`` (if set)
so the test can prove the point was reached rather than the document going another way.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("CHAOS_KILL", "")
_LOG = os.environ.get("CHAOS_LOG", "")


def _install() -> None:
    points: list[tuple[str, str, str, int]] = []
    for item in filter(None, _SPEC.split(";")):
        call, substring, when, nth = item.split(":")
        points.append((call, substring, when, int(nth)))
    if not points:
        return
    counts = [0] * len(points)

    def note(text: str) -> None:
        if _LOG:
            with open(_LOG, "a", encoding="utf-8", errors="backslashreplace") as handle:
                handle.write(text + "\n")

    def die(index: int, path: str) -> None:
        call, substring, when, nth = points[index]
        note(f"{call}:{substring}:{when}:{nth} {path}")
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(call: str, original, path_of):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            try:
                path = path_of(*args)
            except Exception:
                path = ""
            hits = []
            for index, (p_call, substring, _when, nth) in enumerate(points):
                matched = path.endswith(substring[:-1]) if substring.endswith("$") else substring in path
                if p_call == call and matched:
                    counts[index] += 1
                    if counts[index] == nth:
                        hits.append(index)
            for index in hits:
                if points[index][2] == "before":
                    die(index, path)
            try:
                return original(*args, **kwargs)
            finally:  # "after" also when the call raised (mkdir of an existing folder, say)
                for index in hits:
                    if points[index][2] == "after":
                        die(index, path)

        return wrapper

    def fd_path(fd, *_):  # type: ignore[no-untyped-def]
        return os.readlink(f"/proc/self/fd/{fd}")

    os.rename = wrap("rename", os.rename, lambda src, dst, *_: f"{os.fspath(src)} -> {os.fspath(dst)}")
    os.replace = wrap("replace", os.replace, lambda src, dst, *_: f"{os.fspath(src)} -> {os.fspath(dst)}")
    os.fsync = wrap("fsync", os.fsync, fd_path)
    os.mkdir = wrap("mkdir", os.mkdir, lambda path, *_: os.fspath(path))
    os.rmdir = wrap("rmdir", os.rmdir, lambda path, *_: os.fspath(path))


_install()
