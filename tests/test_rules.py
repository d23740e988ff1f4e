"""Rules per sub-folder ([[inbox.rule]]): globs on the path in the inbox, the first match wins."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from chandrad.cli import main
from chandrad.config import InboxSettings, Settings, glob_matches, load_settings
from chandrad.errors import ConfigError
from chandrad.runtime import Runtime
from chandrad.storage.journal import Journal
from tests.conftest import wait_for
from tests.reliability.chaoslib import DrawingEngine, simple_pdf
from tests.test_delivery import FAST_PAGES, deliveries, documents, receivers  # noqa: F401  (a fixture)


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("invoices/**", "invoices/a.pdf", True),
        ("invoices/**", "invoices/2024/q1/a.pdf", True),
        ("invoices/**", "Invoices/A.PDF", True),  # case-insensitive, like include/ignore
        ("invoices/**", "letters/invoices/a.pdf", False),
        ("invoices/**", "invoices.pdf", False),
        ("**/*.tif", "a.tif", True),  # ** also matches no folder at all
        ("**/*.tif", "x/y/a.TIF", True),
        ("**/*.tif", "x/a.tiff", False),
        ("*.tif", "x/a.tif", False),  # without "/", the top level only
        ("scans/*/in?.pdf", "scans/a/in1.pdf", True),
        ("scans/*/in?.pdf", "scans/a/b/in1.pdf", False),  # * stays within one level
        ("scans/**/final/*", "scans/final/x.pdf", True),
        ("scans/**/final/*", "scans/a/b/final/x.pdf", True),
        ("[ab]*.pdf", "c.pdf", False),
        ("[!ab]*.pdf", "c.pdf", True),
        ("a+b (1).pdf", "a+b (1).pdf", True),  # regex characters are literal
    ],
)
def test_a_rule_glob_matches_paths_relative_to_the_inbox(pattern, path, matches):
    assert glob_matches(pattern, path) is matches


def inbox_with_rules(tmp_path: Path) -> InboxSettings:
    return InboxSettings.model_validate(
        {
            "path": tmp_path / "in",
            "formats": ["md"],
            "rule": [
                {"match": "invoices/**", "formats": ["json"], "on_success": "delete", "webhooks": []},
                {"match": "**/*.tif", "prompt_type": "ocr", "duplicates": "reprocess"},
                {"match": "invoices/**", "formats": ["html"]},  # never reached: the first one wins
            ],
        }
    )


def test_the_first_matching_rule_wins_and_keys_it_leaves_out_keep_the_inbox_value(tmp_path):
    inbox = inbox_with_rules(tmp_path)
    invoice = inbox.effective("invoices/2024/a.tif")
    assert (invoice.formats, invoice.on_success, invoice.prompt_type, invoice.webhooks) == (
        ("json",), "delete", "ocr_layout", ()
    )
    scan = inbox.effective("letters/b.tif")
    assert (scan.formats, scan.prompt_type, scan.duplicates) == (("md",), "ocr", "reprocess")
    assert scan.on_success == "archive"
    assert inbox.effective("letters/b.pdf") == inbox, "no rule: the inbox's own settings"
    assert inbox.effective("invoices/a.pdf").effective("invoices/a.pdf") == inbox.effective("invoices/a.pdf")


def test_the_runtime_resolves_a_document_s_rule_from_its_path(tmp_path):
    settings = Settings(state_dir=tmp_path / "state", inbox=(inbox_with_rules(tmp_path),))
    journal = Journal(tmp_path / "journal.sqlite3")
    try:
        runtime = Runtime(settings, journal, DrawingEngine())
        doc = journal.add_document("in", "Invoices/x.pdf", "sha", 1, 1)
        assert runtime.inbox_of(doc).formats == ("json",)
        other = journal.add_document("in", "x.tif", "sha2", 1, 1)
        assert runtime.inbox_of(other).prompt_type == "ocr"
    finally:
        journal.close()


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ('match = "a/**"\ncolour = "red"\n', "inbox.0.rule.0.colour: unknown key"),
        ('match = "a/**"\ncompress = "ebook"\n', "inbox.0.rule.0.compress: unknown key"),
        ('match = "/abs/**"\n', "relative to the inbox"),
        ('match = "../x/*"\n', "relative to the inbox"),
        ('match = "a/[b"\n', "not a valid glob"),
        ('match = "a/**"\nformats = []\n', "formats"),
        ('match = "a/**"\nhooks = ["nope"]\n', "hooks \\['nope'\\] name no"),
        ('formats = ["md"]\n', "match"),
    ],
)
def test_a_bad_rule_is_refused_with_a_message_naming_it(tmp_path, rule, message):
    config = tmp_path / "config.toml"
    config.write_text(f'[[inbox]]\npath = "{tmp_path}/in"\n[[inbox.rule]]\n{rule}')
    with pytest.raises(ConfigError, match=message):
        load_settings(config)


def test_a_rule_asking_for_the_archive_gets_one_even_if_the_inbox_deletes(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        f'[[inbox]]\npath = "{tmp_path}/in"\non_success = "delete"\n[[inbox.rule]]\nmatch = "keep/**"\n'
        'on_success = "archive"\n'
    )
    assert load_settings(config).inbox[0].archive == tmp_path / "archive"


def test_check_prints_the_rule_each_sub_folder_of_an_inbox_gets(tmp_path):
    for folder in ("invoices/2024", "letters", ".hidden"):
        (tmp_path / "in" / folder).mkdir(parents=True)
    config = tmp_path / "config.toml"
    config.write_text(
        f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "tesseract"\n'
        f'[[inbox]]\npath = "{tmp_path}/in"\n'
        '[[inbox.rule]]\nmatch = "invoices/**"\nformats = ["json"]\n'
        '[[inbox.rule]]\nmatch = "**/*.tif"\nprompt_type = "ocr"\n'
    )
    output = CliRunner().invoke(main, ["check", "--config", str(config)]).stdout
    assert "[ok] rules of inbox in: 2" in output
    lines = [line.strip() for line in output.splitlines()]
    assert '(top level) → the inbox\'s own settings; files matching "**/*.tif": rule 2' in lines
    assert 'invoices/ → rule 1 "invoices/**"' in lines
    assert 'invoices/2024/ → rule 1 "invoices/**"' in lines
    assert 'letters/ → the inbox\'s own settings; files matching "**/*.tif": rule 2' in lines
    assert not any(".hidden" in line or ".chandrad" in line for line in lines)


def test_rules_give_sub_folders_their_own_formats_archive_dates_duplicates_and_webhooks(daemon_factory, receivers):  # noqa: F811
    receiver = receivers().start()
    inbox_config = (
        "settle_seconds = 1\n"
        '[[inbox.rule]]\nmatch = "invoices/**"\nformats = ["json"]\non_success = "delete"\n'
        '[[inbox.rule]]\nmatch = "letters/**"\ndate_prefix = true\nwebhooks = []\n'
        '[[inbox.rule]]\nmatch = "copies/**"\nduplicates = "reprocess"\n'
    )
    daemon = daemon_factory(
        extra_config=f'{FAST_PAGES}\n[[webhook]]\nurl = "{receiver.url}"\nname = "erp"\n', inbox_config=inbox_config
    ).start()
    pdf = {name: simple_pdf(1, label=name) for name in ("invoice", "letter", "copy", "plain")}
    for rel, content in (
        ("invoices/2024/a.pdf", pdf["invoice"]),
        ("letters/b.pdf", pdf["letter"]),
        ("copies/c1.pdf", pdf["copy"]),
        ("copies/c2.pdf", pdf["copy"]),
        ("d.pdf", pdf["plain"]),
    ):
        target = daemon.inbox / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    wait_for(lambda: daemon.settled_all(5), 120, "five documents")
    assert set(daemon.states().values()) == {"published"}, daemon.states()
    assert sorted(p.name for p in (daemon.outbox / "invoices" / "2024" / "a").iterdir()) == ["a.json"]
    assert not (daemon.archive / "invoices" / "2024" / "a.pdf").exists(), "the rule's on_success = delete"
    month = time.strftime("%Y/%m", time.localtime(documents(daemon)["letters/b.pdf"]["created_at"]))
    letter = daemon.outbox / month / "letters" / "b"
    assert sorted(p.name for p in letter.iterdir()) == ["b.html", "b.json", "b.md"], "the inbox's formats, dated"
    assert (daemon.archive / "letters" / "b.pdf").exists()
    for name in ("c1", "c2"):  # the same content twice: the rule reprocesses copies
        assert json.loads((daemon.outbox / "copies" / name / f"{name}.json").read_text())["num_pages"] == 1
    wait_for(lambda: len(receiver.requests) == 4, 30, "the webhooks of all but the letter")
    assert sorted(body["source"] for body in receiver.bodies()) == [
        "copies/c1.pdf", "copies/c2.pdf", "d.pdf", "invoices/2024/a.pdf"
    ]
    invoice = next(body for body in receiver.bodies() if body["source"] == "invoices/2024/a.pdf")
    assert invoice["files"] == ["invoices/2024/a/a.json"] and invoice["output_dir"] == "invoices/2024/a"
    assert "letters/b.pdf" not in {row["rel_path"] for row in deliveries(daemon)}
    assert daemon.stop() == 0
