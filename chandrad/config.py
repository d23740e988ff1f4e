"""Settings: a TOML file plus ``CHANDRAD_*`` environment overrides, validated at construction.

Nothing else in chandrad reads the environment or a config file: the ``Settings`` object built
here is passed to whoever needs it. Bad settings fail at startup with a ``ConfigError`` that
names the key and says what to do, never on the first document.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from chandrad.errors import ConfigError

DEFAULT_CONFIG_PATHS = (Path("/etc/chandrad/config.toml"),)
DEFAULT_ROOT = Path("/srv/chandrad")

OutputFormat = Literal["md", "html", "json"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InboxSettings(_Strict):
    """One watched folder and where its documents go."""

    path: Path
    outbox: Path
    archive: Path | None = None
    failed: Path
    name: str = ""
    recursive: bool = True
    # "auto": polling when the inbox lives on cifs/smb/nfs/fuse (inotify sees no remote writes there).
    polling: Literal["auto"] | bool = "auto"
    poll_interval_seconds: float = Field(default=5.0, gt=0)
    rescan_seconds: float = Field(default=300.0, gt=0)
    settle_seconds: float = Field(default=5.0, ge=0)
    include: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()
    on_success: Literal["archive", "delete", "keep"] = "archive"
    prompt_type: Literal["ocr_layout", "ocr"] = "ocr_layout"
    formats: tuple[OutputFormat, ...] = ("md", "html", "json")
    date_prefix: bool = False
    duplicates: Literal["skip", "reprocess"] = "skip"
    compress: Literal["lossless", "ebook", "printer"] = "lossless"
    pdf_password: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _derive_folders(cls, data: Any) -> Any:
        """Only ``path`` is required: outbox/archive/failed default to siblings of the inbox."""
        if isinstance(data, dict) and "path" in data:
            base = Path(data["path"]).parent
            data = dict(data)
            data.setdefault("outbox", base / "outbox")
            data.setdefault("failed", base / "failed")
            if data.get("on_success", "archive") == "archive":
                data.setdefault("archive", base / "archive")
            data.setdefault("name", Path(data["path"]).name)
        return data

    @field_validator("formats")
    @classmethod
    def _formats_not_empty(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        if not formats:
            raise ValueError("list at least one of md, html, json")
        return formats

    @model_validator(mode="after")
    def _archive_needed(self) -> InboxSettings:
        if self.on_success == "archive" and self.archive is None:
            raise ValueError('on_success = "archive" needs an archive folder')
        return self

    @property
    def destinations(self) -> dict[str, Path]:
        folders = {"outbox": self.outbox, "failed": self.failed}
        if self.archive is not None:
            folders["archive"] = self.archive
        return folders


class EngineSettings(_Strict):
    """Which OCR engine turns page images into Chandra HTML."""

    # "auto": vLLM when a CUDA GPU is visible, else tesseract (with a loud warning).
    kind: Literal["auto", "vllm", "tesseract"] = "auto"
    model: str = "datalab-to/chandra-ocr-2"
    # Pages in flight across all documents (the engine batches them continuously).
    max_pages_in_flight: int = Field(default=8, ge=1)
    page_timeout_seconds: float = Field(default=600.0, gt=0)
    tesseract_languages: str = "eng"


class PrepareSettings(_Strict):
    """How documents become page images."""

    dpi: int = Field(default=192, ge=50, le=600)
    min_short_side_px: int = Field(default=1024, ge=0)
    # Chandra scales every page to at most 3072x2048 px (6.3 MP): rendering larger is wasted work.
    max_page_pixels: int = Field(default=6_291_456, ge=100_000)
    # Below this DPI a page is so large that the text cannot survive: refuse it.
    min_dpi: int = Field(default=10, ge=1)
    max_pages: int = Field(default=2000, ge=1)
    max_file_mb: int = Field(default=1024, ge=1)
    # Images whose header claims more pixels than this are refused before decoding (pixel bombs).
    max_image_pixels: int = Field(default=400_000_000, ge=1_000_000)
    subprocess_timeout_seconds: float = Field(default=300.0, gt=0)
    workers: int = Field(default=2, ge=1)


class Settings(BaseSettings):
    """Everything chandrad can be told. ``config.example.toml`` documents each key."""

    model_config = SettingsConfigDict(
        env_prefix="CHANDRAD_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    state_dir: Path = Path("/var/lib/chandrad")
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_documents_in_flight: int = Field(default=4, ge=1)
    # A transient failure (engine died, disk full, timeout) is retried this many times in all.
    max_attempts: int = Field(default=3, ge=1)
    retry_backoff_seconds: float = Field(default=30.0, ge=0)
    # On SIGTERM in-flight documents get this long to finish before they are requeued.
    drain_seconds: float = Field(default=20.0, ge=0)
    engine: EngineSettings = EngineSettings()
    prepare: PrepareSettings = PrepareSettings()
    inbox: tuple[InboxSettings, ...] = ()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file; the file arrives as init kwargs (see load_settings).
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _check_inboxes(self) -> Settings:
        _check_folder_layout(self.inbox)
        return self

    def with_default_inbox(self) -> Settings:
        """Embedded defaults: one inbox under /srv/chandrad when none is configured."""
        if self.inbox:
            return self
        default = InboxSettings(path=DEFAULT_ROOT / "inbox")
        return self.model_copy(update={"inbox": (default,)})


def _is_within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _check_folder_layout(inboxes: tuple[InboxSettings, ...]) -> None:
    names = [inbox.name for inbox in inboxes]
    if len(set(names)) != len(names):
        raise ValueError(f"inbox names must be unique, got {names}; set name = \"...\" on each [[inbox]]")
    all_inboxes = [inbox.path.resolve() for inbox in inboxes]
    for inbox in inboxes:
        for role, folder in inbox.destinations.items():
            resolved = folder.resolve()
            for inbox_path in all_inboxes:
                if _is_within(resolved, inbox_path):
                    raise ValueError(
                        f"inbox {inbox.name!r}: {role} {folder} is inside the inbox {inbox_path}; "
                        f"move it out, or chandrad would process its own output"
                    )
                if _is_within(inbox_path, resolved):
                    raise ValueError(f"inbox {inbox_path} is inside {role} {folder} of inbox {inbox.name!r}")


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key — check its spelling against config.example.toml"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def find_config_file(explicit: Path | None) -> Path | None:
    """The file to read: --config, else $CHANDRAD_CONFIG, else /etc/chandrad/config.toml if present."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get("CHANDRAD_CONFIG")
    if from_env:
        return Path(from_env)
    return next((path for path in DEFAULT_CONFIG_PATHS if path.is_file()), None)


def load_settings(config_path: Path | None = None, **overrides: Any) -> Settings:
    """Read, merge and validate settings; raise ConfigError with a readable message."""
    path = find_config_file(config_path)
    file_values: dict[str, Any] = {}
    source = "embedded defaults"
    if path is not None:
        source = str(path)
        try:
            with path.open("rb") as handle:
                file_values = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; create it from config.example.toml") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    file_values.update(overrides)
    try:
        settings = Settings(**file_values)
        return settings.with_default_inbox()
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None
    except ValueError as error:
        raise ConfigError(f"invalid configuration ({source}): {error}") from None


def prepare_folders(settings: Settings) -> None:
    """Create state, inbox and destination folders; refuse with a clear message if one cannot be."""
    folders = [settings.state_dir]
    for inbox in settings.inbox:
        folders.append(inbox.path)
        folders.extend(inbox.destinations.values())
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"cannot create folder {folder}: {error.strerror}; create it and give chandrad's user write access"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"folder {folder} is not writable by chandrad's user (uid {os.getuid()})")


__all__ = [
    "ConfigError",
    "EngineSettings",
    "InboxSettings",
    "PrepareSettings",
    "Settings",
    "load_settings",
    "prepare_folders",
]
