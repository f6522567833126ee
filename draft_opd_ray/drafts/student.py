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
Each kind's class is in its folder (`drafts/<kind>/student.py`); `DraftKind.student` makes it from an exported
folder, `DraftKind.replay_needs` says what its replay ships.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from draft_opd_ray.wire import TeacherItem


class Student(Protocol):
    model: nn.Module
    features: tuple[int, ...]
    draft_ids: list[int] | None

    @property
    def lm_head(self) -> torch.Tensor: ...

    def block_hidden(self, b: TeacherItem) -> torch.Tensor: ...

    def greedy_blocks(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor | None,
        anchors: torch.Tensor,
        num_speculative_tokens: int,
    ) -> torch.Tensor: ...

    def flops(self, b: TeacherItem, *, backward: bool = True) -> float:
        """Training FLOPs of the student on ``b`` (`block_hidden` + the head at the block positions): forward +
        backward, or the forward alone (``backward=False``: the replay's pass for the draft's own top-m)."""
        ...

    def rollout_state(self) -> dict[str, torch.Tensor]: ...

    def save(self, out_dir: str) -> str: ...


def cpu_state(sd: dict[str, torch.Tensor], skip: set[str]) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a state dict, without the names in ``skip`` (what `rollout_state` publishes)."""
    return {k: v.detach().cpu().clone() for k, v in sd.items() if k not in skip}


def load_state(model: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """``weights`` (names of `rollout_state`) copied into ``model`` in place; an unknown name is refused first."""
    own = model.state_dict()
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"draft weights with unknown names: {unknown[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)


class DraftStudent:
    """What every kind's student holds: the loaded draft, its target folder, and (feature-conditioned kinds) the
    target features and vocabulary it needs; each kind adds what conditions its q_k and how it saves."""

    def __init__(self, model: Any, target: str) -> None:
        self.target = target
        self.model: Any = model
        self.features: tuple[int, ...] = ()
        self.draft_ids: list[int] | None = None
