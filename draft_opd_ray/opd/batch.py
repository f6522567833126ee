"""The learner's view of a `TeacherItem` (`wire.py`): the committed target ids at every block position."""

from __future__ import annotations

import torch

from draft_opd_ray.wire import TeacherItem


def committed_blocks(t: TeacherItem) -> torch.Tensor:
    """(N, K) target ids: at block position k <= a+1 (whose context is the committed stream) the committed token
    x_{n+k}; -1 after the first rejection, past the sequence's end and past K'."""
    N, K = t.drafted.shape
    T = len(t.input_ids)
    j = torch.arange(K, device=t.anchor_pos.device)[None, :]  # k - 1, on the item's device
    pos = t.anchor_pos[:, None] + j + 1  # (N, K)
    ok = (j <= t.accepted[:, None]) & (j < t.valid_len[:, None]) & (pos < T)
    return torch.where(ok, t.input_ids[pos.clamp(max=T - 1)], -1)
