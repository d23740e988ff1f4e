"""Settings: a TOML file plus ``CHANDRAD_*`` environment overrides, validated at construction.

Nothing else in chandrad reads the environment or a config file: the ``Settings`` object built
here is passed to whoever needs it. Bad settings fail at startup with a ``ConfigError`` that
names the key and says what to do, never on the first document.

The parts, each in its own module: ``base`` (what they share), ``inbox`` (inboxes and their rules),
``engine`` (the engine and prepare), ``delivery`` (webhooks and hooks), ``settings`` (the whole and
its cross-checks, retention), ``loading`` (the file, the environment, the folders made at start).
This module is the menu: import from here.
"""

from __future__ import annotations

from chandrad.config.base import DEFAULT_ROOT, EVENTS, Event, OutputFormat
from chandrad.config.delivery import DeliverySettings, HookSettings, WebhookSettings
from chandrad.config.engine import EngineSettings, PrepareSettings
from chandrad.config.inbox import InboxRule, InboxSettings, glob_matches, name_matcher
from chandrad.config.loading import find_config_file, load_settings, prepare_folders
from chandrad.config.settings import RetentionSettings, Settings
from chandrad.errors import ConfigError

__all__ = [
    "DEFAULT_ROOT",
    "EVENTS",
    "ConfigError",
    "DeliverySettings",
    "EngineSettings",
    "Event",
    "HookSettings",
    "InboxRule",
    "InboxSettings",
    "OutputFormat",
    "PrepareSettings",
    "RetentionSettings",
    "Settings",
    "WebhookSettings",
    "find_config_file",
    "glob_matches",
    "load_settings",
    "name_matcher",
    "prepare_folders",
]
