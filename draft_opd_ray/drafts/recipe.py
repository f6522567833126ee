"""What an SFT recipe is; each kind's is in its folder (`drafts/<kind>/recipe.py`), `sft/trainer.run_sft` runs
any of them (`DraftKind.recipe` builds the kind's).

A recipe is the draft to train plus what the shared loop needs from it:

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

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


def batch_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    B, T = batch["input_ids"].shape
    return int(B), int(T)
