"""results/bench/<id>.json, the raw file behind a line of docs/benchmarks.md: the bench writer produces every field
results/README.md lists, every committed file has them and its value is the number its docs line quotes, every
other line says that its raw output was not kept, and the bench scripts import only names that exist."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
ID_LINE = re.compile(r"^(P\d|K-[\w-]+|T-[\w-]+) ")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?")
NOT_KEPT = "raw output not kept"
# P1 is backed by a study under results/<study> (python -m draft_opd_ray.compare), pinned by its own tests
ELSEWHERE = {"P1"}


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the scripts import `_results` as `python bench/x.py` does
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _doc_lines() -> dict[str, str]:
    """Each id's line, with the lines that continue its paragraph (the K- lines wrap)."""
    out: dict[str, str] = {}
    current = None
    for line in DOC.read_text().splitlines():
        m = ID_LINE.match(line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.strip() and not line.startswith("#"):
            out[current] += " " + line
        else:
            current = None
    return out


def _numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    return [float(value)]


def test_writer_fields_command_and_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = _load("_results")
    argv = [
        str(BENCH / "bench_x.py"),
        "--reps",
        "3",
        "--notes",
        "a note",
        "--out",
        str(tmp_path / "{id}.json"),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    args = type("Args", (), {"out": str(tmp_path / "{id}.json"), "notes": "a note"})()
    path = results.write_result(args, "P9", value={"a": 0.5}, target="<= 1", met=True, raw={"xs": [1, 2]})
    assert path == tmp_path / "P9.json"
    rec = json.loads(path.read_text())
    assert set(results.REQUIRED) <= set(rec)
    assert (
        rec["id"] == "P9"
        and rec["value"] == {"a": 0.5}
        and rec["met"] is True
        and rec["raw"] == {"xs": [1, 2]}
    )
    expected = ["bench/bench_x.py", "--reps", "3", "--out", str(tmp_path / "{id}.json")]
    assert rec["command"] == "python " + shlex.join(expected)  # relative script path, no --notes
    assert rec["notes"] == "a note"
    assert re.fullmatch(r"[0-9a-f]{7,}", rec["commit"])
    assert {"cpu", "cores", "auto_precision"} <= set(rec["machine"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date"])


def test_eval_report_bench_writes_p7_from_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_eval_report.py: P7's value is the report's speed-up per concurrency; met needs >= 1.5 at batch 1
    and more than ngram's."""
    entry = {
        "tau": 1.4,
        "tau_vllm": 1.4,
        "n": 2,
        "speedup": {"1": 1.61, "4": 0.8},
        "tokens_per_s": {"1": 30.0},
    }
    ngram = {"tau_vllm": 3.0, "speedup": {"1": 1.5, "4": 0.9}}
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    report = {"draft": "x/draft", "datasets": {"mtbench": entry}, "baselines": {"ngram": {"mtbench": ngram}}}
    (run / "eval" / "report.json").write_text(json.dumps(report))
    out = tmp_path / "{id}.json"
    monkeypatch.setattr(sys, "argv", ["bench/bench_eval_report.py", "P7", str(run), "--out", str(out)])
    _load("bench_eval_report").main()
    rec = json.loads((tmp_path / "P7.json").read_text())
    assert rec["value"] == {"1": 1.61, "4": 0.8} and rec["met"] is True
    assert rec["raw"]["ngram_speedup"] == ngram["speedup"]
    assert rec["command"].startswith("python bench/bench_eval_report.py P7 ")


def test_committed_results_have_the_fields_and_match_their_docs_line() -> None:
    required = _load("_results").REQUIRED
    lines = _doc_lines()
    files = sorted((ROOT / "results" / "bench").glob("*.json"))
    for path in files:
        rec = json.loads(path.read_text())
        assert set(required) <= set(rec), (path.name, set(required) - set(rec))
        assert rec["id"] == path.stem
        assert rec["command"].startswith("python bench/"), rec["command"]
        assert rec["met"] is None if rec["target"] is None else isinstance(rec["met"], bool)
        assert rec["id"] in lines, f"{rec['id']}: no line in docs/benchmarks.md"
        line = lines[rec["id"]]
        assert f"results/bench/{path.name}" in line
        quoted = {float(x.replace(",", "")) for x in NUMBER.findall(line)}
        for x in _numbers(rec["value"]):
            assert x in quoted, f"{rec['id']}: value {x} is not in its docs line"


def test_every_other_line_says_its_raw_output_was_not_kept() -> None:
    kept = {p.stem for p in (ROOT / "results" / "bench").glob("*.json")}
    for bench_id, line in _doc_lines().items():
        if bench_id not in kept | ELSEWHERE:
            assert NOT_KEPT in line, f"{bench_id}: neither results/bench/{bench_id}.json nor '{NOT_KEPT}'"


def _defined(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_bench_scripts_import_names_that_exist(script: str) -> None:
    """Read, not imported (the scripts import vLLM and Ray): every `from draft_opd_ray.x import y` names a module
    file that defines y (or a subpackage)."""
    for node in ast.walk(ast.parse((BENCH / script).read_text())):
        name = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if isinstance(node, ast.ImportFrom) and name.startswith("draft_opd_ray"):
            base = ROOT / Path(*name.split("."))
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            assert module.is_file(), f"{script}: no module {name}"
            names = _defined(module)
            for alias in node.names:
                sub = base / alias.name
                assert alias.name in names or sub.with_suffix(".py").is_file() or sub.is_dir(), (
                    f"{script}: {name} has no {alias.name}"
                )
