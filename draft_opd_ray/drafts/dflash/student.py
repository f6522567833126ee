"""The DFlash block drafter as a Draft-OPD student (`drafts/student.py`): its hidden states over every anchor's
block."""

from __future__ import annotations

import torch

from draft_opd_ray.drafts.dflash.model import load_dflash, save_dflash
from draft_opd_ray.drafts.student import DraftStudent, cpu_state
from draft_opd_ray.wire import TeacherItem


class DFlashStudent(DraftStudent):
    """Target features of x_{<n}, the anchor token and mask tokens: all K offsets in one parallel pass, not
    conditioned on y_{<k}."""

    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(load_dflash(draft_dir, target), target)
        self.features = tuple(self.model.hidden_state_indices)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight  # type: ignore[no-any-return]

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        bs, K = self.model.config.block_size, b.drafted.shape[1]
        if bs <= K:
            raise ValueError(f"a DFlash block of {bs} drafts {bs - 1} tokens, fewer than K={K}")
        feats = b.features.to(self.lm_head.dtype)  # the learner's precision (learner.dtype)
        h = self.model(b.input_ids[None], feats[None], b.anchor_pos[None])[0]  # (N, bs, H)
        return h[:, 1 : K + 1]  # type: ignore[no-any-return]

    def greedy_blocks(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor | None,
        anchors: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor:
        """(N, K): all offsets of every anchor's block in one parallel pass."""
        assert feats is not None
        m = self.model
        return m.logits(
            m(ids[None], feats[None], anchors[None])[0][:, 1 : num_speculative_tokens + 1]
        ).argmax(-1)  # type: ignore[no-any-return]

    def flops(self, b: TeacherItem, *, backward: bool = True) -> float:
        """Forward + backward (3x a forward), or the forward alone."""
        from draft_opd_ray.flops import dflash_forward_flops

        c = self.model.config
        fwd = dflash_forward_flops(c, len(b.input_ids), len(b.anchor_pos), b.drafted.shape[1])
        return (3.0 if backward else 1.0) * fwd

    def rollout_state(self) -> dict[str, torch.Tensor]:
        return cpu_state(self.model.trainable_state_dict(), set())

    def save(self, out_dir: str) -> str:
        save_dflash(self.model, out_dir, self.target)
        return out_dir


student = DFlashStudent  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
