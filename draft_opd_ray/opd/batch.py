"""Data contracts between the Draft-OPD actors, and the packing math of the replay forward (torch only).

    ReplayItem   driver -> replay actor: one committed sequence and its selected anchors (recorded blocks)
    TeacherItem  replay actor -> learner: the same sequence scored by the target (features, teacher log-probs,
                 acceptance recomputed), in the draft's vocabulary; it goes from the replay actor's node to
                 the learner rank's as an object reference
    TeacherSummary  replay actor -> driver: its sizes and agreement counts, no tensors
Positions are indices into the committed sequence x = prompt + response (docs/design.md, "Records"): anchor n is
the last committed token before a block, block position k = 1..K has context x_{<=n} y_{<k}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ReplayItem:
    """One committed sequence and its selected anchors (recorded blocks)."""

    input_ids: list[int]  # prompt + response, committed tokens
    anchor_pos: list[int]  # (N,) index of the last committed token before each block
    drafted: list[list[int]]  # (N, K') recorded drafted target ids
    accepted: list[int]  # (N,) recorded acceptance
    policy_version: int


@dataclass
class TeacherItem:
    input_ids: torch.Tensor  # (T,) long
    # (T, A*H) target aux hidden states (HF hidden_states[i], i in aux ids), in the target's precision
    features: torch.Tensor
    anchor_pos: torch.Tensor  # (N,) long
    drafted: torch.Tensor  # (N, K) long, right-padded with 0
    valid_len: torch.Tensor  # (N,) long, K' <= K positions that have a teacher
    accepted: torch.Tensor  # (N,) long, recorded acceptance (clipped to valid_len)
    replay_accepted: torch.Tensor  # (N,) long, greedy acceptance recomputed by the teacher
    teacher_logprobs: torch.Tensor | None  # (N, K, Vd) log p_k over the draft vocabulary (payload "full")
    policy_version: int
    teacher_topk_ids: torch.Tensor | None = (
        None  # (N, K, k) draft-vocabulary ids of p_k's top k (payload "topk")
    )
    teacher_topk_logprobs: torch.Tensor | None = None  # (N, K, k) their log-probs
    # the draft's own top-m ids at every block position (`loss.draft_topm`) and the teacher's log-probs there
    draft_topm_ids: torch.Tensor | None = None  # (N, K, m) draft-vocabulary ids
    teacher_logprobs_at_draft: torch.Tensor | None = None  # (N, K, m)
    replay_draft_flops: float = 0.0  # the replay's draft forward that found draft_topm_ids (training compute)

    def to(self, device: torch.device | str) -> TeacherItem:
        """The same item with every tensor on ``device`` (a no-op where they already are)."""
        moved: dict[str, Any] = {
            f.name: v.to(device) if isinstance(v, torch.Tensor) else v
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        return TeacherItem(**moved)

    def scored_tokens(self) -> int:
        """Tokens the replay forward scored: the sequence plus every anchor's branch (what a replay actor's or
        learner rank's share is balanced by)."""
        branch = (self.valid_len - self.accepted - 1).clamp(min=0)
        return int(len(self.input_ids) + branch.sum())


@dataclass(frozen=True)
class TeacherSummary:
    """What the driver needs of one scored sequence, without its tensors: the sizes it shards the learner's
    mini-batches by and the step's metrics. The `TeacherItem` itself stays in the object store of the replay
    actor's node until a learner rank fetches it (`ReplayGroup.score_refs`)."""

    anchors: int  # N
    learner_cost: int  # `learner_cost`
    scored_tokens: int  # `TeacherItem.scored_tokens`
    target_ran: bool  # the replay ran the target (not for a standalone draft's sft_on_rollouts)
    agree: int  # anchors whose greedy acceptance under replay equals the recorded one
    payload_bytes: int  # `payload_bytes`
    draft_flops: float = 0.0  # `TeacherItem.replay_draft_flops`

    @staticmethod
    def of(t: TeacherItem) -> TeacherSummary:
        ran = t.teacher_logprobs is not None or t.teacher_topk_ids is not None or t.features.numel() > 0
        agree = int((t.accepted == t.replay_accepted).sum())
        return TeacherSummary(
            len(t.anchor_pos),
            learner_cost(t),
            t.scored_tokens(),
            ran,
            agree,
            payload_bytes(t),
            t.replay_draft_flops,
        )


