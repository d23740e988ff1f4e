"""Reading the settings: the file to read, TOML plus ``CHANDRAD_*`` overrides, errors a person can
act on; the folders made at start."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from chandrad.config.settings import Settings
from chandrad.errors import ConfigError

DEFAULT_CONFIG_PATHS = (Path("/etc/chandrad/config.toml"),)


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
