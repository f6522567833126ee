"""The EAGLE-3 head as a Draft-OPD student (`drafts/student.py`): its hidden states over every anchor's block."""

from __future__ import annotations

import torch

from draft_opd_ray.drafts.eagle3.model import load_eagle3, save_eagle3
from draft_opd_ray.drafts.student import DraftStudent, cpu_state
from draft_opd_ray.wire import TeacherItem


class Eagle3Student(DraftStudent):
    """Target features of x_{<=n}, then the head's own unrolled states over y_{<k} (training-time test)."""

    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(load_eagle3(draft_dir, target), target)
        c = self.model.config
        self.features = tuple(self.model.hidden_state_indices)
        if c.draft_vocab_size < c.vocab_size:
            self.draft_ids = self.model.draft_ids_in_target.tolist()

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight  # type: ignore[no-any-return]

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        feats = b.features.to(self.model.fc.weight.dtype)  # the learner's precision (learner.dtype)
        return self.model.block_hidden(  # type: ignore[no-any-return]
            b.input_ids[None], feats[None], b.anchor_pos[None], b.drafted[None]
        )[0]

    def greedy_blocks(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor | None,
        anchors: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor:
        """(N, K) target ids the head drafts greedily from every anchor at once (its vLLM unroll)."""
        assert feats is not None
        head, toks = self.model, []

        def feed(_: int, h: torch.Tensor) -> torch.Tensor:
            t = head.draft_ids_in_target[head.logits(h).argmax(-1)]
            toks.append(t)
            return t

        valid = torch.ones(1, len(ids), dtype=torch.bool, device=ids.device)
        last = head._unroll(ids[None], feats[None], anchors[None], num_speculative_tokens, feed, valid)[-1]
        feed(num_speculative_tokens, last)
        return torch.stack(toks, dim=-1)[0]

    def flops(self, b: TeacherItem, *, backward: bool = True) -> float:
        from draft_opd_ray.flops import eagle3_block_flops

        f = eagle3_block_flops(self.model.config, len(b.input_ids), len(b.anchor_pos), b.drafted.shape[1])
        return f.total if backward else f.forward

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """Checkpoint names, without the (frozen, shared) target embedding; no id maps when Vd = V."""
        skip = {"embed_tokens.weight"}
        if self.model.config.draft_vocab_size == self.model.config.vocab_size:
            skip |= {"d2t", "t2d"}
        return cpu_state(self.model.state_dict(), skip)

    def save(self, out_dir: str) -> str:
        save_eagle3(self.model, out_dir, self.target)
        return out_dir


student = Eagle3Student  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