def committed_blocks(t: TeacherItem) -> torch.Tensor:
    """(N, K) target ids: at block position k <= a+1 (whose context is the committed stream) the committed token
    x_{n+k}; -1 after the first rejection, past the sequence's end and past K'."""
    N, K = t.drafted.shape
    T = len(t.input_ids)
    j = torch.arange(K, device=t.anchor_pos.device)[None, :]  # k - 1, on the item's device
    pos = t.anchor_pos[:, None] + j + 1  # (N, K)
    ok = (j <= t.accepted[:, None]) & (j < t.valid_len[:, None]) & (pos < T)
    return torch.where(ok, t.input_ids[pos.clamp(max=T - 1)], -1)


def payload_bytes(t: TeacherItem) -> int:
    """What one scored sequence ships to the learner (features + teacher)."""
    parts = [
        t.features,
        t.teacher_logprobs,
        t.teacher_topk_ids,
        t.teacher_topk_logprobs,
        t.draft_topm_ids,
        t.teacher_logprobs_at_draft,
    ]
    return sum(x.numel() * x.element_size() for x in parts if x is not None)


@dataclass
class PackedBranches:
    """The committed sequence followed by every anchor's rejected branch, scored in ONE forward."""

    input_ids: torch.Tensor  # (T + B,)
    position_ids: torch.Tensor  # (T + B,)
    mask: torch.Tensor  # (T + B, T + B) additive: 0 where attention is allowed, -inf elsewhere
    rows: list[torch.Tensor]  # per anchor: the logit rows that are its teacher positions k = 1..valid


def pack_branches(it: ReplayItem, k: int) -> PackedBranches:
    """Block position k of anchor (n, y, a) has context x_{<=n} y_{<k}. For k <= a+1 that is the committed
    stream (row n+k-1). For k >= a+2 the context contains the rejected y_{a+1}: those rows are a branch
    y_{a+1}..y_{K'-1} appended after the stream at positions n+a+1.., attending to x_{<=n+a} and to the earlier
    tokens of its own branch only (a tree mask, as in tree-attention verification)."""
    T = len(it.input_ids)
    ids, pos, rows = list(it.input_ids), list(range(T)), []
    spans: list[tuple[int, int, int]] = []  # (first packed index, length, prefix end n+a inclusive)
    for n, y, a in zip(it.anchor_pos, it.drafted, it.accepted):
        kk = min(len(y), k)
        on_stream = max(0, min(a + 1, kk, T - n))
        r = list(range(n, n + on_stream))
        if on_stream == a + 1 and a + 1 < kk:
            start = len(ids)
            branch = list(y[a : kk - 1])
            ids += branch
            pos += list(range(n + a + 1, n + kk))
            spans.append((start, len(branch), n + a))
            r += list(range(start, start + len(branch)))
        rows.append(torch.tensor(r, dtype=torch.long))
    return PackedBranches(torch.tensor(ids), torch.tensor(pos), branch_mask(len(ids), T, spans), rows)


def branch_mask(length: int, stream_len: int, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """(L, L) additive tree mask: causal over the first ``stream_len`` tokens (the committed stream); each span
    (first packed index, length, last stream position it sees) attends to the stream up to and including that
    position and causally to itself, never to another span."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[stream_len:, :] = False
    for start, n, last in spans:
        allowed[start : start + n, : last + 1] = True
        allowed[start : start + n, start : start + n] = torch.ones(n, n).tril().bool()
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))


def balanced_shards(weights: Sequence[float], parts: int) -> list[list[int]]:
    """Indices 0..len(weights)-1 split into ``parts`` shards of about equal total weight (longest first onto the
    lightest shard), each in ascending order; shards may be empty when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0.0] * parts
    shards: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        s = min(range(parts), key=lambda p: (load[p], p))
        shards[s].append(i)
        load[s] += weights[i]
    return [sorted(s) for s in shards]


def replay_cost(it: ReplayItem) -> int:
    """Tokens the replay forward of ``it`` scores: the sequence plus every anchor's rejected branch."""
    branch = sum(max(0, len(y) - a - 1) for y, a in zip(it.drafted, it.accepted))
    return len(it.input_ids) + branch


def learner_cost(t: TeacherItem) -> int:
    """The student's work on one sequence: its block positions (plus the sequence the features cover)."""
    return int(t.valid_len.sum()) + len(t.input_ids)
