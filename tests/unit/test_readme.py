"""`.ci/run` must run exactly the README's test command (the contract of the README's first
screen), then the non-editable install check, and the README must show the main command."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository (tests/unit/this file)


def _bash_blocks(text: str) -> list[str]:
    parts = text.split("```bash\n")[1:]
    return [p.split("```")[0].strip() for p in parts]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_cmd = next(b for b in _bash_blocks(readme) if "pytest" in b)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [test_cmd, ".ci/install-check"]
    assert "/pip\" install -q \"$work/src\"" in (ROOT / ".ci" / "install-check").read_text()


def test_readme_first_screen_has_the_main_command():
    first = _bash_blocks((ROOT / "README.md").read_text())[0]
    assert first.endswith("autopar demo") and "torch==2.13.0" in first
