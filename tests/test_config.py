"""Config: file + env merge, defaults derived from the inbox, and refusals with clear messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chandrad.config import load_settings
from chandrad.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_inbox_folders_default_to_siblings_and_env_overrides_the_file(tmp_path, monkeypatch):
    config = write(tmp_path, f'state_dir = "{tmp_path}/state"\nmax_attempts = 5\n[[inbox]]\npath = "{tmp_path}/in"\n')
    monkeypatch.setenv("CHANDRAD_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("CHANDRAD_ENGINE__KIND", "tesseract")
    settings = load_settings(config)
    assert settings.max_attempts == 7 and settings.engine.kind == "tesseract"
    inbox = settings.inbox[0]
    assert (inbox.outbox, inbox.archive, inbox.failed) == (
        tmp_path / "outbox", tmp_path / "archive", tmp_path / "failed"
    )


def test_embedded_defaults_give_one_inbox(monkeypatch, tmp_path):
    monkeypatch.delenv("CHANDRAD_CONFIG", raising=False)
    monkeypatch.setattr("chandrad.config.loading.DEFAULT_CONFIG_PATHS", (tmp_path / "absent.toml",))
    settings = load_settings(None)
    assert [inbox.path for inbox in settings.inbox] == [Path("/srv/chandrad/inbox")]
    assert settings.inbox[0].outbox == Path("/srv/chandrad/outbox")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[inbox]]\npath = "{tmp}/in"\noutbox = "{tmp}/in/out"\n', "inside the inbox"),
        ('[[inbox]]\npath = "{tmp}/in"\nfailed = "{tmp}/in"\n', "inside the inbox"),
        ('colour = "blue"\n', "colour: unknown key"),
        ('[[inbox]]\npath = "{tmp}/in"\nsettle_secs = 3\n', "inbox.0.settle_secs: unknown key"),
        ('[[inbox]]\npath = "{tmp}/in"\non_success = "shred"\n', "on_success"),
        ('[[inbox]]\npath = "{tmp}/in"\nformats = []\n', "formats"),
        ("this is = not toml [", "not valid TOML"),
    ],
)
def test_invalid_config_is_refused_with_a_message_naming_the_problem(tmp_path, text, message):
    config = write(tmp_path, text.format(tmp=tmp_path))
    with pytest.raises(ConfigError, match=message):
        load_settings(config)


def test_the_example_config_loads_and_documents_every_key():
    from chandrad.config import EngineSettings, InboxSettings, PrepareSettings, RetentionSettings, Settings

    example = Path(__file__).resolve().parent.parent / "config.example.toml"
    load_settings(example)
    text = example.read_text()
    documented = set(re.findall(r"^#? ?([a-z_]+) = ", text, re.MULTILINE))
    tables = set(re.findall(r"^#? ?\[\[?([a-z_]+)\]", text, re.MULTILINE))  # [engine], # [retention], ...
    for model in (Settings, EngineSettings, PrepareSettings, InboxSettings, RetentionSettings):
        fields = {name for name in model.model_fields if name not in tables}
        assert fields <= documented, f"{model.__name__}: undocumented keys {fields - documented}"
