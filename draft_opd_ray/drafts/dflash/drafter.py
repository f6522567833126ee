"""The DFlash block drafter in the reference engine: ``hidden_state_indices`` = ``target_layer_ids`` + 1 (id i =
output of layer i, as vLLM adds 1); the block [x_n, MASK...] sees context strictly before the anchor n
(`DFlashDraft.propose`)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from draft_opd_ray.drafts.dflash.model import DFlashDraft, load_dflash
from draft_opd_ray.drafts.drafter import FeatureDrafterBase


class DFlashDrafter(FeatureDrafterBase):
    """DFlash block drafter (`DFlashDraft`): one forward proposes K = ``num_speculative_tokens``
    <= block_size - 1 tokens."""

    def __init__(self, target: nn.Module, draft: DFlashDraft) -> None:
        super().__init__(target, draft)
        self.block_size = draft.config.block_size

    def _check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        if not 1 <= num_speculative_tokens <= self.block_size - 1:
            raise ValueError(
                f"num_speculative_tokens must be in [1, block_size - 1 = {self.block_size - 1}], "
                f"got {num_speculative_tokens}"
            )


def dflash_drafter(target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Any:
    return DFlashDrafter(target, load_dflash(draft_dir, target_dir).float())


drafter = dflash_drafter  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
