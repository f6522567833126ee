"""The student side of Draft-OPD replay for each draft kind: the draft's hidden states over every anchor's block.

A student turns one replayed sequence (`TeacherItem`: committed tokens, target features, anchors, the drafted
blocks and their acceptance) into (N, K, H) final hidden states, row [j, k-1] feeding the LM head for q_k, the
draft's distribution of block token k from anchor j. What each kind conditions q_k on is what it conditions on
when vLLM runs it:

    eagle3      target features of x_{<=n}, then its own unrolled states over y_{<k} (training-time test)
    standalone  the tokens x_{<=n} y_{<k}: a causal LM over the sequence with every anchor's rejected branch
                packed behind it under a tree mask (the same packing the replay's teacher forward uses)
    dflash      target features of x_{<n}, the anchor token and mask tokens: all K offsets in one parallel
                pass, not conditioned on y_{<k}

`lm_head` is the (V_student, H) weight the loss multiplies those states with (the `full` estimator never builds
the logits whole). `features` tells the replay which target hidden states to ship (HF `hidden_states` indices; none for a
standalone LM); `draft_ids` the target ids of the student's vocabulary (None: the whole target vocabulary).
`greedy_blocks` is what `replay.mode=redraft` runs: the draft's own greedy block from every anchor.
Which class serves which kind is the `student` entry of `models/kinds.py`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from draft_opd_ray.models.kinds import draft_kind
from draft_opd_ray.wire import ReplayItem, TeacherItem, branch_mask, pack_branches


class Student(Protocol):
    model: nn.Module
    features: tuple[int, ...]
    draft_ids: list[int] | None

    @property
    def lm_head(self) -> torch.Tensor: ...

    def block_hidden(self, b: TeacherItem) -> torch.Tensor: ...

    def greedy_blocks(
        self, ids: torch.Tensor, feats: torch.Tensor | None, anchors: torch.Tensor, k: int
    ) -> torch.Tensor: ...

    def flops(self, b: TeacherItem) -> float: ...

    def rollout_state(self) -> dict[str, torch.Tensor]: ...

    def save(self, out_dir: str) -> str: ...


def make_student(kind: str, draft_dir: str, target: str) -> Student:
    return draft_kind(kind).student()(draft_dir, target)  # type: ignore[no-any-return]


def replay_needs(kind: str, draft_dir: str, target: str) -> tuple[list[int], list[int] | None]:
    """What the replay ships for this draft: the HF `hidden_states` indices of its target features and the
    target ids of its vocabulary (None: the target's whole vocabulary). A draft that conditions on no target
    features is an LM with the target's own vocabulary: nothing to load to know that."""
    if not draft_kind(kind).feature_conditioned:
        return [], None
    s = make_student(kind, draft_dir, target)
    return list(s.features), s.draft_ids


def _cpu_state(sd: dict[str, torch.Tensor], skip: set[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in sd.items() if k not in skip}


class _Student:
    """Load and save through the kind's table entry; subclasses add what conditions their q_k."""

    kind = ""

    def __init__(self, draft_dir: str, target: str) -> None:
        self.target = target
        self.model: Any = draft_kind(self.kind).load(draft_dir, target)
        self.features: tuple[int, ...] = ()
        self.draft_ids: list[int] | None = None

    def save(self, out_dir: str) -> str:
        draft_kind(self.kind).save(self.model, out_dir, self.target)
        return out_dir


class Eagle3Student(_Student):
    kind = "eagle3"

    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(draft_dir, target)
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
        self, ids: torch.Tensor, feats: torch.Tensor | None, anchors: torch.Tensor, k: int
    ) -> torch.Tensor:
        """(N, k) target ids the head drafts greedily from every anchor at once (its vLLM unroll)."""
        assert feats is not None
        head, toks = self.model, []

        def feed(_: int, h: torch.Tensor) -> torch.Tensor:
            t = head.draft_ids_in_target[head.logits(h).argmax(-1)]
            toks.append(t)
            return t

        valid = torch.ones(1, len(ids), dtype=torch.bool, device=ids.device)
        last = head._unroll(ids[None], feats[None], anchors[None], k, feed, valid)[-1]
        feed(k, last)
        return torch.stack(toks, dim=-1)[0]

    def flops(self, b: TeacherItem) -> float:
        from draft_opd_ray.flops import eagle3_block_flops

        return eagle3_block_flops(
            self.model.config, len(b.input_ids), len(b.anchor_pos), b.drafted.shape[1]
        ).total

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """Checkpoint names, without the (frozen, shared) target embedding; no id maps when Vd = V."""
        skip = {"embed_tokens.weight"}
        if self.model.config.draft_vocab_size == self.model.config.vocab_size:
            skip |= {"d2t", "t2d"}
        return _cpu_state(self.model.state_dict(), skip)


class StandaloneStudent(_Student):
    kind = "standalone"

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
        self, ids: torch.Tensor, feats: torch.Tensor | None, anchors: torch.Tensor, k: int
    ) -> torch.Tensor:
        """(N, k) greedy blocks from every anchor: k tree-masked forwards over the sequence plus each anchor's
        partial block (a branch at positions n+1.., seeing x_{<=n} and itself)."""
        seq, starts = ids.tolist(), anchors.tolist()
        T, N = len(seq), len(starts)
        blocks = torch.zeros(N, k, dtype=torch.long)
        dev = ids.device
        for r in range(k):
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

    def flops(self, b: TeacherItem) -> float:
        """Forward + backward (3x a forward) over the packed sequence and branches."""
        from draft_opd_ray.flops import model_config_info, target_forward_flops

        tokens = len(b.input_ids) + int((b.valid_len - b.accepted - 1).clamp(min=0).sum())
        return 3.0 * target_forward_flops(model_config_info(self.model), 1, tokens)

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """HF names as `save_pretrained` writes them (a tied LM head only once)."""
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return _cpu_state(self.model.state_dict(), {"lm_head.weight"} if tied else set())


class DFlashStudent(_Student):
    kind = "dflash"

    def __init__(self, draft_dir: str, target: str) -> None:
        super().__init__(draft_dir, target)
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
        self, ids: torch.Tensor, feats: torch.Tensor | None, anchors: torch.Tensor, k: int
    ) -> torch.Tensor:
        """(N, k): all offsets of every anchor's block in one parallel pass."""
        assert feats is not None
        m = self.model
        return m.logits(m(ids[None], feats[None], anchors[None])[0][:, 1 : k + 1]).argmax(-1)  # type: ignore[no-any-return]

    def flops(self, b: TeacherItem) -> float:
        from draft_opd_ray.flops import dflash_forward_flops

        c = self.model.config
        return 3.0 * dflash_forward_flops(c, len(b.input_ids), len(b.anchor_pos), b.drafted.shape[1])

    def rollout_state(self) -> dict[str, torch.Tensor]:
        return _cpu_state(self.model.trainable_state_dict(), set())
