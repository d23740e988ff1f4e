"""bench/overhead.py's remote phases: the daemon with ``engine.url`` on a ``vllm serve`` of the same
engine settings (``remote``), and with that server SIGKILLed and started again midway (``remote-kill``)."""

from __future__ import annotations

import argparse
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from overhead_common import compile_cache_env, journal_docs, pages_in_flight_for
from overhead_daemon import daemon_phase
from vllm_server import VllmServer

# -- remote: the daemon with engine.url on a vllm serve of the same engine settings ------------------


def server_state(a: argparse.Namespace, root: Path) -> Path:
    """Where the remote phases' server is described: --server-state, else in the run's folder."""
    return Path(a.server_state) if a.server_state else root / "server" / "server.json"


def server_for(a: argparse.Namespace, settings: Any, root: Path) -> Any:
    """The ``vllm serve`` of the remote phases: the one --server-state describes if it is alive,
    else a new one (started, not yet answering) with the engine arguments and environment the
    in-process engine of ``settings`` gets, and the daemon's compile cache (a warm start)."""
    from chandrad.engine.layout import plan_engines
    from chandrad.engine.vllm import set_spawn_environment

    state = server_state(a, root)
    root = root / "server"
    if state.exists():
        server = VllmServer.load(state)
        if server.alive():
            print(f"[remote] using the running vllm serve (pid {server.pid}, {server.url})", flush=True)
            return server, state
    (spec,) = plan_engines(settings, root / "ec_cache")
    before = dict(os.environ)
    try:
        os.environ.update(compile_cache_env(a.daemon_cache or str(root / "vllm-cache")))
        set_spawn_environment(spec)  # what the in-process engine's EngineCore would inherit
        env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(before)
    root.mkdir(parents=True, exist_ok=True)
    # Beside its state file: a server kept for the next device call keeps its log where that call looks.
    server = VllmServer.for_engine(settings.model, spec.engine_args, env, state.with_suffix(".log"))
    server.start()
    server.save(state)
    print(f"[remote] vllm serve started (pid {server.pid}, {server.url}): {' '.join(server.command[3:])}", flush=True)
    return server, state


def stop_server(a: argparse.Namespace, root: Path) -> None:
    state = server_state(a, root)
    if state.exists():
        server = VllmServer.load(state)
        if server.alive():
            server.stop()
            print("[remote] vllm serve stopped", flush=True)


def remote_settings(a: argparse.Namespace, settings: Any, url: str) -> Any:
    """The daemon's engine section for the server: what reaches the model is the same; pages in
    flight as the in-process daemon has them."""
    from chandrad.config import EngineSettings

    return EngineSettings(
        kind="vllm", model=settings.model, url=url, served_model_name="chandra", max_tokens=a.max_tokens,
        max_retries=0, bench_force_max_tokens=True,
        max_pages_in_flight=a.max_pages_in_flight or pages_in_flight_for(settings),
        # A killed server's pages wait for it (a warm start is ~1 min on an H200): no attempt is spent.
        page_timeout_seconds=max(1800.0, a.timeout), health_check_seconds=2.0,
        restart_backoff_seconds=0.5, restart_backoff_max_seconds=2.0,
    )


def remote_phase(a: argparse.Namespace, settings: Any, files: list[Path], warm_file: Path | None, root: Path,
                 kill: bool) -> dict[str, Any]:
    """The daemon with ``engine.url``; with ``kill``, the server is SIGKILLed once
    --kill-server-after pages are published and started again at once on the same port: the
    result says how long it was down and how long after it answered again the next page was done."""
    server, state = server_for(a, settings, root.parent)
    t = time.perf_counter()
    waited = server.wait_ready(a.server_start_timeout)
    result: dict[str, Any] = {"server_command": server.command, "server_ready_waited_s": round(waited, 1),
                              "server_pid": server.pid}
    print(f"[remote] vllm serve answering after {time.perf_counter() - t:.1f} s of waiting", flush=True)
    r_settings = remote_settings(a, settings, server.url)
    kill_after = a.kill_server_after or max(1, len(files) // 4)
    events: dict[str, float] = {}

    def killer(rows: list[sqlite3.Row]) -> None:
        warm_name = warm_file.name if warm_file else None
        published = [r for r in rows if r["state"] == "published" and r["rel_path"] != warm_name]
        if "killed_at" not in events and len(published) >= kill_after:
            events["killed_at"] = server.kill9()
            events["published_at_kill"] = len(published)
            print(f"[remote] vllm serve killed (SIGKILL) with {len(published)} pages published", flush=True)
            server.start()
            server.save(state)

            def wait_back() -> None:
                try:
                    server.wait_ready(a.server_start_timeout)
                    events["answering_at"] = time.time()
                    print(f"[remote] vllm serve answering again {events['answering_at'] - events['killed_at']:.1f} s "
                          "after the kill", flush=True)
                except RuntimeError as error:
                    events["restart_error"] = repr(error)  # type: ignore[assignment]

            threading.Thread(target=wait_back, daemon=True).start()

    try:
        result.update(daemon_phase(a, r_settings, files, warm_file, root, killer if kill else None))
    finally:
        server.save(state)
    if kill:
        result["kill"] = dict(events)
        killed, back = events.get("killed_at"), events.get("answering_at")
        done = sorted(r["updated_at"] for r in journal_docs(root / "state") if r["state"] == "published")
        if killed and back:
            after = [d for d in done if d > back]
            result["kill"].update({
                "down_s": round(back - killed, 1),
                "first_page_after_back_s": round(after[0] - back, 1) if after else None,
                "last_page_after_back_s": round(after[-1] - back, 1) if after else None,
                "pages_published_while_down": sum(1 for d in done if killed < d <= back),
            })
    # Nothing lost, nothing twice: one outbox folder per document, every document published once.
    rows = journal_docs(root / "state")
    folders = [p for p in (root / "outbox").iterdir() if p.is_dir() and not p.name.startswith(".")]
    result["accounting"] = {"documents": len(rows), "published": sum(r["state"] == "published" for r in rows),
                            "failed": sum(r["state"] == "failed" for r in rows), "outbox_folders": len(folders),
                            "distinct_outbox_folders": len({p.name for p in folders})}
    return result

