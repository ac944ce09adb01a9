"""The map stays true: docs/DESIGN.md §5 (one concept, one module) names only paths that exist
and names every module of the project; the test ladder's first rung spawns no ranks (gloo
tests live in tests/numerics, tests/README.md)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("autopar", "passes", "cost")


def _table_rows() -> list[str]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## 5. One concept"):text.index("\n## 6.")]
    return [line for line in section.splitlines() if line.startswith("| ")]


def _paths(row: str) -> list[str]:
    """The file and folder paths a row names in backticks (`x/y.py`, `x/`, `y.py`; not the
    placeholder of a `file.py:factory` spec)."""
    return [word for span in re.findall(r"`([^`]+)`", row)
            for word in re.findall(r"[\w./-]+\.py(?![\w:])|[\w.-]+(?:/[\w.-]+)*/(?![\w.])", span)]


def _resolve(path: str, row_paths: list[str]) -> Path | None:
    """A path as the table writes it: from the repository root, from autopar/, or (a bare
    file name) beside the row's other files."""
    bases = [ROOT, ROOT / "autopar"]
    bases += [(ROOT / p).parent for p in row_paths if "/" in p]
    bases += [(ROOT / "autopar" / p).parent for p in row_paths if "/" in p]
    bases += [ROOT / p for p in row_paths if p.endswith("/")]
    for base in bases:
        if (base / path).exists():
            return (base / path).resolve()
    return None


def test_every_path_the_concept_table_names_exists():
    missing = []
    for row in _table_rows():
        paths = _paths(row)
        missing += [f"{p} (row {row.split('|')[1].strip()!r})" for p in paths
                    if _resolve(p, paths) is None]
    assert not missing, f"docs/DESIGN.md §5 names paths that do not exist: {missing}"


def test_every_module_is_in_the_concept_table():
    named: set[Path] = set()
    for row in _table_rows():
        paths = _paths(row)
        named |= {r for p in paths if (r := _resolve(p, paths)) is not None}
    unnamed = []
    for folder in SOURCE_FOLDERS:
        for file in sorted((ROOT / folder).rglob("*.py")):
            if file.name == "__init__.py":
                continue
            if not ({file.resolve(), *file.resolve().parents} & named):
                unnamed.append(str(file.relative_to(ROOT)))
    assert not unnamed, f"modules without a row in docs/DESIGN.md §5: {unnamed}"


def test_the_table_check_sees_a_missing_path():
    row = "| x | `autopar/api.py` (and `no_such_module.py`) | `f(a.b)` |"
    paths = _paths(row)
    assert paths == ["autopar/api.py", "no_such_module.py"]
    assert _resolve(paths[0], paths) is not None and _resolve(paths[1], paths) is None


def test_unit_tests_spawn_no_ranks():
    pattern = re.compile(r"\bspawn\(|init_process_group\(|torchrun|mp\.Process\(")
    spawning = [f.name for f in sorted((ROOT / "tests" / "unit").glob("test_*.py"))
                if f.name != Path(__file__).name and pattern.search(f.read_text())]
    assert not spawning, f"tests/unit spawns ranks (move the test to tests/numerics): {spawning}"
