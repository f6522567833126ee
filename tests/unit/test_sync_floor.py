"""Weight sync's package and the wire contracts keep their floors (read from the source, no imports run), and the
worker-extension path vLLM imports names the receiver class."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "draft_opd_ray"


def _package_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, at any depth of the file (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draft_opd_ray"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("draft_opd_ray")}
    return out


def test_sync_imports_none_of_the_roles() -> None:
    allowed = ("sync", "placement", "errors", "waits", "wire")
    bad = {
        f"{path.name} imports {name}"
        for path in sorted((PACKAGE / "sync").glob("*.py"))
        for name in _package_imports(path)
        if name.split(".")[1] not in allowed
    }
    assert not bad, sorted(bad)


def test_wire_is_the_bottom_floor() -> None:
    assert _package_imports(PACKAGE / "wire.py") == set()


def test_worker_extension_path_names_the_receiver() -> None:
    """`worker_extension_cls` is a qualified name vLLM imports in each worker process: the rollout engines' extension,
    the weight receiver plus the verify-pass capture's two calls."""
    from draft_opd_ray.rollout.engine import EXTENSION
    from draft_opd_ray.sync.receiver import DraftWeightExtension

    module, _, name = EXTENSION.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, DraftWeightExtension)
    assert callable(cls.install_verify_capture) and callable(cls.take_verify_capture)
