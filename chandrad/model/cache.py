"""Where the model's files live: the Hugging Face hub cache, and root's files in it handed to the service.

The cache is ``HF_HOME/hub`` (``models--ORG--NAME/{blobs,snapshots,refs}``), the one vLLM reads.
The systemd units set ``HF_HOME`` to the unit's cache directory (``CacheDirectory=chandrad`` →
``/var/cache/chandrad/huggingface``); ``chandrad fetch-model`` and ``chandrad check`` run by root
without ``HF_HOME`` use that same folder, and hand what they write to the service's user. The
daemon itself uses whatever huggingface_hub (and so vLLM) uses.
"""

from __future__ import annotations

import json
import os
import pwd
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import structlog
from huggingface_hub import constants

log = structlog.get_logger("chandrad.model.cache")


# The units' CacheDirectory=chandrad and HF_HOME=%C/chandrad/huggingface (systemd/chandrad*.service).
SERVICE_CACHE_ROOT = Path("/var/cache/chandrad")
SERVICE_HF_HOME = SERVICE_CACHE_ROOT / "huggingface"
SERVICE_USER = "chandrad"
# A blob's bytes arrive in blobs/<etag>.chandrad-partial until they are all there and checked.
PARTIAL_SUFFIX = ".chandrad-partial"


def hub_cache_for_admin(
    hf_home: Path | None = None, environ: Mapping[str, str] = os.environ, euid: int | None = None
) -> Path:
    """The hub cache the service reads, as seen by an admin's command (``fetch-model``, ``check``).

    An explicit ``--hf-home`` wins, then huggingface_hub's own variables (the unit sets HF_HOME),
    then, for root, the unit's cache directory; anyone else gets huggingface_hub's default.
    """
    if hf_home is not None:
        return hf_home / "hub"
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    if (os.geteuid() if euid is None else euid) == 0:
        return SERVICE_HF_HOME / "hub"
    return Path(constants.HF_HUB_CACHE)


def process_hub_cache() -> Path:
    """The hub cache huggingface_hub, and so vLLM, uses in this process."""
    return Path(constants.HF_HUB_CACHE)


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository rather than a local directory."""
    return not Path(model).expanduser().exists() and bool(_HUB_ID.match(model)) and not model.startswith(".")


def repo_storage(repo_id: str, hub_cache: Path) -> Path:
    return hub_cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, hub_cache: Path, revision: str | None = None) -> Path | None:
    """The complete snapshot of ``repo_id`` in the cache, or None.

    Complete: the config, a tokenizer, and every weight shard its index names (or one safetensors
    file without an index) are there — what vLLM needs, checked without the network.
    """
    storage = repo_storage(repo_id, hub_cache)
    revision = revision or "main"
    commit = revision
    if not re.fullmatch(r"[0-9a-f]{40}", revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    folder = storage / "snapshots" / commit
    return folder if snapshot_complete(folder) else None


def snapshot_complete(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(path.is_file() for path in folder.glob("*.safetensors"))


def partial_path(blob: Path) -> Path:
    return blob.with_name(blob.name + PARTIAL_SUFFIX)


def service_owner(hub_cache: Path, euid: int | None = None) -> tuple[int, int] | None:
    """Whom root's downloads into the service's cache must belong to (the service's user), or None."""
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        hub_cache.resolve().relative_to(SERVICE_CACHE_ROOT)
    except ValueError:
        return None
    try:
        user = pwd.getpwnam(SERVICE_USER)
        return user.pw_uid, user.pw_gid
    except KeyError:
        pass
    try:
        st = SERVICE_CACHE_ROOT.stat()
    except OSError:
        return None
    return (st.st_uid, st.st_gid) if st.st_uid != 0 else None


def hand_over(hub_cache: Path, owner: tuple[int, int]) -> None:
    """Give everything under the cache's HF_HOME to ``owner``: the service writes its locks and refs there.

    systemd fixes a CacheDirectory's ownership only when its top folder has the wrong owner, so
    root's files inside a folder the service already owns would stay root's.
    """
    uid, gid = owner
    home = hub_cache.parent if hub_cache.name == "hub" else hub_cache
    tops = [home] + [p for p in home.parents if p == SERVICE_CACHE_ROOT or SERVICE_CACHE_ROOT in p.parents]
    for path in [*tops, *_walk(home)]:
        try:
            st = path.lstat()
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.lchown(path, uid, gid)
        except OSError as error:
            log.warning("cannot hand a model file to the service's user", file=str(path), error=str(error))


def _walk(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            yield Path(folder) / name
