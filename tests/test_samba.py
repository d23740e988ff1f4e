"""Scanners on a network share: a real Samba server (smbd on a loopback port, its own config and a
throwaway user) whose share is the inbox, and a real SMB2/3 client (smbprotocol) behaving the way
office scanners do. This is the "Samba server host" topology: smbd writes locally, so chandrad
sees inotify events; one test forces polling, as used where the inbox is a CIFS mount. Mounting
CIFS itself needs kernel support this test machine does not offer to tests, so it is not tested.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from tests.conftest import DaemonProcess, corpus_file, wait_for
from tests.test_hosts import (
    check_a_copy_another_host_claims_is_a_duplicate,
    check_each_published_once,
    files_in,
    kill_a_host_and_check_the_takeover,
    make_host,
    published_by,
)
from tests.test_hosts import page_png as hosts_page

smbclient = pytest.importorskip("smbclient", reason="make test installs smbprotocol")

USER, PASSWORD = "chandrad-scan", "Scan-Test-Pw-1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def samba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    if os.geteuid() != 0 or shutil.which("smbd") is None:
        pytest.fail("the share tests need root and Debian's samba package (make test installs it)")
    # Not under pytest's tmp dir: that is private to root (0700), and smbd serves as the share user.
    root = Path(tempfile.mkdtemp(prefix="chandrad-samba-"))
    root.chmod(0o755)
    share = root / "share"
    for sub in ("run", "lock", "state", "cache", "private", "ncalrpc", "share"):
        (root / sub).mkdir()
    port = free_port()
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", USER], check=True)
    os.chown(share, pwd.getpwnam(USER).pw_uid, -1)
    config = root / "smb.conf"
    dirs = "\n".join(f"  {key} = {root / sub}" for key, sub in (
        ("pid directory", "run"), ("lock directory", "lock"), ("state directory", "state"),
        ("cache directory", "cache"), ("private dir", "private"), ("ncalrpc dir", "ncalrpc")))
    config.write_text(
        f"[global]\n  netbios name = CHANDRADTEST\n  server role = standalone server\n  security = user\n"
        f"  map to guest = never\n  smb ports = {port}\n  interfaces = 127.0.0.1\n  bind interfaces only = yes\n"
        f"{dirs}\n  log file = {root}/smbd.log\n  passdb backend = tdbsam:{root}/private/passdb.tdb\n"
        f"  load printers = no\n  disable spoolss = yes\n  server min protocol = SMB2\n"
        # The scan-to-folder stanza from docs/scanners.md: no oplocks on an inbox.
        f"[scans]\n  path = {share}\n  read only = no\n  create mask = 0664\n  directory mask = 2775\n"
        f"  oplocks = no\n  level2 oplocks = no\n"
    )
    subprocess.run(["smbpasswd", "-c", str(config), "-a", "-s", USER], input=f"{PASSWORD}\n{PASSWORD}\n",
                   text=True, check=True, capture_output=True)
    # Its own session: on shutdown smbd signals its whole process group, which must not be pytest's.
    smbd = subprocess.Popen(["smbd", "--foreground", "--no-process-group", f"--configfile={config}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def listening() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 30, "smbd to listen")
        smbclient.register_session("127.0.0.1", username=USER, password=PASSWORD, port=port, encrypt=False)
        yield share, port
    finally:
        smbclient.reset_connection_cache()
        smbd.terminate()
        smbd.wait(10)
        shutil.rmtree(root, ignore_errors=True)


class Scanner:
    """An SMB client writing into one folder of the share."""

    def __init__(self, port: int, folder: str) -> None:
        self.port = port
        self.base = rf"\\127.0.0.1\scans\{folder}"

    def write(self, name: str, data: bytes, chunks: int = 1, pause: float = 0.0) -> None:
        size = -(-len(data) // chunks) if data else 0
        with smbclient.open_file(rf"{self.base}\{name}", mode="wb", port=self.port) as remote:
            for offset in range(0, len(data), max(size, 1)):
                remote.write(data[offset:offset + size])
                remote.flush()
                time.sleep(pause)

    def rename(self, old: str, new: str) -> None:
        smbclient.rename(rf"{self.base}\{old}", rf"{self.base}\{new}", port=self.port)


def page_png(text: str) -> bytes:
    image = Image.new("RGB", (600, 200), "white")
    ImageDraw.Draw(image).text((20, 80), text, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def share_daemon(samba, daemon_factory, request):
    """A daemon whose inbox is a folder of the Samba share, and a scanner writing into it."""
    share, port = samba
    folder = request.node.name.replace("[", "_").replace("]", "")[-60:]
    inbox = share / folder
    inbox.mkdir()
    os.chown(inbox, pwd.getpwnam(USER).pw_uid, -1)

    def make(inbox_config: str = "settle_seconds = 2") -> tuple[object, Scanner]:
        daemon = daemon_factory(inbox_config=inbox_config)
        daemon.inbox = inbox
        daemon.config.write_text(daemon.config.read_text().replace(
            f'path = "{daemon.root / "inbox"}"', f'path = "{inbox}"\noutbox = "{daemon.outbox}"\n'
            f'archive = "{daemon.archive}"\nfailed = "{daemon.failed}"'))
        return daemon.start(), Scanner(port, folder)

    return make


def published(daemon) -> dict[str, int]:
    """Published document -> its page count, read from the outbox."""
    result = {}
    for json_file in daemon.outbox.rglob("*.json"):
        if ".chandrad" not in json_file.parts:
            result[json_file.stem] = json.loads(json_file.read_text())["num_pages"]
    return result


def test_a_slow_upload_in_chunks_is_processed_once_complete(share_daemon):
    daemon, scanner = share_daemon()
    data = corpus_file("multipage.pdf").read_bytes()
    scanner.write("scan0001.pdf", data, chunks=10, pause=0.5)  # ~5 s, longer than settle_seconds
    wait_for(lambda: daemon.settled_all(1), 180, "the slow upload")
    assert published(daemon) == {"scan0001": 6}
    assert (daemon.archive / "scan0001.pdf").read_bytes() == data
    assert len(daemon.journal_rows("SELECT id FROM documents")) == 1


def test_write_under_a_temp_name_then_rename(share_daemon):
    daemon, scanner = share_daemon()
    scanner.write("~scan0002.tmp", corpus_file("cardinal.pdf").read_bytes(), chunks=4, pause=0.3)
    time.sleep(3)  # the temp name sits there past settle_seconds: it must still be ignored
    scanner.rename("~scan0002.tmp", "scan0002.pdf")
    wait_for(lambda: daemon.settled_all(1), 120, "the renamed scan")
    assert published(daemon) == {"scan0002": 4}
    assert daemon.states() == {"scan0002.pdf": "published"}


def test_an_empty_file_filled_later_is_processed_once_with_its_content(share_daemon):
    daemon, scanner = share_daemon()
    scanner.write("scan0003.pdf", b"")
    time.sleep(0.5)
    scanner.write("scan0003.pdf", corpus_file("linn.pdf").read_bytes(), chunks=3, pause=0.3)
    wait_for(lambda: daemon.settled_all(1), 120, "the filled scan")
    assert published(daemon) == {"scan0003": 1}
    assert daemon.states() == {"scan0003.pdf": "published"}


def test_overwriting_a_name_before_it_settles_processes_the_final_file_once(share_daemon):
    daemon, scanner = share_daemon()
    scanner.write("scan0004.pdf", corpus_file("trivial.pdf").read_bytes())
    scanner.write("scan0004.pdf", corpus_file("multipage.pdf").read_bytes(), chunks=2, pause=0.2)
    wait_for(lambda: daemon.settled_all(1), 120, "the overwritten scan")
    assert published(daemon) == {"scan0004": 6}
    assert len(daemon.journal_rows("SELECT id FROM documents")) == 1


@pytest.mark.parametrize("polling", [False, True], ids=["inotify", "polling"])
def test_a_burst_of_50_files_gives_50_results(share_daemon, polling):
    daemon, scanner = share_daemon(
        f"settle_seconds = 1\npolling = {str(polling).lower()}\npoll_interval_seconds = 1"
    )
    for number in range(50):
        scanner.write(f"burst-{number:02d}.png", page_png(f"Page {number}"))
    wait_for(lambda: daemon.settled_all(50) or len(daemon.states()) > 50, 300, "fifty results")
    assert daemon.states() == {f"burst-{number:02d}.png": "published" for number in range(50)}
    assert sorted(published(daemon)) == [f"burst-{number:02d}" for number in range(50)]
    assert daemon.leftovers_once_cleared() == []


def test_two_hosts_on_one_share_publish_a_burst_each_once_and_share_the_work(samba, tmp_path):
    """Two chandrad hosts (own state_dir and host_id) watch the folder smbd serves; scanners write
    through SMB. Every file is published once, by one of them, and both take part. The outbox is a
    folder of the share too: publishing onto a name another host took fails (ENOTEMPTY) and the
    next name is taken, never a mix of two documents."""
    with served_hosts(samba, tmp_path, "two-hosts", takeover_seconds=3) as (first, second, scanner):
        taken, mine = first.outbox / "taken", first.outbox / "mine"
        for folder in (taken, mine):
            folder.mkdir()
            (folder / "x.md").write_text(folder.name)
        with pytest.raises(OSError) as refused:
            os.rename(mine, taken)
        assert refused.value.errno in (errno.ENOTEMPTY, errno.EEXIST), "a published folder is never replaced"
        print(f"rename onto a published folder in the served outbox: {errno.errorcode[refused.value.errno]}")
        shutil.rmtree(taken)
        shutil.rmtree(mine)
        for daemon in (first, second):
            daemon.start()
        names = [f"share-{n:02d}.png" for n in range(40)]
        for number, name in enumerate(names):
            scanner.write(name, hosts_page(f"Share {number}"))
        wait_for(lambda: len(files_in(first.archive)) >= len(names), 240, "every original archived")
        assert first.stop() == 0 and second.stop() == 0
        check_each_published_once(names, first, second)
        shares = [published_by(daemon) for daemon in (first, second)]
        assert min(shares) > 0, f"both hosts did part of the work: {shares}"
        assert first.leftovers_once_cleared() == []


def served_folders(share: Path, tmp_path: Path, name: str) -> dict[str, Path]:
    """Inbox and outbox in the folder smbd serves (the hosts run on the Samba server: the
    server-side topology of docs/scaling.md); archive and failed on a local disk."""
    shared = {"inbox": share / name, "outbox": share / f"{name}-out",
              "archive": tmp_path / "archive", "failed": tmp_path / "failed"}
    for folder in (shared["inbox"], shared["outbox"]):
        folder.mkdir()
        os.chown(folder, pwd.getpwnam(USER).pw_uid, -1)
    return shared


@contextlib.contextmanager
def served_hosts(samba: tuple[Path, int], tmp_path: Path, folder: str,
                 takeover_seconds: float) -> Iterator[tuple[DaemonProcess, DaemonProcess, Scanner]]:
    """host-a and host-b (not started) on ``folder`` of the share, and a scanner writing into it;
    whatever is left running at the end is thawed and killed."""
    share, port = samba
    shared = served_folders(share, tmp_path, folder)
    first, second = (make_host(tmp_path, name, shared, takeover_seconds) for name in ("host-a", "host-b"))
    try:
        yield first, second, Scanner(port, folder)
    finally:
        for daemon in (first, second):
            if daemon.alive:
                if daemon.proc is not None:
                    daemon.proc.send_signal(signal.SIGCONT)
                daemon.kill9()


@pytest.mark.timeout(420)
def test_on_the_share_a_killed_hosts_claims_are_taken_over_and_published_once(samba, tmp_path):
    """Test_hosts' kill -9 takeover with the files written by a scanner through SMB."""
    names = [f"kill-{n:02d}.png" for n in range(30)]
    with served_hosts(samba, tmp_path, "killed-host", takeover_seconds=3) as (first, second, scanner):

        def write_all() -> None:
            for number, name in enumerate(names):
                scanner.write(name, hosts_page(f"Kill {number}"))

        print(kill_a_host_and_check_the_takeover(first, second, names, write_all))


@pytest.mark.timeout(300)
def test_on_the_share_a_copy_another_host_claims_is_a_duplicate_naming_the_original(samba, tmp_path):
    """Test_hosts' duplicate across hosts with both copies written by a scanner through SMB."""
    with served_hosts(samba, tmp_path, "copy-hosts", takeover_seconds=600) as (first, second, scanner):
        check_a_copy_another_host_claims_is_a_duplicate(first, second, scanner.write)
