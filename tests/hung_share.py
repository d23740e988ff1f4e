"""``chandrad`` with one folder tree standing for a network share that stopped answering.

A test double, named as one: a hard-mounted NFS or SMB share whose server died blocks every call on
it for minutes or for ever, and no such mount can be made in this sandbox. Here, once the file
``FLAG`` exists, every stat, lstat, scandir, listdir, mkdir, open, rename, unlink and access on a path
under ``ROOT`` blocks for ever, in whatever thread makes it. Every event-loop callback that takes
longer than 100 ms is written to ``SLOW_STEPS`` (a line each, with the callback).

    python tests/hung_share.py ROOT FLAG SLOW_STEPS -- run --config ...
"""

from __future__ import annotations

import asyncio.events
import builtins
import io
import os
import sys
import threading
import time

root, flag, slow_steps = sys.argv[1], sys.argv[2], sys.argv[3]
args = sys.argv[sys.argv.index("--") + 1 :]
never = threading.Event()
real_stat = os.stat


def blocked(path: object) -> bool:
    try:
        text = os.fsdecode(path)  # type: ignore[arg-type]
    except TypeError:
        return False  # a file descriptor
    if not (text == root or text.startswith(root + os.sep)):
        return False
    try:
        real_stat(flag)
    except OSError:
        return False
    return True


def hang_on_share(real):  # type: ignore[no-untyped-def]
    def call(path, *rest, **kwargs):  # type: ignore[no-untyped-def]
        if blocked(path) or (rest and isinstance(rest[0], (str, os.PathLike)) and blocked(rest[0])):
            never.wait()
        return real(path, *rest, **kwargs)

    return call


for name in ("stat", "lstat", "scandir", "listdir", "mkdir", "open", "rename", "replace", "unlink", "rmdir", "access"):
    setattr(os, name, hang_on_share(getattr(os, name)))
builtins.open = io.open = hang_on_share(builtins.open)

slow_fd = os.open(slow_steps, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
real_run = asyncio.events.Handle._run


def timed_run(self):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    real_run(self)
    took = time.perf_counter() - started
    if took > 0.1:
        task = getattr(self._callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            from chandrad.service.stopping import where_it_waits

            what = f"task {task.get_name()}, now at: {where_it_waits(task)!r}"
        else:
            what = repr(self._callback)
        os.write(slow_fd, f"{took:.3f} s {what}\n".encode(errors="replace"))


asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]

import chandrad.config  # noqa: E402
import chandrad.service.daemon  # noqa: E402
import chandrad.config.settings  # noqa: E402
import chandrad.storage.folders  # noqa: E402
from chandrad.cli import main  # noqa: E402

# The deadlines that measure a share, shortened so that the test does not wait out 20 s ones.
chandrad.storage.folders.PROBE_TIMEOUT_SECONDS = 2.0
chandrad.service.daemon.FOLDER_CHECK_SECONDS = 2.0
chandrad.config.settings.RESOLVE_SECONDS = 1.0
sys.argv = ["chandrad", *args]
main()
