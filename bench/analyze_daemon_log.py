#!/usr/bin/env python
"""Where the daemon's time went in one bench/overhead.py run, from its JSON log and RESULT file.

Usage: python bench/analyze_daemon_log.py RESULT.json DAEMON.log[.gz] [--out ANALYSIS.json] [--step 4]
       [--phase remote]   (the daemon on engine.url: RESULT's "remote" phase instead of "daemon")

Prints and saves: when documents were queued after the drop (intake curve and its mean gap),
when pages were sent to the engine and came back, pages at the engine every --step seconds
(for the bare engine the same figure follows from Little's law in RESULT: mean_pages_at_engine),
and the daemon's main-thread (event loop) CPU per page against the bare engine's.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
from pathlib import Path


def events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", errors="replace") as handle:
        for line in handle:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def ts(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("log")
    ap.add_argument("--out")
    ap.add_argument("--step", type=float, default=4.0)
    ap.add_argument("--skip-file", default="page-warm.pdf")
    ap.add_argument("--phase", default="daemon", help="the daemon's phase in RESULT (remote: on engine.url)")
    a = ap.parse_args()
    result = json.loads(Path(a.result).read_text())
    daemon, bare = result.get(a.phase, {}), result.get("bare", {})
    if not daemon.get("pages") or not daemon.get("wall_s"):
        raise SystemExit(f"{a.result}: the daemon published no timed page (stopped in "
                         f"{daemon.get('stopped_in', 'the timed window')}); nothing to analyse")
    if bare and not bare.get("pages"):
        bare = {}  # a bare side cut before its first page has no per-page figures
    evs = [e for e in events(Path(a.log)) if "timestamp" in e and e.get("file") != a.skip_file]
    queued = {e["doc"]: ts(e) for e in evs if e.get("event") == "document queued"}
    done = {e["doc"]: (ts(e), float(e["seconds"])) for e in evs if e.get("event") == "page done"}
    published = {e["doc"]: ts(e) for e in evs if e.get("event") == "document published"}
    t0 = max(published.values()) - daemon["wall_s"]  # the drop: RESULT's wall ends at the last publish
    q = sorted(t - t0 for t in queued.values())
    sent = sorted(t - s - t0 for t, s in done.values())
    back = sorted(t - t0 for t, _ in done.values())
    spans = [(t - s - t0, t - t0) for t, s in done.values()]
    n = len(q)
    every = max(1, n // 12)
    steps = int(daemon["wall_s"] // a.step) + 1
    out = {
        "source": {"result": a.result, "log": a.log},
        "pages": n,
        "queued_s_after_drop_every_%d" % every: [round(x, 1) for x in q[::every]] + [round(q[-1], 1)],
        "intake_mean_gap_ms": round(1000 * (q[-1] - q[0]) / max(1, n - 1), 1),
        "intake_rate_docs_per_s": round((n - 1) / (q[-1] - q[0]), 3) if n > 1 and q[-1] > q[0] else None,
        "sent_to_engine_s_every_%d" % every: [round(x, 1) for x in sent[::every]] + [round(sent[-1], 1)],
        "back_from_engine_s_every_%d" % every: [round(x, 1) for x in back[::every]] + [round(back[-1], 1)],
        "pages_at_engine_every_%gs" % a.step: [sum(1 for s, e in spans if s <= k * a.step < e) for k in range(steps)],
        "daemon_mean_pages_at_engine": daemon.get("mean_pages_at_engine"),
        "bare_mean_pages_at_engine": bare.get("mean_pages_at_engine"),
        "main_thread_ms_per_page": {
            "daemon": round(1000 * daemon["cpu"]["main_thread_cpu_s"] / daemon["pages"], 1),
            **({"bare": round(1000 * bare["cpu"]["main_thread_cpu_s"] / bare["pages"], 1)} if bare else {}),
        },
        "main_thread_busy_frac": {"daemon": daemon["cpu"]["main_thread_busy_frac"],
                                  **({"bare": bare["cpu"]["main_thread_busy_frac"]} if bare else {})},
        "bare_loop_lag_max_s": round(bare.get("loop_lag", {}).get("max_ms", 0) / 1000, 2) if bare else None,
        "micro_ms_per_page_one_core": result.get("micro"),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
