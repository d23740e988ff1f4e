"""docs/architecture.md's module table and the package are in step: every module is listed (by
its path, or by its package's row, `engine/`), and no row names a module or folder that is not there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "chandrad"
DOC = REPO / "docs" / "architecture.md"


def table_rows(text: str, heading: str) -> list[str]:
    """The first cell of each row of the table under ``heading`` (up to the next heading); a
    ``\\|`` inside a cell is a bar of its text, not a cell's end."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [
        line.replace("\\|", "\0").split("|")[1].replace("\0", "|").strip()
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def listed_paths(cells: list[str]) -> list[str]:
    return [name for cell in cells for name in re.findall(r"`([^`]+)`", cell)]


def package_modules() -> set[str]:
    return {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts
    }


def covered(module: str, listed: list[str]) -> bool:
    return module in listed or any(entry.endswith("/") and module.startswith(entry) for entry in listed)


def test_every_module_of_the_package_has_its_row() -> None:
    listed = listed_paths(table_rows(DOC.read_text(), "## Modules: one job each"))
    missing = sorted(module for module in package_modules() if not covered(module, listed))
    assert not missing, f"docs/architecture.md's module table lacks {missing}"


def test_every_row_names_a_module_or_folder_that_exists() -> None:
    listed = listed_paths(table_rows(DOC.read_text(), "## Modules: one job each"))
    assert listed, "the module table was not found"
    absent = [entry for entry in listed if not (PACKAGE / entry).exists()]
    assert not absent, f"docs/architecture.md lists {absent}, which chandrad/ does not have"


def test_the_layers_table_names_what_pyproject_enforces() -> None:
    layers = table_rows(DOC.read_text(), "## Layers")
    doc_layers = [
        " | ".join("chandrad." + name.removesuffix(".py").removesuffix("/") for name in re.findall(r"`([^`]+)`", cell))
        for cell in layers
    ]
    pyproject = (REPO / "pyproject.toml").read_text()
    contract = pyproject.split('type = "layers"', 1)[1].split("]", 1)[0]
    enforced = re.findall(r'"([^"]+)"', contract)
    assert doc_layers == enforced
