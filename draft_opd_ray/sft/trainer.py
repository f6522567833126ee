"""EAGLE-3 SFT with training-time test (TTT) through a DeepSpeed engine: the Draft-OPD warm start.

Reads top to bottom: ``run_sft`` = set up (draft vocabulary, head initialised from the target, feature source,
DeepSpeed engine, resume) -> train under a wall-clock budget (AdamW, warm-up + cosine over the budget, loss
sum_i decay^i * soft-CE of unrolled step i against the target's top-k distribution) -> export checkpoints.
The unrolled steps run only from the rows that are scored (response rows and the few prompt rows just before
them): the same computation as Draft-OPD's student side, teacher-forced on the sequence's own tokens.

Checkpoints: ``<run_dir>/checkpoints/sft/step_<n>/`` holds ``draft/`` (vLLM-loadable, :func:`save_eagle3`),
``deepspeed/`` (engine + optimizer state) and ``training_state.pt`` (step, elapsed time, data position,
FLOPs); it is written to a temporary folder and renamed, then ``checkpoints/sft/latest`` (a text file holding
``step_<n>``) is replaced. ``resume=True`` continues from ``latest``. Metrics go to ``metrics.jsonl`` (one JSON
object per step: stage, step, time, loss, loss_i, acc_i, lr, tokens_per_s, flops_draft, flops_target).

Initialisation (``init="target"``): the head starts as a slice of the target, so that before any training its
step-0 output equals the target's own hidden state after layer ``L_hi`` (the high aux layer):
``fc`` selects the high aux feature (identity block, zeros elsewhere); the decoder layer is target layer
``L_hi`` (its q/k/v weights on the feature half of the 2H input, zeros on the token-embedding half,
``hidden_norm`` = that layer's input norm); ``norm`` = the target's final norm and ``lm_head`` = the target's
LM head rows of the draft vocabulary. The feature keeps the target's own scale, so the final norm's weights see
the inputs they were trained for (copying them into a randomly initialised head is what made the calibration
run start at loss ~32). The LM head stays frozen (trained: ``train_lm_head=True``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, OptimConfig, SFTConfig
from draft_opd_ray.flops import target_forward_flops
from draft_opd_ray.models.eagle3 import Eagle3Draft, save_eagle3
from draft_opd_ray.models.standalone import read_target_tensors
from draft_opd_ray.models.target import read_target_info
from draft_opd_ray.sft.data import read_trajectories
from draft_opd_ray.sft.features import FeatureCache, OnTheFlyFeatures, SeqFeatures
from draft_opd_ray.sft.recipes import build_recipe

log = logging.getLogger(__name__)

MetricsCallback = Callable[[dict[str, Any]], None]


# --------------------------------------------------------------------------------------------------
# Initialisation from the target
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def init_from_target(
    model: Eagle3Draft, target: str | os.PathLike[str], layer: int | None = None, logit_scale: float = 0.3
) -> None:
    """Make the head a slice of the target (module docstring). ``layer`` defaults to the high aux layer.

    ``logit_scale`` multiplies the copied final-norm weights (so the logits): the untrained slice predicts the
    token the row already consumes (x_{t+1}) with the target's confidence while the label is x_{t+2}; at full
    scale that costs ~15 nats per step (SmolLM2), at 0.3 it is 6.8 (random init: 9.2 = log Vd)."""
    c = model.config
    L = c.aux_layer_ids[-1] if layer is None else layer
    p = f"model.layers.{L}."
    names = [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")]
    names += [
        p + n
        for n in ("self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    names += ["model.norm.weight", "lm_head.weight"]
    w = read_target_tensors(target, names)
    m, H = model.midlayer, c.hidden_size
    for proj in ("q_proj", "k_proj", "v_proj"):
        dst = getattr(m.self_attn, proj).weight  # (out, 2H): [embedding half | feature half]
        dst.zero_()
        dst[:, H:] = w[p + f"self_attn.{proj}.weight"]
    m.self_attn.o_proj.weight.copy_(w[p + "self_attn.o_proj.weight"])
    for n in ("gate_proj", "up_proj", "down_proj"):
        getattr(m.mlp, n).weight.copy_(w[p + f"mlp.{n}.weight"])
    m.hidden_norm.weight.copy_(w[p + "input_layernorm.weight"])
    m.post_attention_layernorm.weight.copy_(w[p + "post_attention_layernorm.weight"])
    m.input_layernorm.weight.fill_(1.0)
    model.fc.weight.zero_()
    model.fc.weight[:, (len(c.aux_layer_ids) - 1) * H :] = torch.eye(H)
    model.norm.weight.copy_(w["model.norm.weight"] * logit_scale)
    model.lm_head.weight.copy_(w["lm_head.weight"][model.draft_ids_in_target])


# --------------------------------------------------------------------------------------------------
# Batches and loss
# --------------------------------------------------------------------------------------------------


def length_batches(lengths: Sequence[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequences grouped by similar length into batches of <= batch_tokens padded tokens, in shuffled order."""
    rng = random.Random(seed)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(items: Sequence[SeqFeatures], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Right-padded batch. loss_mask marks teacher positions p >= prompt_len - 1 (predicting response tokens)."""
    B, T = len(items), max(int(s.input_ids.numel()) for s in items)
    k, AH = items[0].topk_ids.shape[-1], items[0].features.shape[-1]
    b = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.zeros(B, T, dtype=torch.bool),
        "features": torch.zeros(B, T, AH, dtype=dtype),
        "topk_ids": torch.zeros(B, T, k, dtype=torch.long),
        "topk_p": torch.zeros(B, T, k),
        "top1": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
    }
    for j, s in enumerate(items):
        n = int(s.input_ids.numel())
        b["input_ids"][j, :n] = s.input_ids
        b["attention_mask"][j, :n] = True
        b["features"][j, :n] = s.features.to(dtype)
        b["topk_ids"][j, :n], b["topk_p"][j, :n], b["top1"][j, :n] = s.topk_ids, s.topk_p, s.top1
        b["loss_mask"][j, max(0, s.prompt_len - 1) : n] = True
    return b


def ttt_anchors(loss_mask: torch.Tensor, ttt_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the TTT loss needs, as anchors: teacher positions p (1 <= p < T) at which some unrolled step is
    scored, i.e. ``loss_mask`` holds somewhere in p..p+ttt_steps-1. Returns anchor_pos (B, N) right-padded
    with 1 and valid (B, N). Prompt rows further from the response than that only serve as keys."""
    B, T = loss_mask.shape
    need = loss_mask.clone()
    for i in range(1, ttt_steps):
        need[:, : T - i] |= loss_mask[:, i:]
    need[:, 0] = False
    counts = need.sum(1)
    N = max(1, int(counts.max()))
    pos = torch.arange(T).expand(B, T)
    # needed positions first (stable), then the rest; the rest become padding
    order = torch.sort((~need).to(torch.int8), dim=1, stable=True).indices[:, :N]
    valid = torch.arange(N)[None] < counts[:, None]
    anchor = torch.where(valid, pos.gather(1, order), torch.ones_like(order))
    return anchor, valid


def ttt_topk_loss(
    model: Eagle3Draft, batch: dict[str, torch.Tensor], ttt_steps: int, decay: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_i decay^i * soft CE of TTT step i against the target's top-k draft-vocabulary distribution.

    TTT is Draft-OPD's student forward with the sequence's own next tokens as the block: from every anchor p
    (the rows :func:`ttt_anchors` keeps) the head unrolls ``ttt_steps`` steps teacher-forced on x_{p+1}..; step
    i predicts x_{p+i+1} and is scored at teacher position p+i. This is the full-sequence TTT of
    ``Eagle3Draft.forward`` restricted to the rows whose loss is counted (same value; the steps after the first
    and the LM head skip prompt rows, ~1/3 of the work on chat data). Metrics ``loss_<i>`` and ``acc_<i>``
    (draft argmax == target argmax over the full vocabulary)."""
    ids_t, mask = batch["input_ids"], batch["loss_mask"]
    B, T = ids_t.shape
    anchor, valid = ttt_anchors(mask, ttt_steps)
    K = ttt_steps
    # the block y_1..y_K = x_{p+1}..x_{p+K} (step j consumes y_j; clamped: positions past the end are not scored)
    fed_pos = (anchor[..., None] + torch.arange(1, K + 1)).clamp_max(T - 1)  # (B, N, K)
    fed = ids_t.gather(1, fed_pos.flatten(1)).view(fed_pos.shape)
    hidden = model.block_hidden(
        ids_t, batch["features"], anchor, fed, batch["attention_mask"]
    )  # (B, N, K, H)
    draft_ids = model.draft_ids_in_target
    total = torch.zeros(())
    metrics: dict[str, float] = {}
    for i in range(K):
        tp = anchor + i  # teacher position of step i
        m = (valid & (tp < T) & mask.gather(1, tp.clamp_max(T - 1))).float()
        if not bool(m.any()):
            break
        tpc = tp.clamp_max(T - 1)
        logq = torch.log_softmax(model.lm_head(hidden[:, :, i]).float(), dim=-1)  # (B, N, Vd)
        k_ids = batch["topk_ids"].gather(1, tpc[..., None].expand(-1, -1, batch["topk_ids"].shape[-1]))
        k_p = batch["topk_p"].gather(1, tpc[..., None].expand(-1, -1, batch["topk_p"].shape[-1]))
        count = m.sum().clamp_min(1.0)
        loss_i = (-(k_p * logq.gather(-1, k_ids)).sum(-1) * m).sum() / count
        total = total + decay**i * loss_i
        with torch.no_grad():
            hit = (draft_ids[logq.argmax(-1)] == batch["top1"].gather(1, tpc)).float()
            metrics[f"loss_{i}"] = float(loss_i)
            metrics[f"acc_{i}"] = float((hit * m).sum() / count)
    return total, metrics


# --------------------------------------------------------------------------------------------------
# DeepSpeed, schedule, checkpoints
# --------------------------------------------------------------------------------------------------


def init_process_group() -> None:
    """One CPU process: a gloo group of size 1 (DeepSpeed needs torch.distributed)."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="gloo")


def lr_factor(progress: float, warmup: float, schedule: str, floor: float = 0.1) -> float:
    """Warm-up then cosine to ``floor`` x peak (or constant), as a function of training progress in [0, 1]."""
    if warmup > 0 and progress < warmup:
        return max(progress / warmup, 1e-3)
    if schedule == "constant":
        return 1.0
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


def schedule_progress(
    step: int, total_steps: int, used_s: float, budget_s: float, train_start_s: float
) -> float:
    """Where the lr schedule is, in [0, 1]: the larger of the step fraction and the fraction of the *training*
    part of the time budget used (the budget seconds the feature cache took before training are not the
    schedule's: a cold run whose cache took 28% of the budget would otherwise skip its warm-up)."""
    train_frac = (used_s - train_start_s) / max(1e-9, budget_s - train_start_s)
    return min(1.0, max(step / max(1, total_steps), train_frac))


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_s: float = 0.0  # seconds spent in training steps (excludes feature building and checkpoints)
    budget_s_used: float = 0.0  # wall clock charged to the budget (features + training)
    train_start_s: float = 0.0  # budget seconds already used when training began (the feature cache)
    tokens: int = 0  # trained (loss) tokens
    flops_draft: float = 0.0
    flops_target: float = 0.0
    checkpoints: list[str] = field(default_factory=list)


def _latest(root: Path) -> Path | None:
    f = root / "latest"
    if not f.is_file():
        return None
    d = root / f.read_text().strip()
    return d if (d / "training_state.pt").is_file() else None


def save_checkpoint(
    engine: Any,
    state: TrainState,
    root: Path,
    target: str | os.PathLike[str],
    save_draft: Callable[[Any, Path, str | os.PathLike[str]], Path] | None = None,
) -> Path:
    """Atomic checkpoint step_<n>/{draft/, deepspeed/, training_state.pt}, then the ``latest`` pointer.
    ``save_draft`` exports the draft folder (default: an EAGLE-3 head)."""
    name = f"step_{state.step}"
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    export = copy.deepcopy(engine.module).float()
    (save_draft or save_eagle3)(export, tmp / "draft", target)
    engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    state.checkpoints = [*state.checkpoints, name]
    torch.save(asdict(state), tmp / "training_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    ptr = root / ".latest.tmp"
    ptr.write_text(name + "\n")
    os.replace(ptr, root / "latest")
    return final / "draft"


def _jsonl_writer(path: Path) -> MetricsCallback:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(m: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(m) + "\n")

    return write


# --------------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------------


def draft_vocab_counts(
    seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], vocab_size: int
) -> torch.Tensor:
    """(V,) counts of response tokens (what the draft will have to propose)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s, p in zip(seqs, prompt_lens):
        counts += torch.bincount(torch.tensor(list(s[p:]), dtype=torch.long), minlength=vocab_size)
    return counts


def run_sft(
    target: str | os.PathLike[str],
    trajectories: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    sft: SFTConfig,
    draft: DraftConfig,
    optim: OptimConfig,
    learner: LearnerConfig,
    cache_dir: str | os.PathLike[str],
    init: str = "target",
    feature_mode: str = "cache",
    topk: int = 16,
    max_seq_len: int = 1024,
    checkpoint_minutes: Sequence[float] = (),
    max_steps: int | None = None,
    resume: bool = False,
    seed: int = 0,
    metrics: MetricsCallback | None = None,
    progress: bool = True,
    start_from: str | os.PathLike[str] | None = None,
    max_flops: float | None = None,
) -> Path:
    """Train an EAGLE-3 head on target trajectories; returns the final vLLM-loadable draft folder.

    Uses sft.{epochs, batch_tokens, lr, time_budget_min}, draft.{aux_layer_ids, draft_vocab_size, ttt_steps,
    ttt_decay}, optim.{warmup_ratio, schedule, weight_decay, betas, grad_clip}, learner.{zero_stage, dtype}.
    ``checkpoint_minutes``: extra exports at these budget minutes (a tau-vs-time curve); the last one is at the
    end. ``max_steps`` caps steps (tests). The budget clock covers feature building and training.
    ``start_from``: continue from an exported draft (its weights and draft vocabulary; fresh optimizer) instead of
    a new head. ``max_flops``: stop once draft + target FLOPs reach it; with ``start_from`` the target forward of
    every batch is charged as if its features were computed on the fly (the matched-FLOPs baseline, P1).
    """
    import deepspeed

    t0 = time.monotonic()
    target, run_dir = Path(target), Path(run_dir)
    root = run_dir / "checkpoints" / "sft"
    emit = metrics or _jsonl_writer(run_dir / "metrics.jsonl")
    info = read_target_info(target)
    budget_s = sft.time_budget_min * 60
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[learner.dtype]

    # ---- data and draft vocabulary
    rows = read_trajectories(trajectories)
    seqs = [(r.prompt_ids + r.response_ids)[:max_seq_len] for r in rows if r.response_ids]
    plens = [min(len(r.prompt_ids), max_seq_len) for r in rows if r.response_ids]
    recipe = build_recipe(
        target, draft, seqs=seqs, prompt_lens=plens, init=init, start_from=start_from, seed=seed
    )
    model = recipe.model
    aux, draft_ids = recipe.feature_ids, recipe.label_ids

    # ---- feature source
    source: FeatureCache | OnTheFlyFeatures
    if feature_mode == "cache":
        key = FeatureCache.key(Path(trajectories), aux, draft_ids, topk, learner.dtype)
        source = FeatureCache.build(
            target,
            seqs,
            plens,
            Path(cache_dir) / "sft_features" / f"{key}.safetensors",
            aux,
            draft_ids,
            topk=topk,
            dtype=dtype if dtype != torch.float32 else torch.float32,
        )
    elif feature_mode == "on_the_fly":
        source = OnTheFlyFeatures(target, seqs, plens, aux, draft_ids, topk)
    else:
        raise ValueError(f"feature_mode must be 'cache' or 'on_the_fly', got {feature_mode!r}")
    feature_s = time.monotonic() - t0

    # ---- engine
    init_process_group()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=sft.lr, betas=(optim.betas[0], optim.betas[1]), weight_decay=optim.weight_decay
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "bf16": {"enabled": learner.dtype == "bfloat16"},
        "fp16": {"enabled": learner.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    module = engine.module

    state = TrainState()
    last = _latest(root) if resume else None
    if last is not None:
        engine.load_checkpoint(str(last / "deepspeed"), tag="state")
        state = TrainState(**torch.load(last / "training_state.pt", weights_only=False))
        log.info("resumed from %s (step %d)", last, state.step)
    else:
        state.budget_s_used = state.train_start_s = feature_s
        if feature_mode == "cache" and start_from is None:
            state.flops_target = sum(target_forward_flops(info, 1, len(s)) for s in seqs)
    start_used = state.budget_s_used
    wall0 = time.monotonic()
    pending = sorted(m * 60 for m in checkpoint_minutes if m * 60 > state.budget_s_used)

    lengths = [source.length(i) for i in range(len(source))]
    steps_per_epoch = len(length_batches(lengths, sft.batch_tokens, seed))
    total_steps = (
        steps_per_epoch * sft.epochs if max_steps is None else min(max_steps, steps_per_epoch * sft.epochs)
    )
    bar = tqdm(total=total_steps, initial=state.step, desc="sft", disable=not progress)
    final: Path | None = None
    while state.epoch < sft.epochs:
        batches = length_batches(lengths, sft.batch_tokens, seed + state.epoch)
        while state.batch_in_epoch < len(batches):
            used = start_used + (time.monotonic() - wall0)
            if used >= budget_s or (max_steps is not None and state.step >= max_steps):
                break
            if max_flops is not None and state.flops_draft + state.flops_target >= max_flops:
                break
            progress_frac = schedule_progress(state.step, total_steps, used, budget_s, state.train_start_s)
            lr = sft.lr * lr_factor(progress_frac, optim.warmup_ratio, optim.schedule)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = batches[state.batch_in_epoch]
            tic = time.monotonic()
            items = (
                source.get_many(idx) if isinstance(source, OnTheFlyFeatures) else [source.get(i) for i in idx]
            )
            batch = collate(items, dtype)
            loss, m = recipe.loss(module, batch)
            engine.backward(loss)
            engine.step()
            dt = time.monotonic() - tic
            B, T = batch["input_ids"].shape
            ntok = int(batch["loss_mask"].sum())
            state.step += 1
            state.batch_in_epoch += 1
            state.train_s += dt
            state.tokens += ntok
            state.flops_draft += recipe.flops(batch)
            if isinstance(source, OnTheFlyFeatures) or start_from is not None:
                state.flops_target += target_forward_flops(info, B, T)
            state.budget_s_used = start_used + (time.monotonic() - wall0)
            rec = {
                "stage": "sft",
                "step": state.step,
                "time": time.time(),
                "loss": float(loss.detach()),
                **m,
                "lr": lr,
            }
            rec |= {"tokens_per_s": ntok / dt, "padded_tokens_per_s": B * T / dt, "tokens": state.tokens}
            rec |= {"epoch": state.epoch, "budget_min": state.budget_s_used / 60}
            rec |= {"flops_draft": state.flops_draft, "flops_target": state.flops_target}
            emit(rec)
            bar.update(1)
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}",
                acc=f"{m.get('acc_0', m.get('acc_1', 0)):.2f}",
                tok_s=f"{ntok / dt:.0f}",
            )
            if pending and state.budget_s_used >= pending[0]:
                pending = [p for p in pending if p > state.budget_s_used]
                final = save_checkpoint(engine, state, root, target, recipe.save)
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
        break
    bar.close()
    if final is None or state.checkpoints[-1] != f"step_{state.step}":
        final = save_checkpoint(engine, state, root, target, recipe.save)
    emit(
        {
            "stage": "sft",
            "step": state.step,
            "time": time.time(),
            "done": True,
            "feature_s": feature_s,
            "train_s": state.train_s,
            "budget_min": state.budget_s_used / 60,
            "tokens": state.tokens,
        }
    )
    return final
