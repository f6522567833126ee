"""The EAGLE-3 SFT recipe (`drafts/recipe.py`): a head initialised from the target, trained with the
training-time test (TTT: sum_i 0.8^i soft CE of unrolled step i against the target's top-k over the draft
vocabulary), run only from the rows that are scored."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.eagle3.model import Eagle3Draft, init_eagle3, load_eagle3, save_eagle3
from draft_opd_ray.drafts.recipe import Recipe, RecipeInputs, Reduce
from draft_opd_ray.models.target import read_target_info, read_target_tensors


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


recipe = eagle3_recipe  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
