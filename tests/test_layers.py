"""The layers of docs/architecture.md are enforced: import-linter (run by `make lint`) refuses an
import that goes up a layer or into chandrad.testing, and passes the package as it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on the copy of the package in ``tree``, with the project's contracts. The copy
    comes first on the path: chandrad's editable install would otherwise be the one analysed."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "chandrad", tmp_path / "chandrad", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_as_it_is_keeps_every_contract(package_copy: Path) -> None:
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        # storage is beneath the document's steps: the journal must not know the pipeline.
        ("storage/planted.py", "from chandrad.document import pipeline\n", "the flow's layers"),
        # the engine knows no files, journal or documents.
        ("engine/planted.py", "from chandrad.storage.journal import Journal\n", "the flow's layers"),
        # output is beneath inbox: publishing does not reach back into intake.
        ("output/planted.py", "from chandrad.inbox import intake\n", "the flow's layers"),
        # an import for a type only is still a dependency (added to an existing module).
        (
            "hosts/takeover.py",
            "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from chandrad.service.daemon import Daemon\n",
            "the flow's layers",
        ),
        ("service/planted.py", "from chandrad import testing\n", "chandrad.testing is for tests"),
    ],
)
def test_a_planted_wrong_import_fails_lint(package_copy: Path, module: str, planted: str, contract: str) -> None:
    target = package_copy / "chandrad" / module
    target.write_text((target.read_text() if target.exists() else "") + planted)
    result = lint_imports(package_copy)
    assert result.returncode != 0, result.stdout
    assert f"{contract}" in result.stdout
    assert "BROKEN" in result.stdout, result.stdout
