"""Several chandrad hosts on one shared inbox, as real daemons (child processes) with their own
state_dir and host_id and the same inbox, outbox, archive and failed folders: every file is
published once by exactly one of them, a killed host's claimed documents are taken over by the
survivor, and a copy taken in by one host of content another host took in is a duplicate."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.errors import ConfigError, InboxUnreachableError
from chandrad.hosts import claims, identity
from chandrad.hosts.identity import check_host_id_free
from chandrad.hosts.seen import mark_seen
from chandrad.hosts.takeover import Hosts, HostWatch
from chandrad.runtime import INBOX_THREADS, now_iso
from chandrad.storage import folders
from chandrad.storage.journal import Journal
from tests.conftest import DaemonProcess, wait_for


def page_png(text: str) -> bytes:
    """A page whose short side needs no upscale (Chandra's 1 536 px), mostly white: the cheapest
    page for tesseract to read."""
    image = Image.new("L", (1536, 1536), 255)
    ImageDraw.Draw(image).text((40, 80), text, fill=0)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def event_time(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def shared_folders(root: Path) -> dict[str, Path]:
    return {name: root / name for name in ("inbox", "outbox", "archive", "failed")}


def make_host(
    root: Path, host_id: str, shared: dict[str, Path], takeover_seconds: float, inbox_config: str = ""
) -> DaemonProcess:
    """A daemon with its own state_dir (under ``root/<host_id>``) on the shared folders."""
    home = root / host_id
    home.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(
        home,
        # Small pages read as they are (no upscale to 1024 px): tesseract's time is most of a test's.
        extra_config=f'host_id = "{host_id}"\ntakeover_seconds = {takeover_seconds}\nmax_documents_in_flight = 4\n'
        "[prepare]\nmin_short_side_px = 0\n",
        # Bursts of hundreds of one-line PNGs: orientation detection (a tesseract each) is not what
        # these tests prove, and would double their CPU on CI's two cores.
        inbox_config=(
            f'outbox = "{shared["outbox"]}"\narchive = "{shared["archive"]}"\nfailed = "{shared["failed"]}"\n'
            f"rotate_pages = false\n{inbox_config}"
        ),
    )
    daemon.config.write_text(
        daemon.config.read_text().replace(f'path = "{home / "inbox"}"', f'path = "{shared["inbox"]}"')
    )
    daemon.inbox, daemon.outbox, daemon.archive, daemon.failed = (
        shared["inbox"], shared["outbox"], shared["archive"], shared["failed"]
    )
    return daemon


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    shared = shared_folders(tmp_path / "share")
    shared["inbox"].mkdir(parents=True)
    made: list[DaemonProcess] = []

    def make(host_id: str, takeover_seconds: float = 3, inbox_config: str = "") -> DaemonProcess:
        daemon = make_host(tmp_path, host_id, shared, takeover_seconds, inbox_config)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        if daemon.alive:
            if daemon.proc is not None:
                daemon.proc.send_signal(signal.SIGCONT)
            daemon.kill9()


def drop_all(inbox: Path, files: dict[str, bytes]) -> None:
    """Write every file under a temporary name first, then rename them in, all at once."""
    parts = inbox.parent / "parts"
    parts.mkdir(exist_ok=True)
    for name, data in files.items():
        (parts / name).write_bytes(data)
    for name in files:
        os.replace(parts / name, inbox / name)


def outputs(outbox: Path) -> list[str]:
    """The published document folders in the outbox (a document published twice shows as ``x (2)``)."""
    return sorted(p.name for p in outbox.iterdir() if p.name != folders.DAEMON_DIR) if outbox.exists() else []


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.exists() else []


def published_by(daemon: DaemonProcess) -> int:
    return len(daemon.journal_rows("SELECT id FROM documents WHERE state = 'published'"))


def check_each_published_once(names: list[str], *daemons: DaemonProcess) -> None:
    stems = sorted(name.removesuffix(".png") for name in names)
    outbox, archive = daemons[0].outbox, daemons[0].archive
    assert outputs(outbox) == stems, "each file published once: no 'x (2)', none missing"
    assert files_in(archive) == sorted(names), "each original archived once"
    for stem in stems:
        assert json.loads((outbox / stem / f"{stem}.json").read_text())["file_name"] == f"{stem}.png"
    assert files_in(daemons[0].failed) == []
    assert sum(published_by(daemon) for daemon in daemons) == len(names)


@pytest.mark.timeout(600)
def test_two_hosts_on_one_inbox_publish_a_burst_of_300_files_each_once_and_share_the_work(hosts):
    first, second = hosts("host-a"), hosts("host-b")
    first.start()
    second.start()
    names = [f"burst-{n:03d}.png" for n in range(300)]
    started = time.monotonic()
    drop_all(first.inbox, {name: page_png(f"Page {n}") for n, name in enumerate(names)})
    wait_for(lambda: len(files_in(first.archive)) >= 300, 540, "300 originals archived")
    seconds = time.monotonic() - started
    assert first.stop() == 0 and second.stop() == 0
    check_each_published_once(names, first, second)
    shares = published_by(first), published_by(second)
    assert min(shares) > 0, f"both hosts did part of the work: {shares}"
    print(f"300 files on two hosts: {seconds:.1f} s, published {shares[0]} + {shares[1]}")
    assert first.leftovers_once_cleared() == []


def test_a_killed_hosts_claims_are_taken_over_and_published_once_and_never_again_by_it(hosts):
    first, second = hosts("host-a"), hosts("host-b")
    names = [f"kill-{n:02d}.png" for n in range(40)]
    pages = {name: page_png(f"Kill {n}") for n, name in enumerate(names)}
    print(kill_a_host_and_check_the_takeover(first, second, names, lambda: drop_all(first.inbox, pages)))


def kill_a_host_and_check_the_takeover(
    first: DaemonProcess, second: DaemonProcess, names: list[str], drop: Callable[[], None]
) -> str:
    """Both hosts (takeover_seconds = 3) started (host-b once host-a holds claims), ``names``
    dropped by ``drop``; host-a killed with SIGKILL mid-run: host-b takes its claims over, not
    sooner than takeover_seconds allow, and publishes them; host-a restarted neither processes them again nor reports them. Shared by the
    local inbox and the Samba share; returns the figures."""
    first.start()
    drop()
    claims = folders.host_claims(first.inbox, "host-a")

    def claimed_by_first() -> list[str]:
        return [p.name for p in claims.iterdir() if p.is_dir()] if claims.exists() else []

    # host-b starts once host-a holds claims: intake claims a burst in batches (up to 32 at once),
    # so of two hosts started together the first to see the burst may take all of it, and host-a
    # would have nothing to be killed with (seen 1 run in 4).
    wait_for(lambda: len(claimed_by_first()) >= 3, 60, "host-a to claim part of the burst")
    second.start()
    wait_for(lambda: published_by(first) >= 3 and len(claimed_by_first()) >= 3, 60, "host-a in the middle of work")
    killed_at = time.time()  # before the signal: host-a may beat once more until it is dead
    first.kill9()
    held = claimed_by_first()
    wait_for(lambda: len(files_in(first.archive)) >= len(names), 90, "every original archived")
    all_done = time.time() - killed_at
    taken = [e for e in second.events() if e.get("event") == "took over a document of a host that stopped"]
    assert taken and {e["doc"] for e in taken} <= set(held), f"host-b took host-a's claims over (held: {held})"
    to_first_takeover = min(event_time(e) for e in taken) - killed_at
    # Its last beat came at most one heartbeat interval before it died, and host-b counts the
    # takeover_seconds from when it saw that beat: no takeover sooner than their difference.
    earliest = 3 - identity.heartbeat_interval(3)
    assert to_first_takeover >= earliest - 0.05, "not before takeover_seconds without a heartbeat change"

    def ready_count() -> int:
        return sum(e.get("event") == "chandrad ready" for e in first.events())

    readies = ready_count()  # the log is appended to: the first run's "ready" is in it too
    first.start()  # restarted: what was taken over is neither processed again nor reported
    wait_for(lambda: ready_count() > readies, 60, "host-a ready again")
    time.sleep(2)
    assert first.stop() == 0 and second.stop() == 0
    check_each_published_once(names, first, second)
    forgotten = {e["doc"] for e in first.events() if e.get("event") == "document taken over by another host"}
    assert forgotten <= {e["doc"] for e in taken}
    assert first.journal_rows("SELECT id FROM documents WHERE state != 'published'") == []
    refused = [e for e in first.events() if e.get("event") in ("document failed", "document will be retried")]
    assert refused == [], "a document taken over is neither failed nor lost"
    assert first.leftovers_once_cleared() == []
    return (
        f"kill -9 of host-a holding {len(held)} claims: {len(taken)} taken over by host-b, the first "
        f"{to_first_takeover:.1f} s after the kill, all {len(names)} archived {all_done:.1f} s after it "
        f"(takeover_seconds = 3); host-a restarted forgot {len(forgotten)}"
    )


def test_one_content_claimed_by_two_hosts_is_published_once_and_the_copy_is_a_duplicate(hosts):
    first, second = hosts("host-a", takeover_seconds=600), hosts("host-b", takeover_seconds=600)
    check_a_copy_another_host_claims_is_a_duplicate(
        first, second, lambda name, data: drop_all(first.inbox, {name: data})
    )


def check_a_copy_another_host_claims_is_a_duplicate(
    first: DaemonProcess, second: DaemonProcess, write: Callable[[str, bytes], None]
) -> None:
    """host-a claims ``original.png`` and is frozen (SIGSTOP) before it publishes; host-b, started
    then, claims ``copy.png`` (the same bytes): it fails it as a duplicate naming the original and
    host-a; host-a, thawed, publishes the original. Shared by the local inbox and the Samba share."""
    data = page_png("Twice")
    first.start()
    write("original.png", data)
    wait_for(lambda: first.states().get("original.png") in ("queued", "preparing", "inferring", "publishing",
                                                            "published"), 30, "host-a to claim the original")
    assert first.proc is not None
    first.proc.send_signal(signal.SIGSTOP)
    try:
        second.start()
        write("copy.png", data)
        wait_for(lambda: second.states().get("copy.png") == "failed", 60, "host-b to refuse the copy")
    finally:
        first.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: first.states().get("original.png") == "published", 60, "host-a to publish the original")
    assert first.stop() == 0 and second.stop() == 0
    assert outputs(first.outbox) == ["original"]
    assert files_in(first.failed) == ["copy.png", "copy.png.error.json"]
    report = json.loads((first.failed / "copy.png.error.json").read_text())
    assert report["kind"] == "duplicate" and "original.png" in report["reason"] and "host-a" in report["reason"]
    assert "copy.png" not in first.states() and "original.png" not in second.states()


# -- the parts, in process -----------------------------------------------------------------------


def test_a_host_is_dead_only_once_its_heartbeat_is_unchanged_for_takeover_seconds_on_our_clock():
    now = [100.0]
    watch = HostWatch(10, clock=lambda: now[0])
    inbox = Path("/share/inbox")
    watch.observe(inbox, "b", b"seq 1")
    now[0] += 9
    assert not watch.is_dead(inbox, "b"), "seen first just now: a host just started waits takeover_seconds"
    watch.observe(inbox, "b", b"seq 2")
    now[0] += 9.5
    watch.observe(inbox, "b", b"seq 2")
    assert not watch.is_dead(inbox, "b")
    now[0] += 0.5
    assert watch.is_dead(inbox, "b") and watch.hosts() == {"b": 10.0}
    watch.observe(inbox, "b", b"seq 3")
    assert not watch.is_dead(inbox, "b"), "a restarted host is alive again"


def _clash_settings(tmp_path: Path) -> Settings:
    inbox = InboxSettings.model_validate({"path": tmp_path / "inbox"})
    return Settings(state_dir=tmp_path / "state", inbox=(inbox,), host_id="scan1", takeover_seconds=60,
                    engine=EngineSettings(kind="tesseract"), metrics_address="")


def _write_beat(settings: Settings, **content: Any) -> None:
    beat = folders.heartbeat_path(settings.inbox[0].path, "scan1")
    beat.parent.mkdir(parents=True, exist_ok=True)
    beat.write_text(json.dumps({"host_id": "scan1", "seq": 7, **content}))


def test_a_host_id_whose_heartbeat_another_machine_wrote_recently_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "machine_id", lambda: "this-machine")
    settings = _clash_settings(tmp_path)
    # As Hosts.beat writes it: the time as ISO UTC (a float here would hide a parsing bug).
    _write_beat(settings, machine_id="not-this-machine", instance="theirs", pid=1, at=now_iso(time.time() - 5))
    with pytest.raises(ConfigError, match="host_id scan1 is in use by another daemon .machine-id not-this-machine"):
        check_host_id_free(settings)
    check_host_id_free(settings, now=time.time() + 120)  # an old heartbeat: that machine is gone
    # A heartbeat of a chandrad from before instance ids is judged by machine-id alone.
    _write_beat(settings, machine_id="not-this-machine", pid=1, at=time.time() - 5)
    with pytest.raises(ConfigError, match="in use by another daemon"):
        check_host_id_free(settings)


def test_without_machine_ids_two_daemons_are_told_apart_by_their_state_dirs_instance_id(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "machine_id", lambda: "")  # a container without /etc/machine-id
    settings = _clash_settings(tmp_path)
    ours = identity.instance_id(settings.state_dir)
    assert ours == identity.instance_id(settings.state_dir) == (settings.state_dir / "instance-id").read_text()
    _write_beat(settings, machine_id="", instance=ours, pid=1, at=now_iso())
    check_host_id_free(settings)  # our own heartbeat from before a restart
    _write_beat(settings, machine_id="", instance="a-cloned-vm", pid=1, at=now_iso())
    with pytest.raises(ConfigError, match="instance a-cloned-vm.*remove .*heartbeat"):
        check_host_id_free(settings)


def test_on_one_machine_a_second_daemon_is_refused_while_it_runs_and_a_replaced_state_dir_is_not(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(identity, "machine_id", lambda: "this-machine")
    settings = _clash_settings(tmp_path)
    here = identity.pid_space()
    if not here:
        pytest.skip("this /proc does not give a boot id and pid namespace")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_beat(settings, machine_id="this-machine", instance="other-state-dir", pid_space=here, pid=other.pid,
                    at=now_iso())
        with pytest.raises(ConfigError, match=f"another chandrad on this machine, pid {other.pid}"):
            check_host_id_free(settings)
    finally:
        other.kill()
        other.wait()
    check_host_id_free(settings)  # its process is gone: our own previous life, state_dir replaced
    # The same machine-id in another kernel or pid namespace (a clone, a container): its pid says
    # nothing here, so it is refused whether or not that pid exists here.
    _write_beat(settings, machine_id="this-machine", instance="a-clone", pid_space="other-boot/1", pid=999999,
                at=now_iso())
    with pytest.raises(ConfigError, match="another boot or pid namespace"):
        check_host_id_free(settings)


def test_a_state_dir_copied_to_another_machine_is_not_taken_for_ourselves(tmp_path, monkeypatch):
    """A golden image with the state_dir (and its instance-id) in it, cloned: each clone has its
    own machine-id, and the second to start must not share the first one's claims."""
    monkeypatch.setattr(identity, "machine_id", lambda: "clone-2")
    settings = _clash_settings(tmp_path)
    ours = identity.instance_id(settings.state_dir)
    _write_beat(settings, machine_id="clone-1", instance=ours, pid=1, at=now_iso())
    with pytest.raises(ConfigError, match="a copy of this state_dir on machine-id clone-1"):
        check_host_id_free(settings)
    _write_beat(settings, machine_id="clone-2", instance=ours, pid=1, at=now_iso())
    check_host_id_free(settings)  # this machine, this state_dir: ourselves before a restart


def test_the_seen_marker_names_the_first_document_and_the_second_finds_it(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    try:
        first = journal.add_document("scans", "a.pdf", "f" * 64, 1, 1)
        second = journal.add_document("scans", "b.pdf", "f" * 64, 1, 1)
        assert mark_seen(tmp_path, "f" * 64, "host-a", first) is None
        assert mark_seen(tmp_path, "f" * 64, "host-a", first) is None, "our own marker is no twin"
        twin = mark_seen(tmp_path, "f" * 64, "host-b", second)
        assert twin is not None and (twin["doc_id"], twin["host_id"], twin["rel_path"]) == (first.id, "host-a", "a.pdf")
    finally:
        journal.close()


def test_a_name_another_host_placed_a_moment_ago_is_never_replaced_by_a_move(tmp_path):
    """The name is reserved with O_EXCL before the rename: taken, the next one is used."""
    from chandrad.storage.durable import reserve_name

    target = tmp_path / "archive" / "scan.pdf"
    target.parent.mkdir()
    target.write_bytes(b"another host's original")
    assert not reserve_name(target, named_before=False)
    assert not reserve_name(target, named_before=True), "a file with content is someone's, even if named before"
    assert target.read_bytes() == b"another host's original"
    mine = tmp_path / "archive" / "scan (2).pdf"
    assert reserve_name(mine, named_before=False) and mine.stat().st_size == 0
    assert reserve_name(mine, named_before=True), "our own placeholder, after a crash: still ours"
    assert not reserve_name(mine, named_before=False)


async def test_a_host_whose_claim_was_taken_while_it_worked_never_publishes_the_document(tmp_path):
    """Its heartbeat looked dead to another host, which took the claim folder over while this one
    was reading the pages: the check before publishing finds the original gone to that host, and
    the document is forgotten here (no output, no failure, no marker left)."""
    from chandrad.engine.base import PageRequest, PageResult
    from tests.reliability.chaoslib import simple_pdf
    from tests.test_stages import PageEngine, make_world

    world = make_world(tmp_path, host_id="host-a")
    try:
        doc = await world.take_in("report.pdf", simple_pdf(2, label="taken"))
        claim = folders.claim_dir(world.inbox.path, "host-a", doc.id)

        class TakenWhileReading(PageEngine):
            async def ocr(self, request: PageRequest) -> PageResult:
                if request.page_no == 2 and claim.exists():  # host-b: the marker, then the rename
                    folders.taken_marker(world.inbox.path, "host-a", doc.id).write_text('{"host_id": "host-b"}')
                    folders.host_claims(world.inbox.path, "host-b").mkdir(parents=True)
                    claim.rename(folders.claim_dir(world.inbox.path, "host-b", doc.id))
                return await super().ocr(request)

        outcome = await world.stages(TakenWhileReading()).run(doc.id)
        assert outcome.state == "taken over"
        assert world.outbox_documents() == [] and list(world.archive.iterdir()) == []
        assert world.journal.find(doc.id) is None
        assert not folders.taken_marker(world.inbox.path, "host-a", doc.id).exists()
        assert not folders.staging_dir(world.inbox.outbox, "host-a", doc.id).parent.exists()
        assert (folders.claim_dir(world.inbox.path, "host-b", doc.id) / "report.pdf").is_file(), "host-b's now"
    finally:
        world.journal.close()


async def test_at_start_up_a_claim_folder_the_journal_never_recorded_is_adopted_and_a_stale_marker_dropped(
    recovery_world,
):
    """A crash between a takeover's rename and its journal commit leaves a claim folder of ours
    with its record and file: it becomes a queued document under the same id. A taker that stopped
    between its marker and its rename leaves a marker beside a claim still ours: it is removed."""
    from chandrad.document.recovery import recover
    from chandrad.hosts.claims import ClaimRecord, write_claim_record

    world = recovery_world
    me = world.settings.host_id
    adopted = folders.claim_dir(world.inbox.path, me, "00aa00aa00aa00aa")
    write_claim_record(adopted, ClaimRecord("sub/taken.pdf", "ab" * 32, 4, 1, "other-name", 1000.0, "host-z"))
    (adopted / "taken.pdf").write_bytes(b"scan")
    kept = world.add("kept.pdf", "inferring")
    kept_file = world.claimed(kept)
    world.journal.set_state(kept.id, "inferring", claimed_path=str(kept_file))
    marker = folders.taken_marker(world.inbox.path, me, kept.id)
    marker.write_text('{"host_id": "host-z"}')
    resumed = await recover(world.runtime)
    assert set(resumed) == {kept.id, "00aa00aa00aa00aa"}
    row = world.journal.get("00aa00aa00aa00aa")
    assert (row.state, row.rel_path, row.inbox, row.claimed_path) == (
        "queued", "sub/taken.pdf", world.inbox.name, str(adopted / "taken.pdf"))
    assert not marker.exists() and kept_file.exists()


def _publishing_with_a_marker(world: Any, name: str, at_final_path: bytes, marker: dict[str, object]) -> Any:
    """A document of ours journaled "publishing", its claim gone, ``at_final_path`` at its journaled
    archive name, and a ``.taken`` marker of host-z beside our claims: as a crash leaves it."""
    doc = world.add(name, "publishing")
    final = world.inbox.path.parent / "archive" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    final.write_bytes(at_final_path)
    world.journal.set_state(doc.id, "publishing", claimed_path=str(world.claimed(doc, data=None)), final_path=str(final))
    folders.taken_marker(world.inbox.path, world.settings.host_id, doc.id).write_text(json.dumps(marker))
    return doc


async def test_a_stale_marker_does_not_make_recovery_forget_a_document_whose_original_we_had_archived(
    recovery_world,
):
    """A taker that stopped between its marker and its rename, then our publish: outputs renamed
    into the outbox and the original moved to its archive name, and a crash before the journal
    said published. The claim is gone, but the original is at our own final_path: ours, resumed."""
    from chandrad.document.recovery import recover

    world = recovery_world
    ours = _publishing_with_a_marker(world, "done.pdf", b"scan", {"host_id": "host-z"})  # doc.size is 4
    assert await recover(world.runtime) == [ours.id]
    assert world.journal.get(ours.id).state == "publishing"
    assert not folders.taken_marker(world.inbox.path, world.settings.host_id, ours.id).exists()

    # Only our empty reservation there: the move had not happened, and the marker's host has it.
    reserved = _publishing_with_a_marker(world, "taken.pdf", b"", {"host_id": "host-z"})
    # A taker whose rename succeeded says so: then even the original at our final_path may be its
    # move (we journal the name before we reserve it), and the marker is believed.
    renamed = _publishing_with_a_marker(world, "moved.pdf", b"scan", {"host_id": "host-z", "renamed": True})
    assert await recover(world.runtime) == [ours.id], "the first is still ours; the two others are forgotten"
    assert world.journal.find(reserved.id) is None and world.journal.find(renamed.id) is None


@pytest.fixture
def recovery_world(tmp_path):
    from tests.test_recovery import world as make

    yield from make.__wrapped__(tmp_path)


async def test_the_heartbeat_is_written_while_every_thread_of_the_default_executor_is_busy(tmp_path):
    """Documents in progress hold the loop's default threads while their pages render; a heartbeat
    probe queued behind them ran out its 20 s deadline as if the share had hung, and a host whose
    beats keep failing for takeover_seconds is taken over while alive."""
    from tests.test_intake import default_executor_held, make_world

    world = make_world(tmp_path)
    try:
        async with default_executor_held():
            await asyncio.wait_for(Hosts(world.runtime, lambda doc_id: None).beat(), timeout=10)
        beat = json.loads(folders.heartbeat_path(world.inbox.path, world.runtime.host_id).read_text())
        assert beat["seq"] == 1
    finally:
        world.runtime.close()
        world.journal.close()


async def test_a_share_that_stopped_answering_ties_up_its_own_inbox_threads_never_another_inboxs(
    tmp_path, monkeypatch
):
    """A check on a dead share (a hard NFS mount, a gone SMB server) holds its thread until the share
    answers, maybe never. The checks in flight when it stopped stay stuck (a busy daemon has more than
    a pool has threads), and its heartbeats and document checks come a few a minute after: in one pool
    for all inboxes, each took one more thread, and then no inbox's intake or heartbeat ran."""
    from tests.test_intake import make_world

    monkeypatch.setattr(folders, "PROBE_TIMEOUT_SECONDS", 0.2)
    world = make_world(tmp_path)
    dead_share = tmp_path / "dead-share"
    share_answers = threading.Event()

    def stat_on_the_dead_share() -> bool:  # test double for a server gone behind the mount
        return share_answers.wait(timeout=60)

    try:
        in_flight_when_it_stopped = await asyncio.gather(
            *(world.runtime.probe(dead_share, stat_on_the_dead_share) for _ in range(2 * INBOX_THREADS)),
            return_exceptions=True,
        )
        assert all(isinstance(error, InboxUnreachableError) for error in in_flight_when_it_stopped)
        for _ in range(3 * INBOX_THREADS):  # the checks that come after fail at once
            with pytest.raises(InboxUnreachableError, match="has not answered a check"):
                await world.runtime.probe(dead_share, stat_on_the_dead_share)
        await Hosts(world.runtime, lambda doc_id: None).beat()
        assert folders.heartbeat_path(world.inbox.path, world.runtime.host_id).exists(), "the healthy inbox's beat"
        share_answers.set()
        answered = None
        for _ in range(100):  # the stuck checks return now; the next ones run again
            try:
                answered = await world.runtime.probe(dead_share, lambda: "answered")
                break
            except InboxUnreachableError:
                await asyncio.sleep(0.05)
        assert answered == "answered", "the share's checks run again once it answers"
    finally:
        share_answers.set()
        world.runtime.close()
        world.journal.close()


def test_a_survivor_whose_takeover_came_second_leaves_the_winners_marker_as_the_winner_left_it(tmp_path):
    """Two survivors take one dead host's claim at once: the second one's marker, written just
    before its rename failed, would say it took the document and had not renamed it yet (the dead
    host, coming back after the winner published and cleaned up, would take that for a taker
    stopped half-way). The loser puts the winner's name and "renamed" back."""
    import json as _json

    from chandrad.hosts import takeover
    from chandrad.storage import folders

    inbox = tmp_path / "inbox"
    dead = folders.claim_dir(inbox, "dead", "doc1")
    dead.mkdir(parents=True)
    (dead / "scan.pdf").write_bytes(b"%PDF-1.4")
    assert takeover._take_folder(inbox, "dead", "winner", "doc1") == folders.claim_dir(inbox, "winner", "doc1")
    assert takeover._take_folder(inbox, "dead", "loser", "doc1") is None
    marker = _json.loads(folders.taken_marker(inbox, "dead", "doc1").read_text())
    assert marker["host_id"] == "winner" and marker["renamed"] is True
    assert (folders.claim_dir(inbox, "winner", "doc1") / "scan.pdf").exists()


def test_a_claim_record_with_keys_this_version_does_not_know_is_still_read(tmp_path):
    """A newer chandrad on the same share writes keys this one has never heard of: the document must
    still be taken over (its path, hash and size are what a takeover needs), not left stranded."""
    folder = tmp_path / "claim"
    record = claims.ClaimRecord("letters/scan.pdf", "ab" * 32, 1234, 5, "inbox", 1.5, "host-a", final_path="/a/b.pdf")
    claims.write_claim_record(folder, record)
    written = json.loads(folders.claim_record(folder).read_text())
    folders.claim_record(folder).write_text(json.dumps({**written, "from_a_later_version": {"x": 1}}))
    assert claims.read_claim_record(folder) == record
    folders.claim_record(folder).write_text(json.dumps(["not", "a", "record"]))
    assert claims.read_claim_record(folder) is None, "unreadable is None, never an exception"
