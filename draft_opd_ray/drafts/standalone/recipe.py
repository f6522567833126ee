"""The standalone SFT recipe (`drafts/recipe.py`): a slice of the target, distilled (soft CE of every response
position against the target's top-k over the whole vocabulary)."""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.recipe import Recipe, RecipeInputs, Reduce, batch_shape
from draft_opd_ray.drafts.standalone.model import (
    build_standalone_from_target,
    load_standalone,
    save_standalone,
)
from draft_opd_ray.flops import model_config_info, target_forward_flops
from draft_opd_ray.models.target import read_target_info


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
        lambda b: 3.0 * target_forward_flops(model_config_info(lm), *batch_shape(b)),
        lambda m, out, t: save_standalone(m, out, t),
    )


recipe = standalone_recipe  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
