"""The commands of the pages a user reads (README, docs/usage.md, docs/cluster.md) work as written. Every command
line of their ```bash blocks, and every command they quote in the text (`python ...`, `make ...`, `launch/...`,
`scripts/...`, `ray ...`), has a row in `COMMANDS`: run as written, run as a variant (a dry run, `--help`, a
placeholder such as `outputs/...` or `/models/Llama-3.1-8B-Instruct` filled with a folder made here), or skipped
with the reason. A command without a row, or a row whose command left every page, fails
`test_every_readme_command_has_a_row`; each row that runs is one case of `test_readme_command`, named by its line,
which prints that line and what ran.

The run dir the eval and resume lines read (`outputs/2026-12-01/10-00-00`, the README's example) is written here by
the checkpoint writer the stages use (`write_checkpoint`: `checkpoints/opd/step_<n>/` with a draft folder's
config.json and a training state, `latest` pointing at step 2); validation reads config.json files, never weights.
`test_eval_of_a_real_runs_latest_draft` (slow) evaluates the `latest/draft` of a real run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import helpers

README = helpers.REPO / "README.md"
PAGES = [README, helpers.REPO / "docs" / "usage.md", helpers.REPO / "docs" / "cluster.md"]
RUN = "outputs/2026-12-01/10-00-00"  # the README's example run dir, made by `work`
NO_GPU = shutil.which("nvidia-smi") is None
# a case's budget: a dry run takes seconds, the first engine-support query imports vLLM's registry once
SECONDS = 300


@dataclass(frozen=True)
class Row:
    """How one README command is checked. ``run``: the shell line run (None: skipped; "" : the README line itself),
    with ``{LINE}`` (the README line), ``{REPO}``, ``{WORK}`` and ``{PORT}`` (a free port) filled in; ``why``: why a variant or a skip;
    ``where``: the working dir, "work" (a temporary dir holding the folders made here) or "repo"; ``rc`` and
    ``shows``: the exit code the run must end with and texts it must print."""

    run: str | None = ""
    why: str = ""
    where: str = "work"
    rc: int = 0
    shows: tuple[str, ...] = ()


def dry(why: str, *shows: str) -> Row:
    """The README line itself with `dry_run=true` added (validate, print the plan, start nothing)."""
    return Row(run="{LINE} dry_run=true", why=why, shows=("placement plan", *shows))


def skip(why: str) -> Row:
    return Row(run=None, why=why)


STEP_2_DRAFT = f"{{WORK}}/{RUN}/checkpoints/opd/step_2/draft"

COMMANDS: dict[str, Row] = {
    # --- ```bash blocks ---
    "make run": Row(
        run="make -s -n -C {REPO} run PY=python && python -m draft_opd_ray.main dry_run=true",
        why="the default run takes ~45 min: its recipe as make prints it, then that command as a dry run",
        shows=("python -m draft_opd_ray.main", "placement plan"),
    ),
    "make test": skip("the suite this test runs in (what CI runs: .ci/run)"),
    "python -m draft_opd_ray.main +cluster=8xA100 dry_run=true": Row(
        shows=("placement plan for cluster '8xA100'",)
    ),
    "python -m draft_opd_ray.main +cluster=8xA100 target.path=/models/Llama-3.1-8B-Instruct dry_run=true": Row(
        run="python -m draft_opd_ray.main +cluster=8xA100 target.path={WORK}/models/Llama-3.1-8B-Instruct dry_run=true",
        why="no Llama-3.1-8B here: its config.json and generation_config.json (what validation reads) in a folder",
        shows=(
            "placement plan for cluster '8xA100'",
            "draft.draft_vocab_size 32000",
            "draft.aux_layer_ids [2, 16, 31]",
            "stop ids [128001, 128008, 128009]",
        ),
    ),
    "python -m draft_opd_ray.main +cluster=8xA100 target.path=/models/Llama-3.1-8B-Instruct": Row(
        run="python -m draft_opd_ray.main +cluster=8xA100 target.path={WORK}/models/Llama-3.1-8B-Instruct dry_run=true",
        why="an 8-GPU run: its dry run on the config-only Llama folder",
        shows=("placement plan for cluster '8xA100'", "target.max_model_len 1024"),
    ),
    "python -m draft_opd_ray.main +cluster=8xA100 target.path=/models/Llama-3.1-8B-Instruct stages=[opd,eval] "
    "draft.path=/drafts/llama31-eagle3": Row(
        run="python -m draft_opd_ray.main +cluster=8xA100 target.path={WORK}/models/Llama-3.1-8B-Instruct "
        "stages=[opd,eval] draft.path={WORK}/drafts/llama31-eagle3 dry_run=true",
        why="the user's EAGLE-3 head for Llama: its config.json in a folder, and a dry run",
        shows=("from {WORK}/drafts/llama31-eagle3", "placement plan for cluster '8xA100'"),
    ),
    "vllm serve /models/Llama-3.1-8B-Instruct --speculative-config "
    """'{"method":"eagle3","model":"RUN/checkpoints/opd/latest/draft","num_speculative_tokens":4}'""": skip(
        "stock vLLM's server on an 8B target; tests/integration/test_serve_vllm.py serves exported drafts with "
        "vLLM's engine and checks the answers equal plain decoding"
    ),
    "vllm serve <target folder> --speculative-config "
    """'{"method":"eagle3","model":"<run dir>/checkpoints/opd/latest/draft","num_speculative_tokens":4}'""": skip(
        "the same stock command with placeholders (the line above)"
    ),
    "make serve": Row(
        run="make -s -n -C {REPO} serve PY=python",
        why="a server runs until stopped: its recipe as make prints it",
        shows=("python -m draft_opd_ray.serve",),
    ),
    "make serve-demo": skip(
        "two servers on 96 ShareGPT prompts: ~20 min; its pieces run in tests/integration/test_serve_learns.py"
    ),
    "python -m draft_opd_ray.serve.demo": skip("the same demo (make serve-demo runs it)"),
    "python -m draft_opd_ray.serve.rollback outputs/2026-12-07/10-00-00 1": Row(
        run=f"python -m draft_opd_ray.serve.rollback {{WORK}}/{RUN} 1",
        why="it acts on a running server (tests/integration/test_serve_learns.py rolls one back): on the example "
        "run dir, which no server ran, its one error line",
        rc=2,
        shows=("error: RUN_DIR: ", "no serve.port: not a server's run dir"),
    ),
    "python -m draft_opd_ray.serve.rollback outputs/2026-12-07/10-00-00 1 --freeze": Row(
        run="python -m draft_opd_ray.serve.rollback --help",
        why="the same on a running server, learning stopped too: its help names the option",
        shows=("--freeze", "stop learning too"),
    ),
    "python -m draft_opd_ray.serve +cluster=gpu_shared": Row(
        run="CUDA_VISIBLE_DEVICES= python -m draft_opd_ray.serve +cluster=gpu_shared dry_run=true serve.port={PORT}",
        why="a server on one GPU runs until stopped: its dry run prints where the engine and the learner go",
        shows=(
            "GPUs: vLLM's engine on ['0']; the learner's side (replay 0.25, learner 0.25, guard 0.25 GPU) on ['0']",
        ),
    ),
    "python -m draft_opd_ray.serve": Row(
        run="python -m draft_opd_ray.serve dry_run=true serve.port={PORT}",
        why="a server runs until stopped (tests/integration/test_serve_learns.py starts one): its dry run, on a "
        "free port (the port is checked before anything loads)",
        shows=("serve: vLLM's OpenAI server on http://127.0.0.1:", "teacher: verify"),
    ),
    "python -m draft_opd_ray.serve target.path=/models/Llama-3.1-8B-Instruct draft.path=/drafts/llama31-eagle3 "
    "serve.port=8001": Row(
        run="python -m draft_opd_ray.serve target.path={WORK}/models/Llama-3.1-8B-Instruct "
        "draft.path={WORK}/drafts/llama31-eagle3 serve.port={PORT} dry_run=true",
        why="the config-only Llama folder and the user's EAGLE-3 head: a dry run, on a free port",
        shows=("from {WORK}/drafts/llama31-eagle3", "draft.draft_vocab_size 32000"),
    ),
    "python -m draft_opd_ray.check_teacher": skip(
        "rolls a few MT-Bench prompts out with capture and replays them: minutes; "
        "tests/integration/test_verify_capture_vllm.py holds the capture to the replay on 3 prompts"
    ),
    "scripts/setup.sh --dry-run": Row(
        why="prints the flavour and the pip commands, installs nothing", where="repo", shows=("[setup]",)
    ),
    "scripts/setup.sh cpu": skip("installs packages (the CPU flavour named)"),
    "python -m draft_opd_ray.main resume=<run dir>": Row(
        run="python -m draft_opd_ray.main resume={WORK}/" + RUN + " dry_run=true",
        why="the placeholder filled with the run dir made here, as a dry run",
        shows=("placement plan",),
    ),
    "python -m draft_opd_ray.compare RUN_DIR...|results/<study>": skip(
        "the forms in one synopsis; `python -m draft_opd_ray.compare results/default_controls` runs"
    ),
    "python -m draft_opd_ray.main [+cluster=NAME] [group=option ...] [key=value ...]": skip(
        "the usage synopsis; `--help` prints it"
    ),
    'make run ARGS="opd.steps=3"': Row(
        run='make -s -n -C {REPO} run PY=python ARGS="opd.steps=3"',
        why="the default run with an override: its recipe as make prints it",
        shows=("python -m draft_opd_ray.main opd.steps=3",),
    ),
    "launch/gpu_smoke.sh --dry-run": Row(
        why="prints every stage's command and runs it with dry_run=true (no GPU needed)",
        where="repo",
        shows=("placement plan",),
    ),
    "ray start": skip("Ray's own CLI: starts a node of a real cluster"),
    "ray start --head": skip("Ray's own CLI: starts a cluster's head node"),
    "ray start --address=<head>:6379": skip("Ray's own CLI: joins a node to a real cluster"),
    "ray job logs -f <submission id>": skip("Ray's own CLI against a running job"),
    "ray job stop <submission id>": skip(
        "Ray's own CLI against a running job; tests/e2e/test_resume_exact.py sends its SIGTERM"
    ),
    "launch/local_cluster.sh": skip("the script's name; its start and stop lines have rows"),
    "python -m draft_opd_ray.main -m loss.gamma=0.6,0.8,0.9 anchor.policy=error,all": Row(
        run="{LINE} dry_run=true",
        why="six full runs; each job of the sweep validated and planned",
        shows=(
            "#0 : loss.gamma=0.6 anchor.policy=error",
            "#5 : loss.gamma=0.9 anchor.policy=all",
            "anchors: all",
        ),
    ),
    "python -m draft_opd_ray.main stages=[eval] draft.path=outputs/.../checkpoints/opd/latest/draft": Row(
        run=f"python -m draft_opd_ray.main stages=[eval] draft.path={RUN}/checkpoints/opd/latest/draft dry_run=true",
        why="`...` filled with the run dir made here; a dry run validates the draft folder `latest` leads to",
        shows=(f"from {STEP_2_DRAFT}", "placement plan"),
    ),
    "python -m draft_opd_ray.main draft=standalone stages=[sft,eval]": dry("an SFT stage and an evaluation"),
    "python -m draft_opd_ray.main draft=dflash stages=[opd,eval] draft.path=/drafts/my-dflash replay.mode=redraft": Row(
        run="python -m draft_opd_ray.main draft=dflash stages=[opd,eval] draft.path={WORK}/drafts/my-dflash "
        "replay.mode=redraft dry_run=true",
        why="the user's DFlash draft: a config.json made for the embedded target in its place, and a dry run",
        shows=("dflash", "placement plan"),
    ),
    "RAY_ADDRESS=http://head:8265 launch/submit_ray_job.sh +cluster=2x8xH100 ...": skip(
        "needs a multi-node cluster's job server; tests/integration/test_cluster.py (slow) submits a run as a Ray "
        "job to a local 2-node cluster"
    ),
    "export RAY_ADDRESS=127.0.0.1:6390": Row(
        run="{LINE} && printenv RAY_ADDRESS",
        why="the environment of the next line (which runs with it): set and read back",
        shows=("127.0.0.1:6390",),
    ),
    "python -m draft_opd_ray.main +cluster=cpu_2node dry_run=true": Row(
        run="RAY_ADDRESS=127.0.0.1:6390 {LINE}",
        why="after the block's `export RAY_ADDRESS=...`; a dry run never joins the cluster",
        shows=("placement plan for cluster 'cpu_2node'",),
    ),
    "RAY_ADDRESS=http://127.0.0.1:8275 launch/submit_ray_job.sh +cluster=cpu_2node ...": skip(
        "needs the 2-node cluster `launch/local_cluster.sh start` starts (Ray, minutes); "
        "tests/integration/test_cluster.py (slow) runs it"
    ),
    "launch/local_cluster.sh stop": Row(
        run="LOCAL_CLUSTER_DIR={WORK}/no_cluster launch/local_cluster.sh stop",
        why="stops only the cluster recorded in its state folder: pointed at an empty one, so that it stops nothing "
        "another test started",
        where="repo",
        shows=("not running",),
    ),
    # --- commands quoted in the text ---
    "scripts/setup.sh": skip("installs packages; every make target (`make test` too) has run it first"),
    "scripts/setup.sh gpu": skip("the set-up of a CUDA image (stock vLLM)"),
    "python -m draft_opd_ray.compare results/default_controls": Row(
        run="{LINE} --out {WORK}/compare",
        why="on the committed raw results, as a fresh clone would; written to a folder of its own, not the repo's",
        where="repo",
        shows=("Primary endpoint", "opd − sft", "80 prompts"),
    ),
    "--help": Row(
        run="python -m draft_opd_ray.main --help",
        why="the README's `--help`",
        shows=("Main keys", "stages=[eval] draft.path=RUN/checkpoints/opd/latest/draft"),
    ),
    "launch/gpu_smoke.sh --check": Row(
        why="seconds; without a GPU it says so and exits 2, as documented",
        where="repo",
        rc=2 if NO_GPU else 0,
        shows=("no GPU",) if NO_GPU else (),
    ),
    "launch/gpu_smoke.sh": skip("a few minutes on a GPU; its `--check` runs here"),
    "launch/gpu_smoke.sh --serve": skip(
        "minutes on a GPU; its serve stage's server is dry-run by `launch/gpu_smoke.sh --dry-run` here"
    ),
    "python -m draft_opd_ray.main resume=outputs/2026-12-01/10-00-00": dry(
        "the README's run dir, made here with a complete opd checkpoint"
    ),
    "launch/local_cluster.sh start": skip(
        "starts a 2-node Ray cluster (minutes, most of the machine); tests/integration/test_cluster.py (slow) does"
    ),
    "launch/submit_ray_job.sh": skip("needs a Ray cluster's job server (see the submit lines above)"),
    'python -m pytest -m "" tests/integration/test_cluster.py': skip("~15 min: part of `make test-slow`"),
    "make test-fast": skip("the unit tests, part of the suite this test runs in"),
    "make test-slow": skip("the slow end-to-end runs (hours together)"),
    "make lint": skip("part of `make test`, which runs this test"),
    "make format": skip("rewrites files in the checkout; `make lint` checks the same"),
    "make typecheck": skip("part of `make test`, which runs this test"),
    "make dry-run": Row(
        run="make -s -n -C {REPO} dry-run PY=python && python -m draft_opd_ray.main +cluster=8xA100 dry_run=true",
        why="its recipe as make prints it (the set-up prerequisite not run), then that command",
        shows=(
            "python -m draft_opd_ray.main +cluster=8xA100 dry_run=true",
            "placement plan for cluster '8xA100'",
        ),
    ),
    "make bench": skip("benchmarks P0-P7: slow, meant for a quiet machine"),
    "python -m pytest -m slow tests/e2e/test_qwen3_e2e.py": skip("3-6 min: part of `make test-slow`"),
}

# A command quoted in the text: a code span that starts with one of these (the rest of the spans are keys, paths,
# file names and values).
INLINE = re.compile(r"^(python |make |bash |launch/|scripts/|ray |[A-Z_]+=\S* (bash|python|launch/)|--help$)")


def readme_commands(text: str) -> list[str]:
    """Every command line of the ```bash blocks (comments cut), then every command quoted in the text, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    lines = [re.sub(r"\s+#.*$", "", x).strip() for b in blocks for x in b.splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = [s for s in re.findall(r"`([^`\n]+)`", prose) if INLINE.match(s)]
    return list(dict.fromkeys([x for x in lines if x] + spans))


def test_every_readme_command_has_a_row() -> None:
    per_page = {p.name: readme_commands(p.read_text()) for p in PAGES}
    assert all(len(found) >= 15 for found in per_page.values()), per_page  # the parser still finds the blocks
    found = list(dict.fromkeys(c for cs in per_page.values() for c in cs))
    new = [c for c in found if c not in COMMANDS]
    assert not new, f"commands with no row in COMMANDS (run, variant or skip with a reason): {new}"
    gone = [c for c in COMMANDS if c not in found]
    assert not gone, f"rows of COMMANDS no longer on any page: {gone}"
    for line, row in COMMANDS.items():
        assert row.run == "" or row.why, f"{line}: a variant or a skip says why"
        how = "skipped" if row.run is None else "as written" if row.run == "" else "variant"
        print(f"{how:10} {line}" + (f"  ({row.why})" if row.why else ""))


def _write_run(run: Path, steps: int) -> None:
    """A run dir as the stages leave it: Hydra's config and `checkpoints/opd/step_<n>/` written by the checkpoint
    writer, each with an EAGLE-3 draft folder's config.json for the embedded target and a training state."""
    import torch

    from draft_opd_ray.checkpoint import write_checkpoint

    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("stages: [opd]\n")

    def fill(tmp: Path) -> None:
        _draft_config(tmp / "draft", "eagle3")
        torch.save({"step": steps}, tmp / "training_state.pt")

    for n in range(1, steps + 1):
        write_checkpoint(run / "checkpoints" / "opd", f"step_{n}", fill)


def _draft_config(folder: Path, kind: str) -> Path:
    """An exported draft's config.json as validation reads it, made for the embedded SmolLM2 target (no weights)."""
    folder.mkdir(parents=True)
    made: dict[str, object] = {"kind": kind, **({"target_num_layers": 30} if kind == "eagle3" else {})}
    cfg = {"hidden_size": 576, "target_hidden_size": 576, "vocab_size": 49152, "draft_opd": made}
    (folder / "config.json").write_text(
        json.dumps({**cfg, **({"draft_vocab_size": 8192} if kind == "eagle3" else {})})
    )
    return folder


def _llama31_8b(folder: Path) -> None:
    """Llama-3.1-8B-Instruct's public config.json (bench/gpu_study.yaml keeps it) and generation_config.json."""
    import yaml

    study = yaml.safe_load((helpers.REPO / "bench" / "gpu_study.yaml").read_text())
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(study["targets"]["llama31_8b"]["config"]))
    gen = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    (folder / "generation_config.json").write_text(json.dumps(gen))


def _llama_eagle3_config(folder: Path) -> None:
    """An EAGLE-3 head's config.json made for Llama-3.1-8B (32 layers, hidden 4096, a 32k draft vocabulary)."""
    folder.mkdir(parents=True)
    cfg = {
        "hidden_size": 4096,
        "target_hidden_size": 4096,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "draft_opd": {"kind": "eagle3", "target_num_layers": 32},
    }
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working dir of the `work` rows: the README's run dir, a Llama-3.1-8B config with an EAGLE-3 head's, a
    DFlash draft, study arms."""
    from tests.unit.test_compare import write_run

    w = tmp_path_factory.mktemp("readme")
    _write_run(w / RUN, steps=2)
    _llama31_8b(w / "models" / "Llama-3.1-8B-Instruct")
    _llama_eagle3_config(w / "drafts" / "llama31-eagle3")
    _draft_config(w / "drafts" / "my-dflash", "dflash")
    arms = w / "runs" / "study" / "eagle3" / "arms"
    counts = {"opd": [(10, 9), (8, 6), (12, 8)], "sft": [(10, 7), (8, 6), (12, 7)]}
    for arm, pp in counts.items():
        for seed in (0, 1):
            over = ["algorithm=sft_on_rollouts"] if arm == "sft" else []
            write_run(arms / f"{arm}_s{seed}", pp, overrides=[*over, f"seed={seed}"], seed=seed)
    return w


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYDRA_FULL_ERROR")}
    # the cpu_2node group's storage dir (its run dirs) inside the test's folder
    return {**env, "PYTHONPATH": str(helpers.REPO), "DRAFT_OPD_STORAGE_DIR": str(work / "storage")}


RUNS = [line for line, row in COMMANDS.items() if row.run is not None]


@pytest.mark.parametrize("line", RUNS, ids=RUNS)
def test_readme_command(line: str, work: Path) -> None:
    row = COMMANDS[line]
    fill = {
        "{LINE}": line,
        "{REPO}": str(helpers.REPO),
        "{WORK}": str(work.resolve()),
        "{PORT}": str(_free_port()),
    }
    cmd = row.run or line
    for k, v in fill.items():
        cmd = cmd.replace(k, v)
    cwd = helpers.REPO if row.where == "repo" else work
    r = subprocess.run(
        ["bash", "-c", cmd], cwd=cwd, env=_env(work), capture_output=True, text=True, timeout=SECONDS
    )
    print(
        f"README: {line}\nran:    {cmd}  (in {row.where}; {row.why or 'as written'})\nexit:   {r.returncode}"
    )
    out = r.stdout + r.stderr
    assert r.returncode == row.rc, out[-3000:]
    shows = [s.replace("{WORK}", str(work.resolve())) for s in row.shows]
    assert all(s in out for s in shows), ([s for s in shows if s not in out], out[-3000:])
    assert "Traceback" not in out


def test_an_old_run_dir_with_a_text_latest_still_resumes_and_serves_its_draft(
    work: Path, tmp_path: Path
) -> None:
    """A run dir written before `latest` became a symlink (`latest` a text file naming the step): `resume=` finds
    its checkpoint, and `draft.path=<run>/checkpoints/opd/latest/draft` is the step it names."""
    run = tmp_path / "old_run"
    _write_run(run, steps=2)
    latest = run / "checkpoints" / "opd" / "latest"
    latest.unlink()
    latest.write_text("step_1\n")
    env = _env(work)
    r = subprocess.run(
        [sys.executable, "-m", "draft_opd_ray.main", f"resume={run}", "dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS,
    )
    assert r.returncode == 0 and "placement plan" in r.stdout, r.stderr[-3000:]
    draft = f"draft.path={run}/checkpoints/opd/latest/draft"
    r = subprocess.run(
        [sys.executable, "-m", "draft_opd_ray.main", "stages=[eval]", draft, "dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"from {(run / 'checkpoints' / 'opd' / 'step_1' / 'draft').resolve()}" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.deepspeed
def test_eval_of_a_real_runs_latest_draft(tiny_target: Path, tmp_path: Path) -> None:
    """The README's eval line on a real run: two Draft-OPD steps on the tiny target, then `stages=[eval]
    draft.path=outputs/<run>/checkpoints/opd/latest/draft`, relative, as a user types it (a path vLLM, given it
    unresolved, would look up as a model-hub repo id): the report names the step-2 draft folder it served."""
    run = tmp_path / "outputs" / "run"
    common = [f"target.path={tiny_target}", "wandb.mode=disabled"]
    r = helpers.run_main(
        "stages=[opd]",
        *common,
        "rollout.prompts_per_round=4",
        "rollout.max_new_tokens=24",
        "data.train.max_prompts=16",
        "draft.aux_layer_ids=[0,1,2]",
        "opd.steps=2",
        "opd.checkpoint_every=1",
        f"hydra.run.dir={run}",
        timeout=1500,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.readlink(run / "checkpoints" / "opd" / "latest") == "step_2"
    argv = [sys.executable, "-m", "draft_opd_ray.main", "stages=[eval]"]
    argv += ["draft.path=outputs/run/checkpoints/opd/latest/draft"]  # as typed: relative, through `latest`
    evals = ["data.eval.max_prompts=4", "eval.baselines=[]", "eval.max_new_tokens=16", "eval.concurrency=[1]"]
    r = subprocess.run(
        [*argv, *common, *evals, "hydra.run.dir=eval_run"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "eval_run" / "eval" / "report.json").read_text())
    assert report["draft"] == str((run / "checkpoints" / "opd" / "step_2" / "draft").resolve())
    assert report["datasets"]["mtbench"]["n"] >= 1
