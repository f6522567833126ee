"""Import arrows between the package's top-level modules and its subpackages run one way, read from the source
(``ast``, nothing imported). Every import counts: at module level, inside functions, under ``TYPE_CHECKING``.

A top-level module (flops, slot_call, placement, errors, wire, ...) may import a subpackage, or be imported by
one, but not both: a subpackage that imports a top-level module which imports it back is a loop at the package
level even when no two modules form one (flops -> drafts.eagle3.model while drafts/*/recipe.py -> flops)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "draft_opd_ray"
LOW_MODULES = ("flops", "slot_call", "placement", "errors", "wire")  # named in the rule; all are checked


def package_sources(root: Path = PACKAGE) -> dict[str, str]:
    """Relative path (``draft_opd_ray/sft/stage.py``) -> source, for every module of the package."""
    return {p.relative_to(root.parent).as_posix(): p.read_text() for p in sorted(root.rglob("*.py"))}


def _module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any depth of the file; relative imports resolved;
    ``from pkg import mod`` names ``pkg.mod`` when that is a module)."""
    names = {_module_name(p): p for p in sources}
    pkg = next(iter(names)).split(".")[0]
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(sources[path], path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if path.endswith("__init__.py") else 0)]
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != pkg:
                    continue
                subs = {f"{mod}.{a.name}" for a in node.names} & names.keys()
                out |= subs or {mod}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.split(".")[0] == pkg}
        out.discard(name)
        graph[name] = out
    return graph


def unit(name: str) -> str:
    """The package-level unit of a module: its subpackage (``draft_opd_ray.sft``) or, for a module directly
    under the package, the module itself (``draft_opd_ray.flops``)."""
    parts = name.split(".")
    return ".".join(parts[:2])


def unit_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Unit -> the other units its modules import."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(unit(m), set()).update(unit(t) for t in targets)
    for u, targets in out.items():
        targets.discard(u)
    return out


def arrows(graph: Mapping[str, set[str]], src: str, dst_unit: str) -> list[str]:
    """``src -> module`` for each module of ``dst_unit`` that module ``src`` imports."""
    return sorted(f"{src} -> {t}" for t in graph.get(src, ()) if unit(t) == dst_unit)


def top_level_modules(graph: Mapping[str, set[str]]) -> list[str]:
    """The modules directly under the package (``draft_opd_ray.flops``), not its subpackages."""
    return sorted(m for m in graph if m.count(".") == 1 and not any(n.startswith(m + ".") for n in graph))


def loops_with_subpackages(graph: Mapping[str, set[str]]) -> list[str]:
    """``module <-> subpackage`` for each top-level module and subpackage that import each other."""
    units = unit_graph(graph)
    subpackages = {unit(m) for m in graph if m.count(".") >= 2}
    return [
        f"{top} <-> {sub}"
        for top in top_level_modules(graph)
        for sub in sorted(units.get(top, set()) & subpackages)
        if top in units.get(sub, set())
    ]


def test_flops_imports_nothing_from_drafts() -> None:
    assert arrows(import_graph(package_sources()), "draft_opd_ray.flops", "draft_opd_ray.drafts") == []


def test_slot_call_imports_nothing_from_sft() -> None:
    assert arrows(import_graph(package_sources()), "draft_opd_ray.slot_call", "draft_opd_ray.sft") == []


def test_no_loop_between_a_top_level_module_and_a_subpackage() -> None:
    graph = import_graph(package_sources())
    assert {f"draft_opd_ray.{m}" for m in LOW_MODULES} <= set(top_level_modules(graph))
    assert loops_with_subpackages(graph) == []


def test_the_graph_sees_imports_under_type_checking_and_in_functions() -> None:
    """The reader itself: a TYPE_CHECKING import and a function-local one are arrows, as are relative and
    ``from pkg import module`` forms."""
    sources = {
        "p/__init__.py": "",
        "p/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.sub.a import A\n",
        "p/sub/__init__.py": "",
        "p/sub/a.py": "def f():\n    from p import low\n",
        "p/sub/b.py": "from .a import f\nimport p.low\n",
    }
    g = import_graph(sources)
    assert g["p.low"] == {"p.sub.a"}
    assert g["p.sub.a"] == {"p.low"}
    assert g["p.sub.b"] == {"p.sub.a", "p.low"}
    assert unit_graph(g)["p.low"] == {"p.sub"}
    assert arrows(g, "p.low", "p.sub") == ["p.low -> p.sub.a"]
    assert top_level_modules(g) == ["p.low"]
    assert loops_with_subpackages(g) == ["p.low <-> p.sub"]
