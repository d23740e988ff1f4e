"""Which processes chandrad takes for its vLLM engines, and ends when nobody will use them.

Real processes stand in for the EngineCore: a multiprocessing "spawn" child is what vLLM's
EngineCore is until it retitles itself, so it is recognised the same way.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

from chandrad.engine.processes import (
    ENGINE_RECORDS,
    end_engines_left_behind,
    end_process_tree,
    is_vllm_process,
    process_argv,
    record_engine_process,
)


def spawn_child() -> multiprocessing.process.BaseProcess:
    """A spawned multiprocessing child, once it runs its own program (until its exec, /proc shows the
    parent's command line: on a busy machine that lasted long enough to fail the checks below)."""
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    for _ in range(500):
        if "-c" in process_argv(child.pid):
            break
        time.sleep(0.01)
    return child


def test_an_abandoned_engine_start_ends_only_a_vllm_child_never_a_tool_named_like_one(tmp_path):
    # Ending a load nobody waits for SIGKILLs the EngineCore it spawned; the pdftoppm or gs running
    # meanwhile may read a file called EngineCore.pdf in an inbox called VLLM, and must live.
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             str(tmp_path / "VLLM" / "EngineCore.pdf"), "spawn_main"])
    child = spawn_child()
    try:
        assert not is_vllm_process(tool.pid)
        assert is_vllm_process(child.pid), "a multiprocessing child about to become an EngineCore"
        end_process_tree([tool.pid, child.pid])
        child.join(10)
        assert child.exitcode == -9
        assert tool.poll() is None, "the tool was killed"
        end_process_tree([999_999_999])  # long gone: nothing to do, no error
    finally:
        tool.kill()
        tool.wait()
        if child.is_alive():
            child.kill()


def test_the_next_start_ends_engines_a_killed_chandrad_left_but_never_those_of_a_running_one(tmp_path):
    # vLLM's EngineCore outlives a chandrad killed with -9 and keeps its GPU memory.
    orphan, owned = spawn_child(), spawn_child()
    gone_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_owner.wait()
    try:
        record_engine_process(tmp_path, orphan.pid)
        record_engine_process(tmp_path, owned.pid)  # owned by this process, which runs on
        orphan_record = tmp_path / ENGINE_RECORDS / f"{orphan.pid}.json"
        entry = json.loads(orphan_record.read_text())
        # As if a chandrad now gone had spawned it (that process's pid and start time are known).
        entry.update(owner=gone_owner.pid, owner_started=entry["owner_started"] - 1)
        orphan_record.write_text(json.dumps(entry))

        # Records that name no process of this boot are dropped, never acted on (nor a reason to fail).
        other_boot = {**entry, "pid": owned.pid, "boot": "another-boot"}
        (tmp_path / ENGINE_RECORDS / "1.json").write_text(json.dumps({"pid": 1}))
        (tmp_path / ENGINE_RECORDS / "2.json").write_text(json.dumps(other_boot))
        (tmp_path / ENGINE_RECORDS / "3.json").write_text("{half a rec")

        assert end_engines_left_behind(tmp_path) == [orphan.pid]
        orphan.join(10)
        assert orphan.exitcode == -9
        assert owned.is_alive(), "an engine whose chandrad still runs was ended"
        assert sorted(path.name for path in (tmp_path / ENGINE_RECORDS).iterdir()) == [f"{owned.pid}.json"]
        assert end_engines_left_behind(Path(tmp_path / "never-used")) == []
    finally:
        for child in (orphan, owned):
            if child.is_alive():
                child.kill()
