"""`pip install .` (not editable) installs only the packages pyproject lists: every folder of
the project that holds an `__init__.py` must be listed under its dotted name (a missing
`autopar.runtime.regimes` once made every compile of an installed autopar fail). `.ci/run`
also installs the project non-editably and trains one step on two ranks there."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository (tests/unit/this file)


def _declared() -> tuple[set[str], dict[str, str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), dict(cfg.get("package-dir", {}))


def _folders_of(packages: set[str], dirs: dict[str, str]) -> dict[str, Path]:
    """Each listed package's folder, following package-dir (a package not mapped lives under
    its parent's folder)."""
    out: dict[str, Path] = {}
    for name in sorted(packages, key=lambda n: n.count(".")):
        parent, _, leaf = name.rpartition(".")
        out[name] = ROOT / dirs[name] if name in dirs else (
            out[parent] / leaf if parent else ROOT / name)
    return out


def test_every_package_folder_is_listed_in_pyproject():
    packages, dirs = _declared()
    folders = _folders_of(packages, dirs)
    assert all((f / "__init__.py").is_file() for f in folders.values()), folders
    missing = []
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            dotted = ".".join((name, *rel))
            if "__pycache__" not in rel and dotted not in packages:
                missing.append(dotted)
    assert missing == [], f"pyproject.toml [tool.setuptools] packages misses {missing}"
    assert "autopar.runtime.regimes" in packages
