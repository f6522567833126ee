"""The toy draft as a Draft-OPD student, the plain way: one forward per anchor and block position."""

from __future__ import annotations

import torch

from draft_opd_ray.drafts.student import DraftStudent, cpu_state
from draft_opd_ray.wire import TeacherItem
from tests.kinds.toykind.model import load_toy, save_toy


class ToyStudent(DraftStudent):
    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(load_toy(draft_dir, target), target)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # type: ignore[no-any-return]

    def _last_hidden(self, ids: list[int]) -> torch.Tensor:
        dev = self.lm_head.device
        return self.model.model(input_ids=torch.tensor([ids], device=dev)).last_hidden_state[0, -1]  # type: ignore[no-any-return]

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        """(N, K, H): row [j, k-1] the state after x_{<=n_j} y_{<k} (zeros past the block's valid length)."""
        N, K = b.drafted.shape
        seq = b.input_ids.tolist()
        hidden = self.lm_head.new_zeros(N, K, self.lm_head.shape[1])
        for j, n in enumerate(b.anchor_pos.tolist()):
            for k in range(int(b.valid_len[j])):
                hidden[j, k] = self._last_hidden(seq[: n + 1] + b.drafted[j, :k].tolist())
        return hidden

    def greedy_blocks(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor | None,
        anchors: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor:
        blocks = torch.zeros(len(anchors), num_speculative_tokens, dtype=torch.long)
        for j, n in enumerate(anchors.tolist()):
            ctx = ids[: n + 1].tolist()
            for r in range(num_speculative_tokens):
                blocks[j, r] = int((self._last_hidden(ctx) @ self.lm_head.T).argmax())
                ctx.append(int(blocks[j, r]))
        return blocks

    def flops(self, b: TeacherItem, *, backward: bool = True) -> float:
        return 0.0  # not counted: a toy

    def rollout_state(self) -> dict[str, torch.Tensor]:
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return cpu_state(self.model.state_dict(), {"lm_head.weight"} if tied else set())

    def save(self, out_dir: str) -> str:
        save_toy(self.model, out_dir, self.target)
        return out_dir


student = ToyStudent  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
