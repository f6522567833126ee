"""The SFT recipes of the draft kinds; `trainer.run_sft` runs any of them.

A recipe is the draft to train plus what the shared loop needs from it (the `recipe` entry of
`models/kinds.py` names each kind's builder):

    kind        features (HF hidden_states)   soft labels over      loss
    eagle3      aux layer inputs               the draft vocabulary  TTT: sum_i 0.8^i soft CE of unrolled step i
    standalone  none                           the whole vocabulary  distillation: soft CE of every response
                                                                     position against the target's top-k
    dflash      target layer outputs           (unused)              random-anchor block CE, exp(-(k-1)/gamma)

The cached features and top-k labels come from one target forward per trajectory (`sft/features.py`); the
recipe names which hidden states and which vocabulary. `save` writes the folder vLLM serves. The EAGLE-3 TTT
loss runs only from the rows that are scored (response rows and the few prompt rows just before them): the same
computation as Draft-OPD's student side, teacher-forced on the sequence's own tokens. Which weights train is
`optim.trainable_parameters`, shared with the Draft-OPD learner (the EAGLE-3 LM head only with
`draft.train_lm_head`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.flops import dflash_forward_flops, model_config_info, target_forward_flops
from draft_opd_ray.models.dflash import DFlashDraft, init_dflash, load_dflash, save_dflash
from draft_opd_ray.models.eagle3 import Eagle3Draft, init_eagle3, load_eagle3, save_eagle3
from draft_opd_ray.models.kinds import draft_kind
from draft_opd_ray.models.standalone import build_standalone_from_target, load_standalone, save_standalone
from draft_opd_ray.models.target import read_target_info, read_target_tensors

Reduce = Callable[[torch.Tensor], torch.Tensor]


class LossFn(Protocol):
    """A recipe's loss on a collated batch: (loss, metrics). ``reduce`` (data-parallel ranks, each holding a
    share of the global batch): sums a tensor of loss denominators over the ranks, so that every rank normalises
    by the global batch's counts; then each rank's loss and metrics are its share of the global batch's and sum
    over the ranks to what one rank computes on the whole batch. None: this batch is the whole batch."""

    def __call__(
        self, model: nn.Module, batch: dict[str, torch.Tensor], *, reduce: Reduce | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class RecipeInputs:
    """What every recipe builder gets besides the target and the draft config."""

    seqs: Sequence[Sequence[int]]  # prompt + response token ids of each trajectory
    prompt_lens: Sequence[int]
    init: str = "target"  # EAGLE-3: "target" (a slice of the target) or "random"
    start_from: str | os.PathLike[str] | None = None  # an exported draft to continue from
    seed: int = 0


@dataclass
class Recipe:
    kind: str
    model: nn.Module
    feature_ids: tuple[int, ...]  # HF hidden_states indices concatenated into the cached features
    label_ids: torch.Tensor  # (Vd,) target ids the soft labels are over
    loss: LossFn
    flops: Callable[[dict[str, torch.Tensor]], float]  # training FLOPs of one step on this collated batch
    save: Callable[[nn.Module, Path, str | os.PathLike[str]], Path]


def _bt(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    B, T = batch["input_ids"].shape
    return int(B), int(T)


# --------------------------------------------------------------------------------------------------
# EAGLE-3: head initialised from the target, training-time test (TTT)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def init_from_target(
    model: Eagle3Draft, target: str | os.PathLike[str], layer: int | None = None, logit_scale: float = 0.3
) -> None:
    """Make the head a slice of the target, so that before any training its step-0 output equals the target's
    own hidden state after layer ``L_hi`` (``layer``, default the high aux layer): ``fc`` selects the high aux
    feature (identity block, zeros elsewhere); the decoder layer is target layer ``L_hi`` (its q/k/v weights on
    the feature half of the 2H input, zeros on the token-embedding half, ``hidden_norm`` = that layer's input
    norm); ``norm`` = the target's final norm and ``lm_head`` = the target's LM head rows of the draft
    vocabulary. The feature keeps the target's own scale, so the final norm's weights see the inputs they were
    trained for (copying them into a randomly initialised head made the initial loss worse than uniform).

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


