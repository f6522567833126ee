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
the logits whole). `features` tells the replay which target hidden states to ship (HF `hidden_states` indices).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from draft_opd_ray.replay import ReplayItem, TeacherItem, pack_branches


class Student(Protocol):
    model: nn.Module

    @property
    def lm_head(self) -> torch.Tensor: ...

    def block_hidden(self, b: TeacherItem) -> torch.Tensor: ...

    def flops(self, b: TeacherItem) -> float: ...

    def rollout_state(self) -> dict[str, torch.Tensor]: ...

    def save(self, out_dir: str) -> str: ...


def replay_needs(kind: str, draft_dir: str, target: str) -> tuple[list[int], list[int] | None]:
    """What the replay ships for this draft: the HF `hidden_states` indices of its target features (none for a
    standalone LM) and the target ids of its vocabulary (None: the target's whole vocabulary)."""
    if kind == "eagle3":
        from draft_opd_ray.models.eagle3 import load_eagle3

        head = load_eagle3(draft_dir, target)
        c = head.config
        ids = head.draft_ids_in_target.tolist() if c.draft_vocab_size < c.vocab_size else None
        return list(head.hidden_state_indices), ids
    if kind == "dflash":
        from draft_opd_ray.models.dflash import load_dflash

        return list(load_dflash(draft_dir, target).hidden_state_indices), None
    if kind == "standalone":
        return [], None
    raise ValueError(f"draft kind must be eagle3, standalone or dflash, got {kind!r}")


def _cpu_state(sd: dict[str, torch.Tensor], skip: set[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in sd.items() if k not in skip}


class Eagle3Student:
    def __init__(self, draft_dir: str, target: str) -> None:
        from draft_opd_ray.models.eagle3 import load_eagle3

        self.target = target
        self.model = load_eagle3(draft_dir, target)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @property
    def draft_ids(self) -> list[int] | None:
        c = self.model.config
        return self.model.draft_ids_in_target.tolist() if c.draft_vocab_size < c.vocab_size else None

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        return self.model.block_hidden(
            b.input_ids[None], b.features[None], b.anchor_pos[None], b.drafted[None]
        )[0]

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

    def save(self, out_dir: str) -> str:
        from draft_opd_ray.models.eagle3 import save_eagle3

        save_eagle3(self.model, out_dir, self.target)
        return out_dir


class StandaloneStudent:
    def __init__(self, draft_dir: str, target: str) -> None:
        from draft_opd_ray.models.standalone import load_standalone

        self.target = target
        self.model = load_standalone(draft_dir, target)
        self.draft_ids: list[int] | None = None  # the target's vocabulary

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # type: ignore[operator]

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
        out = self.model.model(  # type: ignore[operator]
            input_ids=packed.input_ids[None],
            attention_mask=packed.mask[None, None],
            position_ids=packed.position_ids[None],
            use_cache=False,
        )
        h = out.last_hidden_state[0]  # (T + branches, H), after the final norm
        hidden = h.new_zeros(N, K, h.shape[-1])
        for j, rows in enumerate(packed.rows):
            hidden[j, : len(rows)] = h[rows]
        return hidden

    def flops(self, b: TeacherItem) -> float:
        """Forward + backward (3x a forward) over the packed sequence and branches."""
        from draft_opd_ray.flops import target_forward_flops

        tokens = len(b.input_ids) + int((b.valid_len - b.accepted - 1).clamp(min=0).sum())
        return 3.0 * target_forward_flops(config_info(self.model), 1, tokens)

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """HF names as `save_pretrained` writes them (a tied LM head only once)."""
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return _cpu_state(self.model.state_dict(), {"lm_head.weight"} if tied else set())

    def save(self, out_dir: str) -> str:
        from draft_opd_ray.models.standalone import save_standalone

        save_standalone(self.model, out_dir, self.target)
        return out_dir


class DFlashStudent:
    def __init__(self, draft_dir: str, target: str) -> None:
        from draft_opd_ray.models.dflash import load_dflash

        self.target = target
        self.model = load_dflash(draft_dir, target)
        self.draft_ids: list[int] | None = None

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def block_hidden(self, b: TeacherItem) -> torch.Tensor:
        bs, K = self.model.config.block_size, b.drafted.shape[1]
        if bs <= K:
            raise ValueError(f"a DFlash block of {bs} drafts {bs - 1} tokens, fewer than K={K}")
        h = self.model(b.input_ids[None], b.features[None], b.anchor_pos[None])[0]  # (N, bs, H)
        return h[:, 1 : K + 1]

    def flops(self, b: TeacherItem) -> float:
        c = self.model.config
        H, heads, d, kv = c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads
        layer_p = H * (heads * d + 2 * kv * d) + heads * d * H + 3 * H * c.intermediate_size
        N, T = len(b.anchor_pos), len(b.input_ids)
        rows = N * c.block_size
        fwd = c.num_layers * (
            2 * layer_p * rows + 2 * 2 * kv * d * H * T + 4 * heads * d * rows * (T + c.block_size)
        )
        fwd += 2 * b.features.shape[-1] * H * T + 2 * H * c.vocab_size * N * b.drafted.shape[1]
        return 3.0 * float(fwd)

    def rollout_state(self) -> dict[str, torch.Tensor]:
        return _cpu_state(self.model.trainable_state_dict(), set())

    def save(self, out_dir: str) -> str:
        from draft_opd_ray.models.dflash import save_dflash

        save_dflash(self.model, out_dir, self.target)
        return out_dir


def config_info(model: Any) -> Any:
    """The fields of a TargetInfo that `target_forward_flops` reads, from a transformers model's config."""
    from types import SimpleNamespace

    c = model.config
    heads = c.num_attention_heads
    return SimpleNamespace(
        hidden_size=c.hidden_size,
        num_attention_heads=heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", heads),
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        vocab_size=c.vocab_size,
    )


def make_student(kind: str, draft_dir: str, target: str) -> Eagle3Student | StandaloneStudent | DFlashStudent:
    if kind == "eagle3":
        return Eagle3Student(draft_dir, target)
    if kind == "standalone":
        return StandaloneStudent(draft_dir, target)
    if kind == "dflash":
        return DFlashStudent(draft_dir, target)
    raise ValueError(f"draft kind must be eagle3, standalone or dflash, got {kind!r}")
