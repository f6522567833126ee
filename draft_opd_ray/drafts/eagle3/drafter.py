"""The EAGLE-3 head in the reference engine: ``hidden_state_indices`` = ``aux_layer_ids`` (aux id i = HF
``hidden_states[i]`` = input of target layer i). Row t of the head consumes (f_t, x_{t+1}); the first draft comes
from row n-1, later steps feed the head's own pre-norm output (`Eagle3Draft.propose`)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from draft_opd_ray.drafts.drafter import FeatureDrafterBase
from draft_opd_ray.drafts.eagle3.model import Eagle3Draft, load_eagle3


class Eagle3Drafter(FeatureDrafterBase):
    """EAGLE-3 head (`Eagle3Draft`) proposing k tokens autoregressively on its own hidden states."""

    def __init__(self, target: nn.Module, draft: Eagle3Draft) -> None:
        super().__init__(target, draft)


def eagle3_drafter(target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Any:
    return Eagle3Drafter(target, load_eagle3(draft_dir, target_dir).float())


drafter = eagle3_drafter  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