def draft_vocab_counts(
    seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], vocab_size: int
) -> torch.Tensor:
    """(V,) counts of response tokens (what the draft will have to propose)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s, p in zip(seqs, prompt_lens):
        counts += torch.bincount(torch.tensor(list(s[p:]), dtype=torch.long), minlength=vocab_size)
    return counts


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
    pos = torch.arange(T, device=loss_mask.device).expand(B, T)
    # needed positions first (stable), then the rest; the rest become padding
    order = torch.sort((~need).to(torch.int8), dim=1, stable=True).indices[:, :N]
    valid = torch.arange(N, device=loss_mask.device)[None] < counts[:, None]
    anchor = torch.where(valid, pos.gather(1, order), torch.ones_like(order))
    return anchor, valid


def ttt_topk_loss(
    model: Eagle3Draft,
    batch: dict[str, torch.Tensor],
    ttt_steps: int,
    decay: float,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_i decay^i * soft CE of TTT step i against the target's top-k draft-vocabulary distribution.

    TTT is Draft-OPD's student forward with the sequence's own next tokens as the block: from every anchor p
    (the rows :func:`ttt_anchors` keeps) the head unrolls ``ttt_steps`` steps teacher-forced on x_{p+1}..; step
    i predicts x_{p+i+1} and is scored at teacher position p+i. This is the full-sequence TTT of
    ``Eagle3Draft.forward`` restricted to the rows whose loss is counted (same value; the steps after the first
    and the LM head skip prompt rows, ~1/3 of the work on chat data). Metrics ``loss_<i>`` and ``acc_<i>``
    (draft argmax == target argmax over the full vocabulary). ``reduce``: see :class:`LossFn`; the per-step
    counts are reduced once, before the unrolled steps, so every rank runs the same steps."""
    ids_t, mask = batch["input_ids"], batch["loss_mask"]
    B, T = ids_t.shape
    anchor, valid = ttt_anchors(mask, ttt_steps)
    K = ttt_steps
    steps = torch.arange(K + 1, device=ids_t.device)
    tp_all = anchor[..., None] + steps[:K]  # (B, N, K) teacher position of each step
    scored = valid[..., None] & (tp_all < T)
    scored &= mask.gather(1, tp_all.clamp_max(T - 1).flatten(1)).view_as(tp_all)
    counts = scored.float().sum((0, 1))  # (K,) scored rows of each step
    if reduce is not None:
        counts = reduce(counts)
    # the block y_1..y_K = x_{p+1}..x_{p+K} (step j consumes y_j; clamped: positions past the end are not scored)
    fed_pos = (anchor[..., None] + steps[1:]).clamp_max(T - 1)  # (B, N, K)
    fed = ids_t.gather(1, fed_pos.flatten(1)).view(fed_pos.shape)
    hidden = model.block_hidden(
        ids_t, batch["features"], anchor, fed, batch["attention_mask"]
    )  # (B, N, K, H)
    draft_ids = model.draft_ids_in_target
    total = torch.zeros((), device=ids_t.device)
    metrics: dict[str, float] = {}
    for i in range(K):
        if not bool(counts[i] > 0):
            break
        m = scored[..., i].float()
        tpc = tp_all[..., i].clamp_max(T - 1)
        logq = torch.log_softmax(model.lm_head(hidden[:, :, i]).float(), dim=-1)  # (B, N, Vd)
        k_ids = batch["topk_ids"].gather(1, tpc[..., None].expand(-1, -1, batch["topk_ids"].shape[-1]))
        k_p = batch["topk_p"].gather(1, tpc[..., None].expand(-1, -1, batch["topk_p"].shape[-1]))
        count = counts[i].to(logq.dtype).clamp_min(1.0)
        loss_i = (-(k_p * logq.gather(-1, k_ids)).sum(-1) * m).sum() / count
        total = total + decay**i * loss_i
        with torch.no_grad():
            hit = (draft_ids[logq.argmax(-1)] == batch["top1"].gather(1, tpc)).float()
            metrics[f"loss_{i}"] = float(loss_i)
            metrics[f"acc_{i}"] = float((hit * m).sum() / count)
    return total, metrics


def _ttt_flops(c: Any, batch: dict[str, torch.Tensor], ttt_steps: int) -> float:
    """TTT as the trainer runs it (``ttt_topk_loss``): step 0 over every padded row, the other steps and the
    LM head over the padded anchor rows."""
    from draft_opd_ray.flops import eagle3_block_flops

    B, T = batch["input_ids"].shape
    n = ttt_anchors(batch["loss_mask"], ttt_steps)[0].shape[1]
    return B * eagle3_block_flops(c, T, n, ttt_steps).total


