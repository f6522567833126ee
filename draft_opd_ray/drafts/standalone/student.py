"""A standalone draft LM as a Draft-OPD student (`drafts/student.py`): its hidden states over every anchor's
block."""

from __future__ import annotations

import torch

from draft_opd_ray.drafts.standalone.model import load_standalone, save_standalone
from draft_opd_ray.drafts.student import DraftStudent, cpu_state
from draft_opd_ray.wire import ReplayItem, TeacherItem, branch_mask, pack_branches


class StandaloneStudent(DraftStudent):
    """The tokens x_{<=n} y_{<k}: a causal LM over the sequence with every anchor's rejected branch packed behind
    it under a tree mask (the same packing the replay's teacher forward uses)."""

    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(load_standalone(draft_dir, target), target)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # type: ignore[no-any-return]

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        N, K = b.drafted.shape
        item = ReplayItem(
            b.input_ids.tolist(),
            b.anchor_pos.tolist(),
            [row[: int(v)].tolist() for row, v in zip(b.drafted, b.valid_len)],
            b.accepted.tolist(),
            b.policy_version,
        )
        packed = pack_branches(item, K)
        dev = b.input_ids.device
        out = self.model.model(
            input_ids=packed.input_ids[None].to(dev),
            attention_mask=packed.mask[None, None].to(dev),
            position_ids=packed.position_ids[None].to(dev),
            use_cache=False,
        )
        h = out.last_hidden_state[0]  # (T + branches, H), after the final norm
        hidden = h.new_zeros(N, K, h.shape[-1])
        for j, rows in enumerate(packed.rows):
            hidden[j, : len(rows)] = h[rows]
        return hidden

    def greedy_blocks(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor | None,
        anchors: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor:
        """(N, K) greedy blocks from every anchor: K tree-masked forwards over the sequence plus each anchor's
        partial block (a branch at positions n+1.., seeing x_{<=n} and itself)."""
        seq, starts = ids.tolist(), anchors.tolist()
        T, N = len(seq), len(starts)
        blocks = torch.zeros(N, num_speculative_tokens, dtype=torch.long)
        dev = ids.device
        for r in range(num_speculative_tokens):
            toks, pos, spans, last_rows = list(seq), list(range(T)), [], []
            for j, n in enumerate(starts):
                spans.append((len(toks), r, n))
                last_rows.append(len(toks) + r - 1 if r else n)
                toks += blocks[j, :r].tolist()
                pos += list(range(n + 1, n + 1 + r))
            logits = self.model(
                input_ids=torch.tensor(toks, device=dev)[None],
                attention_mask=branch_mask(len(toks), T, spans)[None, None].to(dev),
                position_ids=torch.tensor(pos, device=dev)[None],
                use_cache=False,
            ).logits[0]
            blocks[:, r] = logits[torch.tensor(last_rows, device=dev)].argmax(-1).cpu()
        return blocks

    def flops(self, b: TeacherItem, *, backward: bool = True) -> float:
        """Forward + backward (3x a forward) over the packed sequence and branches, or the forward alone."""
        from draft_opd_ray.flops import model_config_info, target_forward_flops

        tokens = len(b.input_ids) + int((b.valid_len - b.accepted - 1).clamp(min=0).sum())
        return (3.0 if backward else 1.0) * target_forward_flops(model_config_info(self.model), 1, tokens)

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """HF names as `save_pretrained` writes them (a tied LM head only once)."""
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return cpu_state(self.model.state_dict(), {"lm_head.weight"} if tied else set())

    def save(self, out_dir: str) -> str:
        save_standalone(self.model, out_dir, self.target)
        return out_dir


student = StandaloneStudent  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
