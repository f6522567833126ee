"""Helpers shared by the test tiers: hand-built records, explicit reference computations, tiny models, the
greedy speculative-decoding loop the serving tests compare against, and starting `draft_opd_ray.main` or a vLLM
engine. Importing this module imports torch only: vLLM, Ray and DeepSpeed load inside the helpers that use them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draft_opd_ray.wire import ReplayItem, RequestRecord

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------


def replay_configs(
    kind: str,
    num_speculative_tokens: int,
    *,
    payload: str = "full",
    topk: int = 32,
    dtype: str = "float32",
    teacher: bool = True,
    mode: str = "recorded",
    draft_topm: int = 0,
    source: str = "replay",
) -> tuple[Any, Any, Any, Any]:
    """(draft, teacher, loss, replay) configs of a replay actor, from the payload it ships: "full" (teacher.topk
    null) or "topk" (the top ``topk``); ``teacher=False`` is `loss.objective=sft_on_rollouts`; ``draft_topm`` is
    `loss.draft_topm` (used with the topk payload and the replay's teacher); ``source`` is `teacher.source`."""
    from draft_opd_ray.config.schema import DraftConfig, LossConfig, ReplayConfig, TeacherConfig

    return (
        DraftConfig(kind=kind, num_speculative_tokens=num_speculative_tokens),
        TeacherConfig(dtype=dtype, topk=None if payload == "full" else topk, source=source),
        LossConfig(objective="opd" if teacher else "sft_on_rollouts", draft_topm=draft_topm),
        ReplayConfig(mode=mode),
    )


def replay_actor(
    target: str | os.PathLike[str],
    aux_layer_ids: Sequence[int],
    draft_ids: Sequence[int] | None,
    num_speculative_tokens: int,
    *,
    kind: str = "eagle3",
    draft_dir: str | None = None,
    cpu_share: tuple[int, int] | None = None,
    **settings: Any,
) -> Any:
    """A `ReplayActor` on ``target`` with blocks of ``num_speculative_tokens``; ``settings``: `replay_configs`'s."""
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    run = ReplayRun(str(target), aux_layer_ids, draft_ids, draft_dir, cpu_share=cpu_share)
    return ReplayActor(run, *replay_configs(kind, num_speculative_tokens, **settings))


def spec_engine(
    target: str | os.PathLike[str],
    kind: str,
    draft_path: str | os.PathLike[str] | None,
    num_speculative_tokens: int,
    *,
    max_model_len: int = 2048,
    **run: Any,
) -> Any:
    """A `SpecDecodeEngine` of ``kind`` proposing ``num_speculative_tokens`` tokens, default target and rollout settings but
    ``max_model_len``; ``run``: the other `EngineRun` fields (record, dtype, tensor_parallel, ...)."""
    from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.rollout.engine import EngineRun, SpecDecodeEngine

    return SpecDecodeEngine(
        EngineRun(target, kind, draft_path, **run),
        DraftConfig(num_speculative_tokens=num_speculative_tokens),
        TargetConfig(max_model_len=max_model_len),
        RolloutConfig(),
    )


def learner_configs(
    kind: str = "eagle3",
    estimator: str = "full",
    objective: str = "opd",
    lr: float = 3e-3,
    dtype: str = "float32",
    **learner: Any,
) -> tuple[Any, Any, Any, Any]:
    """(draft, loss, optim, learner) configs of a test learner: constant lr, no warm-up, fp32 unless told."""
    from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, LossConfig, OptimConfig

    return (
        DraftConfig(kind=kind),
        LossConfig(estimator=estimator, objective=objective),
        OptimConfig(lr=lr, warmup_ratio=0.0, schedule="constant", betas=[0.9, 0.95], weight_decay=0.0),
        LearnerConfig(dtype=dtype, **learner),
    )


def synth(
    rng: random.Random, num_speculative_tokens: int = 4, steps: int = 6, prompt_len: int = 5
) -> RequestRecord:
    """A consistent record built step by step, the way an engine commits tokens."""
    prompt = [rng.randrange(100) for _ in range(prompt_len)]
    resp = [rng.randrange(100)]
    rec = RequestRecord(prompt_ids=prompt, response_ids=resp, finish_reason="length")
    for v in range(steps):
        drafted = [rng.randrange(100) for _ in range(num_speculative_tokens)]
        a = rng.randint(0, num_speculative_tokens)
        rec.anchor_pos.append(len(prompt) + len(resp) - 1)
        rec.drafted.append(drafted)
        rec.accepted.append(a)
        rec.policy_version.append(v // 2)
        rec.teacher_logprob_drafted.append([-rng.random() for _ in drafted])
        resp.extend(drafted[:a] + [rng.randrange(100, 200)])
    return rec


# --------------------------------------------------------------------------------------------------
# Explicit reference computations and small models
# --------------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotary embedding of one position by its definition (half-split pairs); x is (heads, d)."""
    d = x.shape[-1]
    out = x.clone()
    for j in range(d // 2):
        ang = pos / theta ** (2 * j / d)
        a, b = x[:, j], x[:, j + d // 2]
        out[:, j] = a * math.cos(ang) - b * math.sin(ang)
        out[:, j + d // 2] = b * math.cos(ang) + a * math.sin(ang)
    return out


def small_shape(hidden: int = 32, vocab: int = 64) -> dict[str, Any]:
    """The decoder shape of the small synthetic heads (EAGLE-3, DFlash) that the model tests check against
    explicit loops: 4 query / 2 key-value heads of 16, rope theta 100."""
    return {
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2 * hidden,
        "vocab_size": vocab,
        "rope_theta": 100.0,
    }


@torch.no_grad()
def randomize_(model: torch.nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Large random weights on every trainable matrix, so that bugs change the outputs: drawn from the global
    RNG (``normal_``) or, with ``generator``, from it (``randn * std``)."""
    for p in model.parameters():
        if p.dim() == 2 and p.requires_grad:
            if generator is None:
                p.normal_(0, std)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def perturbed(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """A new weight version: Gaussian noise of ``scale`` times each matrix's std added to the matrices."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g)
        if v.is_floating_point() and v.dim() == 2
        else v
        for k, v in state.items()
    }


def tiny_lm(vocab: int, seed: int, hidden: int = 32, layers: int = 2) -> Any:
    """A random Llama with sharper distributions than the default init, so drafts are sometimes right."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m


@torch.no_grad()
def target_pass(target: Any, seqs: Sequence[list[int]], prompt_lens: Sequence[int]) -> dict[str, Any]:
    """Right-padded ids/mask, response loss mask, every HF hidden state and the logits of the target."""
    from draft_opd_ray.drafts.drafter import right_pad

    ids, mask = right_pad(seqs)
    loss_mask = torch.zeros_like(mask)
    for b, (s, p) in enumerate(zip(seqs, prompt_lens)):
        loss_mask[b, p : len(s)] = 1
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return {
        "ids": ids,
        "mask": mask,
        "loss_mask": loss_mask,
        "hidden": out.hidden_states,
        "logits": out.logits,
    }


def _fit(draft: Any, steps: int, lr: float, loss: Callable[[], torch.Tensor]) -> Any:
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    draft.train()
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return draft.eval()


def fit_eagle3(draft: Any, batch: dict[str, Any], steps: int, lr: float) -> Any:
    """An EAGLE-3 head fitted for a few TTT steps to the target's pass (so that it accepts sometimes)."""
    from draft_opd_ray.drafts.eagle3.model import eagle3_ttt_loss

    feats = torch.cat([batch["hidden"][i] for i in draft.hidden_state_indices], dim=-1)
    ids, logits, loss_mask, mask = batch["ids"], batch["logits"], batch["loss_mask"], batch["mask"]
    return _fit(
        draft,
        steps,
        lr,
        lambda: eagle3_ttt_loss(draft, ids, feats, logits, loss_mask, 3, attention_mask=mask)[0],
    )


def fit_dflash(draft: Any, batch: dict[str, Any], steps: int, lr: float, anchors: int) -> Any:
    """A DFlash drafter fitted for a few steps of its SFT loss at random anchors of the target's answers."""
    from draft_opd_ray.drafts.dflash.recipe import dflash_sft_loss, sample_anchors

    feats = torch.cat([batch["hidden"][i] for i in draft.hidden_state_indices], dim=-1)
    g = torch.Generator().manual_seed(0)

    def loss() -> torch.Tensor:
        pos, valid = sample_anchors(batch["loss_mask"], anchors, g)
        return dflash_sft_loss(
            draft,
            batch["ids"],
            feats,
            pos,
            anchor_valid=valid,
            loss_mask=batch["loss_mask"],
            attention_mask=batch["mask"],
        )[0]

    return _fit(draft, steps, lr, loss)


def target_features(target: Any, seq: list[int], indices: Sequence[int]) -> torch.Tensor:
    """(1, T, A*H): the HF hidden states ``indices`` of one sequence, concatenated."""
    hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in indices], dim=-1)


@torch.no_grad()
def greedy_spec_decode(
    target: Any,
    propose: Callable[[list[int]], list[int]],
    prompt: list[int],
    max_tokens: int,
    num_speculative_tokens: int,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one request, step by step: ``propose(seq)`` drafts
    ``num_speculative_tokens`` ids after the committed ``seq``, the target verifies them. Returns (output ids,
    accepted drafted tokens per step)."""
    seq = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    accepted: list[int] = []
    while len(seq) - len(prompt) < max_tokens:
        block = propose(seq)
        greedy = target(torch.tensor([seq + block])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        a = 0
        while a < num_speculative_tokens and block[a] == greedy[a]:
            a += 1
        accepted.append(a)
        seq += block[:a] + [greedy[a]]
    return seq[len(prompt) : len(prompt) + max_tokens], accepted


def chat_prompt_ids(target: str | os.PathLike[str], questions: Sequence[str]) -> list[list[int]]:
    """Token ids of one-turn chats with the target's chat template (generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]


def save_checked_against_its_target(
    save: Callable[..., Any], load: Callable[..., Any], model: Any, folder: Path, target: Path
) -> Path:
    """Saving or loading a head against a wider target (hidden 96, not the tiny target's 64) fails naming both
    sizes; saving against its own target writes ``folder``."""
    import pytest

    from draft_opd_ray.errors import ModelError
    from draft_opd_ray.models.tiny import build_tiny_target

    other = build_tiny_target(folder.parent / "wide", tokenizer_from=target, hidden=96, heads=3, kv_heads=1)
    with pytest.raises(ModelError, match="hidden_size 64 != target hidden_size 96"):
        save(model, folder, other)
    save(model, folder, target)
    with pytest.raises(ModelError, match="hidden_size 64 != target hidden_size 96"):
        load(folder, other)
    return folder


def write_fake_model(
    folder: Path, *, config: bool = True, weights: bool = True, tokenizer: bool = True
) -> Path:
    """A model folder of placeholder files (config.json, weights, tokenizer) for the folder checks."""
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        cfg = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 16}
        (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``folder/config.json`` after ``edit`` changed it in place."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


# --------------------------------------------------------------------------------------------------
# Processes and engines
# --------------------------------------------------------------------------------------------------


def short_opd_run(target: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """Overrides of a short opd-only run on a tiny target (4 prompts a round, 24 new tokens, a checkpoint every 2
    steps) in ``run_dir``; ``extra`` overrides follow."""
    return [
        "stages=[opd]",
        f"target.path={target}",
        "draft.aux_layer_ids=[0,1,2]",
        "rollout.prompts_per_round=4",
        "rollout.max_new_tokens=24",
        "data.train.max_prompts=16",
        f"opd.steps={steps}",
        "opd.checkpoint_every=2",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def run_main(*overrides: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m draft_opd_ray.main <overrides>`` from the repository root; ``env`` adds variables."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-m", "draft_opd_ray.main", *overrides],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True)
class BadInput:
    """A command line main must refuse: its overrides (placeholders filled by `fill_names`), part of the one error
    line, and whether the refusal is also checked as a dry run (``dry_run=true`` added)."""

    overrides: tuple[str, ...]
    fragment: str
    dry: bool = True


def fill_names(text: str, files: dict[str, Path]) -> str:
    """``text`` with each placeholder name of ``files`` (longest first) replaced by its path."""
    for name in sorted(files, key=len, reverse=True):
        text = text.replace(name, str(files[name]))
    return text


def assert_refused(case: BadInput, files: dict[str, Path], run_dir: Path, seconds: float) -> None:
    """``case`` through main: exit 2 within ``seconds``, one `error:` line holding its fragment, no traceback, no run
    dir at ``run_dir`` (a resume's is its own), and nothing written into the folders of ``files``."""
    overrides = [fill_names(o, files) for o in case.overrides]
    resuming = any(o.startswith("resume=") for o in overrides)
    extra = [] if resuming else [f"hydra.run.dir={run_dir}"]
    before = {p: sorted(x.name for x in p.rglob("*")) for p in files.values() if p.is_dir()}
    t0 = time.monotonic()
    r = run_main(*overrides, *extra, *(["dry_run=true"] if case.dry else []), HYDRA_FULL_ERROR="0")
    took = time.monotonic() - t0
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert err.startswith("error: ") and "\n" not in err, err
    assert fill_names(case.fragment, files) in err, err
    assert "Traceback" not in r.stderr + r.stdout
    assert took < seconds, took
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
    after = {p: sorted(x.name for x in p.rglob("*")) for p in files.values() if p.is_dir()}
    assert after == before  # nothing written into the folders it was pointed at (a resume's run dir included)


@contextlib.contextmanager
def vllm_llm(path: str | os.PathLike[str], *, max_model_len: int, **kwargs: Any) -> Iterator[Any]:
    """A vLLM CPU engine (fp32, eager, seed 0, 1 GB KV cache) for ``path``, shut down on exit."""
    import pytest

    pytest.importorskip("vllm")
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(
            str(path), dtype="float32", max_model_len=max_model_len, enforce_eager=True, seed=0, **kwargs
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def anchor_subsets(item: ReplayItem) -> list[ReplayItem]:
    """Four sequences of different sizes from one replay item (anchor subsets of the same answer)."""
    picks = [[0, 1], [2], [3, 4], [0, 1, 2, 3, 4]]
    return [
        ReplayItem(
            item.input_ids,
            [item.anchor_pos[i] for i in p],
            [item.drafted[i] for i in p],
            [item.accepted[i] for i in p],
            0,
        )
        for p in picks
    ]


# ------------------------------------------------------------------------------------ HTTP servers (vLLM's, ours)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float, log: Path | None = None) -> None:
    """Until ``url``/health answers 200; fails early when ``proc`` exits (with the end of ``log``)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise AssertionError(f"server exited with {proc.returncode}\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"server at {url} not healthy after {timeout} s")


def prom_counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in a `/metrics` page."""
    import re

    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, flags=re.M))


class RefitEngine:
    """Stands in for the server's `AsyncLLM` in `Refitter.refit`: loads the weights file a worker would, answers
    `draft_fingerprints` from what it holds, except that the versions in ``corrupt`` come back with one tensor off
    (a load that did not take)."""

    def __init__(self, corrupt: set[int]) -> None:
        import types

        self.corrupt, self.held, self.version, self.loads = corrupt, {}, 0, []
        spec = types.SimpleNamespace(
            draft_parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
            draft_model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 2),
        )
        self.vllm_config = types.SimpleNamespace(speculative_config=spec)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        from safetensors.torch import load_file

        from draft_opd_ray.sync.refit import tensor_fingerprint

        if method == "load_draft_weights":
            self.held, self.version = load_file(args[0]), int(args[1])
            self.loads.append(self.version)
            return [len(self.held)]
        assert method == "draft_fingerprints"
        tensors = {n: list(tensor_fingerprint(t)) for n, t in self.held.items()}
        if self.version in self.corrupt:
            name = sorted(tensors)[0]
            tensors[name] = [tensors[name][0] + 1, tensors[name][1]]
        return [{"version": self.version, "dtype": "float32", "tensors": tensors}]

    async def reset_prefix_cache(self) -> bool:
        return True


def greedy_and_head(
    target: Path, prompts: Sequence[str], max_tokens: int, out: Path
) -> tuple[list[list[int]], list[list[int]], Path]:
    """The prompts' ids, their plain greedy answers from transformers (``max_tokens`` each), and an EAGLE-3 head for
    ``target`` saved in ``out``: a draft vocabulary of the ids those answers use (+1) and random weights, so that
    some of its proposals are accepted and some not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    tok = AutoTokenizer.from_pretrained(str(target))
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        plain = [
            hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p) :].tolist()
            for p in ids
        ]
    counts = torch.zeros(hf.config.vocab_size)
    for answer in plain:
        counts[answer] += 1
    draft = init_eagle3(target, draft_vocab_size=int((counts > 0).sum()) + 1, token_counts=counts)
    randomize_(draft, 0.3, torch.Generator().manual_seed(4))
    return ids, plain, save_eagle3(draft, out, target)


@contextlib.contextmanager
def stock_vllm_server(target: Path, folder: Path, k: int, log: Path) -> Iterator[str]:
    """Stock vLLM's OpenAI server on ``target`` with the EAGLE-3 ``folder`` (K = ``k``), started with the line a run
    prints (`eval/summary.serve_command`) plus the flags of a CPU box and a port of its own; yields its URL once it
    is healthy, and stops it after."""
    import shlex

    from draft_opd_ray.eval.summary import serve_command

    report = {
        "target": str(target),
        "speculative_config": {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k},
    }
    port = free_port()
    cmd = shlex.split(serve_command(report)) + [
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512"),
        *("--enforce-eager", "--seed", "0"),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=400, log=log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