def eagle3_recipe(target: str | os.PathLike[str], draft: DraftConfig, src: RecipeInputs) -> Recipe:
    info = read_target_info(target)
    vd = min(draft.vocab_for(info.vocab_size), info.vocab_size)
    if src.start_from is not None:
        head = load_eagle3(src.start_from, target)
    else:
        counts = (
            draft_vocab_counts(src.seqs, src.prompt_lens, info.vocab_size) if vd < info.vocab_size else None
        )
        head = init_eagle3(
            target, aux_layer_ids=draft.aux_layer_ids, draft_vocab_size=vd, token_counts=counts, seed=src.seed
        )
        if src.init == "target":
            init_from_target(head, target)
        elif src.init != "random":
            raise ValueError(f"init must be 'target' or 'random', got {src.init!r}")
    return Recipe(
        "eagle3",
        head,
        tuple(head.hidden_state_indices),
        head.draft_ids_in_target.clone(),
        lambda m, b, *, reduce=None: ttt_topk_loss(
            m,  # type: ignore[arg-type]
            b,
            draft.ttt_steps,
            draft.ttt_decay,
            reduce,
        ),
        lambda b: _ttt_flops(head.config, b, draft.ttt_steps),
        lambda m, out, t: save_eagle3(m, out, t),  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------------------------------
# Standalone: a slice of the target, distilled
# --------------------------------------------------------------------------------------------------


def standalone_layer_ids(num_layers: int, target_layers: int) -> tuple[int, ...]:
    """The target layers a standalone draft starts from: the first ceil(n/2) and the last floor(n/2), i.e. the
    middle of the stack is dropped (layer skipping): the ends carry the prediction (docs/design.md, "Why the
    defaults")."""
    if not 1 <= num_layers < target_layers:
        raise ValueError(f"a standalone draft needs 1..{target_layers - 1} layers, got {num_layers}")
    head = (num_layers + 1) // 2
    return (*range(head), *range(target_layers - (num_layers - head), target_layers))


def standalone_kd_loss(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    chunk_rows: int = 512,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft CE of the draft LM's next-token distribution against the target's top-k at every loss position
    (teacher position t = the distribution of x_{t+1}). Logits are built ``chunk_rows`` rows at a time under
    activation checkpointing, so no (rows x V) tensor lives through the backward."""
    h = model.model(  # type: ignore[operator]
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(), use_cache=False
    ).last_hidden_state
    m = batch["loss_mask"]
    rows, ids, p, top1 = h[m], batch["topk_ids"][m], batch["topk_p"][m], batch["top1"][m]
    w = model.get_output_embeddings().weight  # type: ignore[operator]

    def part(hc: torch.Tensor, ic: torch.Tensor, pc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logq = torch.log_softmax((hc @ w.T).float(), dim=-1)
        return -(pc * logq.gather(-1, ic)).sum(-1), logq.argmax(-1)

    ce, arg = [], []
    for s in range(0, rows.shape[0], chunk_rows):
        c, a = checkpoint(
            part,
            rows[s : s + chunk_rows],
            ids[s : s + chunk_rows],
            p[s : s + chunk_rows],
            use_reentrant=False,
        )
        ce.append(c)
        arg.append(a)
    n = torch.tensor([float(rows.shape[0])], device=h.device)
    count = (n if reduce is None else reduce(n)).clamp_min(1.0)[0]  # the scored rows (of the global batch)
    loss = torch.cat(ce).sum() / count if ce else h.sum() * 0.0
    acc = float((torch.cat(arg) == top1).float().sum() / count) if arg else 0.0
    return loss, {"loss_0": float(loss.detach()), "acc_0": acc}


def standalone_recipe(target: str | os.PathLike[str], draft: DraftConfig, src: RecipeInputs) -> Recipe:
    info = read_target_info(target)
    if src.start_from is not None:
        lm = load_standalone(src.start_from, target)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ids = standalone_layer_ids(draft.num_layers, info.num_layers)
            lm = load_standalone(build_standalone_from_target(target, tmp, layer_ids=ids), target)
    lm.train()
    return Recipe(
        "standalone",
        lm,
        (),
        torch.arange(info.vocab_size),
        lambda m, b, *, reduce=None: standalone_kd_loss(m, b, reduce=reduce),
        lambda b: 3.0 * target_forward_flops(model_config_info(lm), *_bt(b)),
        lambda m, out, t: save_standalone(m, out, t),
    )


# --------------------------------------------------------------------------------------------------
# DFlash: random-anchor block loss
# --------------------------------------------------------------------------------------------------


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random SFT anchors: positions n >= 1 whose next token x_{n+1} is trained (loss_mask (B, L)).

    Returns anchor_pos (B, N) sorted (padded with 1) and anchor_valid (B, N) bool, N = num_anchors.
    """
    B, L = loss_mask.shape
    pos = torch.ones(B, num_anchors, dtype=torch.long)
    valid = torch.zeros(B, num_anchors, dtype=torch.bool)
    for b in range(B):
        cand = torch.nonzero(loss_mask[b, 2:].bool().cpu()).flatten() + 1  # n in [1, L-2], x_{n+1} trained
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]].sort().values
        pos[b, : pick.numel()] = pick
        valid[b, : pick.numel()] = True
    return pos.to(loss_mask.device), valid.to(loss_mask.device)


