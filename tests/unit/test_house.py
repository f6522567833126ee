"""The package's floor plan, read from its source (no imports run): which rooms may import which, how wide a
function's signature and how long its body may be. A change that breaks one of these names the place."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "draft_opd_ray"
MAX_PARAMETERS = 10  # self/cls not counted
MAX_LINES = 80
# the rollout role and the OPD roles (replay, learner) never import each other
ROLES_APART = ("rollout", "opd")
CONFIG_MAY_IMPORT = ("config", "errors")  # config/ is the bottom floor


@dataclass(frozen=True)
class Module:
    name: str  # draft_opd_ray.rollout.engine
    path: Path
    tree: ast.Module

    @property
    def room(self) -> str:
        """The first folder (or module) under the package: rollout, opd, config, wire, ..."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else ""


def _modules() -> list[Module]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(Module(".".join(parts), path, ast.parse(path.read_text(), str(path))))
    return out


def _imports(m: Module) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import of the package's own modules, at any depth of the file."""
    is_pkg = m.path.name == "__init__.py"
    for node in ast.walk(m.tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            if name.split(".")[0] == PACKAGE.name:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE.name:
                    yield node.lineno, a.name


def _room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _functions(m: Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(m.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return n - (1 if first and first[0].arg in ("self", "cls") else 0)


def test_the_rollout_role_and_the_opd_roles_do_not_import_each_other() -> None:
    bad = [
        f"{m.name}:{line} imports {name}"
        for m in _modules()
        if m.room in ROLES_APART
        for line, name in _imports(m)
        if _room(name) in ROLES_APART and _room(name) != m.room
    ]
    assert not bad, "\n".join(bad)


def test_config_imports_nothing_above_it() -> None:
    bad = [
        f"{m.name}:{line} imports {name}"
        for m in _modules()
        if m.room == "config"
        for line, name in _imports(m)
        if _room(name) not in CONFIG_MAY_IMPORT
    ]
    assert not bad, "\n".join(bad)


def test_no_module_is_looked_up_by_a_name_built_from_strings() -> None:
    bad = []
    for m in _modules():
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.endswith("import_module") or called == "__import__":
                    arg = ast.unparse(node.args[0]) if node.args else ""
                    if not (isinstance(node.args[0], ast.Constant) and PACKAGE.name not in arg):
                        bad.append(f"{m.name}:{node.lineno} {called}({arg})")
    assert not bad, "\n".join(bad)


def test_no_function_takes_more_than_ten_parameters() -> None:
    bad = [
        f"{m.name}.{f.name} (line {f.lineno}): {_parameters(f)} parameters"
        for m in _modules()
        for f in _functions(m)
        if _parameters(f) > MAX_PARAMETERS
    ]
    assert not bad, "\n".join(bad)


def test_no_function_is_over_eighty_lines() -> None:
    bad = [
        f"{m.name}.{f.name} (line {f.lineno}): {f.end_lineno - f.lineno + 1} lines"
        for m in _modules()
        for f in _functions(m)
        if f.end_lineno is not None and f.end_lineno - f.lineno + 1 > MAX_LINES
    ]
    assert not bad, "\n".join(bad)
