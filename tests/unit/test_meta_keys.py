"""The meta-key registry (passes/meta.py) against the code: every `.meta[...]`, `.meta.get(...)`,
`.meta.pop/setdefault(...)`, `key in x.meta`, `x.meta = {key: ...}` and `x.meta.update({...})` in
passes/, autopar/ and cost/ names its key by a constant of passes/meta.py (never a string), and
each declared key's writers and readers are exactly the modules whose source writes and reads
it. Read from the source with `ast`; no graph is built."""
from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

from autopar.passes import meta as K

ROOT = Path(__file__).resolve().parents[2]   # the repository (tests/unit/this file)
SCANNED = ("passes", "autopar", "cost")
CONSTANTS = {name: getattr(K, name) for name in dir(K)
             if name.isupper() and isinstance(getattr(K, name), str)}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_meta(e: ast.AST) -> bool:
    return isinstance(e, ast.Attribute) and e.attr == "meta"


def _accesses(tree: ast.AST) -> list[tuple[str, ast.expr, int]]:
    """("read" | "write", key expression, line) of every meta access in `tree`."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and _is_meta(n.value):
            out.append(("read" if isinstance(n.ctx, ast.Load) else "write", n.slice, n.lineno))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and _is_meta(n.func.value):
            if n.func.attr in ("get", "pop", "setdefault") and n.args:
                out.append(("read" if n.func.attr == "get" else "write", n.args[0], n.lineno))
            elif n.func.attr == "update" and n.args and isinstance(n.args[0], ast.Dict):
                out.extend(("write", k, n.lineno) for k in n.args[0].keys if k is not None)
        elif isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.In, ast.NotIn)) \
                and _is_meta(n.comparators[0]):
            out.append(("read", n.left, n.lineno))
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) \
                and any(_is_meta(t) for t in n.targets):
            out.extend(("write", k, n.lineno) for k in n.value.keys if k is not None)
    return out


def _key(e: ast.expr) -> str | None:
    """The declared key `e` spells (K.NAME), or None for a variable (generic code)."""
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "K":
        return CONSTANTS.get(e.attr, f"K.{e.attr} (no such constant)")
    return None


@cache
def _scan(dirs: tuple[str, ...]) -> tuple[dict, dict, list[str]]:
    """(key -> modules writing it, key -> modules reading it, bare-string accesses); once per
    `dirs` for the whole test session."""
    writes, reads, bare = defaultdict(set), defaultdict(set), []
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            module = "tests" if d == "tests" else _module(path)
            for kind, e, line in _accesses(ast.parse(path.read_text())):
                if isinstance(e, ast.Constant):
                    bare.append(f"{path.relative_to(ROOT)}:{line}: {e.value!r}")
                elif (key := _key(e)) is not None:
                    (writes if kind == "write" else reads)[key].add(module)
    return writes, reads, bare


def _ours(modules: tuple[str, ...]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in SCANNED}


def test_every_meta_access_names_a_declared_constant():
    writes, reads, bare = _scan(SCANNED)
    assert bare == [], "meta keys spelled as strings (use passes/meta.py's constants):\n" + \
        "\n".join(bare)
    undeclared = sorted(k for k in set(writes) | set(reads) if k not in K.BY_NAME)
    assert undeclared == [], f"meta keys not declared in passes/meta.py: {undeclared}"


def test_declared_writers_and_readers_are_the_code_s():
    writes, reads, _ = _scan(SCANNED)
    _, test_reads, _ = _scan(("tests",))
    wrong = []
    for key in K.KEYS:
        declared_w = _ours((key.writer,) + key.rewritten_by)
        if declared_w != writes.get(key.name, set()):
            wrong.append(f"{key.name}: writer + rewritten_by {sorted(declared_w)}, the code "
                         f"writes it in {sorted(writes.get(key.name, ()))}")
        if _ours(key.readers) != reads.get(key.name, set()):
            wrong.append(f"{key.name}: readers {sorted(_ours(key.readers))}, the code reads "
                         f"it in {sorted(reads.get(key.name, ()))}")
        if "tests" in key.readers and key.name not in test_reads:
            wrong.append(f"{key.name}: readers name tests, which never read it")
        if not reads.get(key.name) and "tests" not in key.readers:
            wrong.append(f"{key.name}: nothing reads it")
    assert wrong == [], "passes/meta.py disagrees with the code:\n" + "\n".join(wrong)


def test_the_scan_sees_each_kind_of_access():
    """The scanner itself, on a snippet with one access of each kind."""
    src = ("a = n.meta[K.VAL]\nn.meta[K.REGION] = 1\nn.meta.get(K.TP_ROLE)\n"
           "n.meta.pop(K.TP_PARAM, None)\nK.CHUNK in gm.meta\nm.meta = {K.SAVED: 1}\n"
           "m.meta.update({K.GEMM: 2})\nn.meta['tp_layout'] = 3\n")
    got = [(kind, _key(e) if not isinstance(e, ast.Constant) else e.value, line)
           for kind, e, line in _accesses(ast.parse(src))]
    assert sorted(got, key=lambda x: x[2]) == [
        ("read", K.VAL, 1), ("write", K.REGION, 2), ("read", K.TP_ROLE, 3),
        ("write", K.TP_PARAM, 4), ("read", K.CHUNK, 5), ("write", K.SAVED, 6),
        ("write", K.GEMM, 7), ("write", "tp_layout", 8)]