def dflash_sft_loss(
    model: DFlashDraft,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    anchor_pos: torch.Tensor,
    *,
    anchor_valid: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    gamma: float = 7.0,
    chunk_rows: int = 2048,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy of every block offset o = 1..bs-1 against the committed token x_{n+o}, weight
    exp(-(o-1)/gamma), averaged over the valid (anchor valid, n+o < L, loss_mask) positions.

    Logits are produced ``chunk_rows`` rows at a time under activation checkpointing, so the (rows x V) tensor is
    never whole. Metrics: ``loss`` and ``acc_<o>`` (top-1 accuracy per offset). ``reduce``: see
    :class:`LossFn` (the weight sum and the per-offset counts are reduced).
    """
    B, L = input_ids.shape
    bs = model.config.block_size
    hidden = model(input_ids, features, anchor_pos, attention_mask=attention_mask)[
        :, :, 1:
    ]  # (B, N, bs-1, H)
    pos = anchor_pos[..., None] + torch.arange(1, bs, device=input_ids.device)  # (B, N, bs-1)
    inside = pos < L
    flat = pos.clamp(max=L - 1).flatten(1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    keep = inside
    if loss_mask is not None:
        keep = keep & torch.gather(loss_mask.bool(), 1, flat).view_as(pos)
    if anchor_valid is not None:
        keep = keep & anchor_valid[..., None]
    decay = torch.exp(-torch.arange(bs - 1, device=input_ids.device, dtype=torch.float32) / gamma)
    w = keep.float() * decay

    def rows(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.logits(h).float()
        return F.cross_entropy(logits, y, reduction="none"), (logits.argmax(-1) == y).float()

    h_flat, y_flat = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    ce_parts, hit_parts = [], []
    for s in range(0, h_flat.shape[0], chunk_rows):
        ce, hit = checkpoint(
            rows, h_flat[s : s + chunk_rows], y_flat[s : s + chunk_rows], use_reentrant=False
        )
        ce_parts.append(ce)
        hit_parts.append(hit)
    ce_all = torch.cat(ce_parts).view_as(w)
    dens = torch.cat([w.sum()[None], keep.float().sum(dim=(0, 1))])  # (bs,) weight sum, count per offset
    if reduce is not None:
        dens = reduce(dens)
    loss = (ce_all * w).sum() / dens[0].clamp_min(1e-6)
    with torch.no_grad():
        hits = torch.cat(hit_parts).view_as(w) * keep
        counts = dens[1:].clamp_min(1)
        metrics = {"loss": float(loss)} | {
            f"acc_{o + 1}": float(v) for o, v in enumerate(hits.sum((0, 1)) / counts)
        }
    return loss, metrics


def dflash_loss(gamma: float, anchors_per_seq: int, seed: int) -> LossFn:
    """DFlash's SFT loss at random anchors in the response (:func:`dflash_sft_loss`)."""
    g = torch.Generator().manual_seed(seed)

    def loss(
        model: nn.Module, batch: dict[str, torch.Tensor], *, reduce: Reduce | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        # collate marks teacher positions p >= prompt_len - 1; DFlash trains the tokens x_{p+1}
        tokens = F.pad(batch["loss_mask"][:, :-1], (1, 0)) & batch["attention_mask"]
        pos, valid = sample_anchors(tokens, anchors_per_seq, generator=g)
        return dflash_sft_loss(
            model,  # type: ignore[arg-type]
            batch["input_ids"],
            batch["features"],
            pos,
            anchor_valid=valid,
            loss_mask=tokens,
            attention_mask=batch["attention_mask"],
            gamma=gamma,
            reduce=reduce,
        )

    return loss


def dflash_recipe(
    target: str | os.PathLike[str], draft: DraftConfig, src: RecipeInputs, anchors: int = 64
) -> Recipe:
    info = read_target_info(target)
    if src.start_from is not None:
        df = load_dflash(src.start_from, target)
    else:
        df = init_dflash(
            target,
            num_layers=draft.num_layers,
            block_size=draft.block_size,
            mask_token_id=draft.mask_token_id,
            seed=src.seed,
        )

    def flops(b: dict[str, torch.Tensor]) -> float:
        B, T = _bt(b)
        return 3.0 * B * dflash_forward_flops(df.config, T, min(anchors, T), df.config.block_size - 1)

    return Recipe(
        "dflash",
        df,
        tuple(df.hidden_state_indices),
        torch.arange(info.vocab_size),
        dflash_loss(draft.dflash_loss_gamma, anchors, src.seed),
        flops,
        lambda m, out, t: save_dflash(m, out, t),  # type: ignore[arg-type]
    )


def build_recipe(
    target: str | os.PathLike[str],
    draft: DraftConfig,
    *,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    init: str = "target",
    start_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> Recipe:
    """The draft (fresh, or ``start_from`` an exported folder) and its recipe for ``draft.kind``."""
    src = RecipeInputs(seqs, prompt_lens, init, start_from, seed)
    return draft_kind(draft.kind).recipe()(target, draft, src)  # type: ignore[no-any-return]
