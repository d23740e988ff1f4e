"""Publish: safe names, chandra-format outputs, and the all-or-nothing directory rename."""

from __future__ import annotations

import errno
import json
from pathlib import Path, PurePosixPath

import pytest
from PIL import Image

from chandrad.output.publish import (
    PageOutput,
    render_document,
    save_page_images,
)
from chandrad.storage.naming import free_name, safe_component, safe_relative
from chandrad.testing import publish_directory

HTML = (
    '<div data-bbox="100 50 900 120" data-label="Section-Header"><h1>Annual report</h1></div>\n'
    '<div data-bbox="100 150 900 400" data-label="Text"><p>Revenue grew by 12%.</p></div>\n'
    '<div data-bbox="100 450 500 800" data-label="Image"><img alt="a bar chart"/></div>\n'
    '<div data-bbox="0 950 1000 1000" data-label="Page-Footer">Page 1</div>'
)


@pytest.mark.parametrize(
    ("raw", "safe"),
    [("report", "report"), ("../../etc/passwd", "_.._etc_passwd"), ("a/b\\c", "a_b_c"), ("line\nbreak", "line_break"),
     ("..", "document"), ("", "document"), ("x" * 400, "x" * 180), ("caf\udce9", "caf\ufffd")],
)
def test_names_from_the_inbox_cannot_escape_or_break_the_outbox(raw, safe):
    assert safe_component(raw) == safe


def test_relative_paths_lose_parent_and_absolute_parts():
    assert safe_relative(PurePosixPath("../a/./b.pdf")) == Path("a/b.pdf")
    assert safe_relative(PurePosixPath("/etc/shadow")) == Path("etc/shadow")


def test_taken_names_get_a_counter_instead_of_being_overwritten(tmp_path):
    (tmp_path / "report").mkdir()
    (tmp_path / "report (2)").mkdir()
    assert free_name(tmp_path, "report", is_dir=True).name == "report (3)"
    (tmp_path / "scan.pdf").write_text("")
    assert free_name(tmp_path, "scan.pdf").name == "scan (2).pdf"


def test_outputs_are_built_by_chandras_parser_with_images_in_a_folder(tmp_path):
    page_image = Image.new("RGB", (1000, 1000), "white")
    images_dir = tmp_path / "staging" / "images"
    rendered = save_page_images(HTML, page_image, images_dir)
    assert len(rendered.image_names) == 1 and (images_dir / rendered.image_names[0]).exists()
    page = PageOutput(1, HTML, 1000, 1000, rendered.chunks, rendered.image_names, {"output_tokens": 42})
    files = render_document("report", [page], ["md", "html", "json"], {"doc_id": "abc"})
    markdown = files["report.md"].decode()
    assert markdown.startswith("# Annual report") and "Revenue grew by 12%." in markdown
    assert "Page 1" not in markdown, "headers and footers are dropped as chandra does"
    assert f"images/{rendered.image_names[0]}" in markdown
    document = json.loads(files["report.json"])
    assert document["doc_id"] == "abc" and document["total_output_tokens"] == 42
    labels = [chunk["label"] for chunk in document["pages"][0]["chunks"]]
    assert labels == ["Section-Header", "Text", "Image", "Page-Footer"]
    assert document["pages"][0]["chunks"][1]["bbox"] == [100, 150, 900, 400]


def test_formats_select_which_files_are_written():
    page = PageOutput(1, HTML, 1000, 1000, [], (), {})
    assert set(render_document("r", [page], ["md"], {})) == {"r.md"}


def test_publish_renames_a_complete_directory_into_place(tmp_path):
    staging = tmp_path / "outbox" / ".chandrad" / "staging" / "id" / "doc"
    target = tmp_path / "outbox" / "sub" / "report"
    publish_directory(staging, {"report.md": b"# hi\n", "report.json": b"{}"}, target)
    assert sorted(p.name for p in target.iterdir()) == ["report.json", "report.md"]
    assert not staging.exists()


def test_publish_never_replaces_an_existing_document_and_keeps_the_staged_copy(tmp_path):
    staging = tmp_path / "outbox" / ".chandrad" / "staging" / "id" / "doc"
    target = tmp_path / "outbox" / "report"
    target.mkdir(parents=True)
    (target / "report.md").write_bytes(b"# the published one\n")
    with pytest.raises(OSError) as refused:
        publish_directory(staging, {"report.md": b"again"}, target)
    assert refused.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    assert sorted(p.name for p in target.iterdir()) == ["report.md"]
    assert (target / "report.md").read_bytes() == b"# the published one\n"
    assert (staging / "report.md").read_bytes() == b"again", "the staged outputs wait to be published elsewhere"
