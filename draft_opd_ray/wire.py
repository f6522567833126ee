"""The wire contracts between the roles: what one role hands another, typed and documented once (torch only).

    RequestRecord   rollout worker -> driver: one request's anchor records (below; Parquet I/O and τ in
                    `rollout/records.py`)
    CapturedSteps   the same request's steps as the verification pass scored them: the teacher's top-k at every
                    drafted and bonus row (`rollout/verify_capture.py`, `EngineRun.capture_topk`)
    ReplayItem      driver -> replay actor: one committed sequence and its selected anchors (recorded blocks)
    TeacherItem     replay actor -> learner: the same sequence scored by the target (features, teacher log-probs,
                    acceptance recomputed), in the draft's vocabulary; it goes from the replay actor's node to
                    the learner rank's as an object reference
    TeacherSummary  replay actor -> driver: its sizes and agreement counts, no tensors
    PackedBranches  the committed sequence and every anchor's rejected branch in one forward (`pack_branches`):
                    the layout the replay's target forward and the student's forward share

Positions are indices into the committed sequence x = prompt + response (docs/design.md, "Records"): anchor n is
the last committed token before a block, block position k = 1..K has context x_{<=n} y_{<k}.

Anchor records. Verification step i drafted `drafted[i]` (K' <= K ids) after the committed token at
`anchor_pos[i]`, and the target accepted the first `accepted[i]` of them, committing `accepted[i] + 1` tokens (the
accepted ones plus a correction or bonus token). The first response token comes from prefill and belongs to no
step, so for a request that ran to completion

    len(response_ids) == 1 + sum(accepted[i] + 1)              (minus what the length cap or a stop cut off)
    anchor_pos[0] == len(prompt_ids),  anchor_pos[i+1] == anchor_pos[i] + accepted[i] + 1.

This module is the bottom floor of the roles: it imports no other module of the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# ------------------------------------------------------------------------------------------ rollout -> driver


@dataclass
class RequestRecord:
    """One request's rollout: its prompt, its response and a record of every verification step."""

    prompt_ids: list[int]
    response_ids: list[int]
    anchor_pos: list[int] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    # target log-prob of each drafted token given the drafted prefix; empty lists where unknown
    teacher_logprob_drafted: list[list[float]] = field(default_factory=list)
    request_id: str = ""
    finish_reason: str = ""  # "length" | "stop" | "abort" | "error" | ""
    error: str = ""  # why the request was not run (empty prompt, too long, ...)
    # vLLM's own per-request spec-decode counters for the same request (-1 when not from vLLM)
    vllm_steps: int = -1
    vllm_accepted: int = -1
    # the teacher captured in the verification pass (`EngineRun.capture_topk`), None when not captured
    captured: CapturedSteps | None = None

    @property
    def num_steps(self) -> int:
        return len(self.accepted)

    def committed_by_steps(self) -> int:
        """Response tokens the steps account for, prefill token included."""
        return 1 + sum(a + 1 for a in self.accepted) if self.response_ids else 0


@dataclass
class CapturedSteps:
    """One request's verification steps as the target scored them (S steps, K = the longest block, k = top-k).

    anchor_pos[i]: index in prompt + response of the last committed token before block i;
    drafted[i]: the K'_i drafted ids; accepted[i]: how many of them the sampler accepted;
    topk_ids / topk_logprobs (S, K + 1, k): the teacher's top-k at rows 0..K'_i (row K'_i is the bonus position;
    rows beyond K'_i are padding, ids 0 and log-probs -inf); log_tail (S, K + 1): log of the mass outside the top-k,
    summed in log space (-inf on padding). Ids are in `vocab` (the draft's vocabulary when the capture was given
    one: EAGLE-3's d2t target ids, log-probs renormalised over it; else the target's).
    """

    anchor_pos: list[int]
    drafted: list[list[int]]
    accepted: list[int]
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    log_tail: np.ndarray
    grammar: bool = False  # a grammar bitmask had masked these logits before the sampler saw them
    # the target's feature rows by position (P, D), in the target's dtype, and which positions were computed (P,),
    # where the engine captured them (EAGLE-3: `verify_capture.FeatureTap`); None otherwise
    features: torch.Tensor | None = None
    feature_seen: np.ndarray | None = None
    # the request's prompt, on the capture that holds its first steps (a server's traffic: `records_from_capture`)
    prompt_ids: list[int] | None = None
    # anchor_ids[i]: the committed token at anchor_pos[i], the one row 0 of step i scores (the first is the token
    # sampled at prefill, each next one the previous step's bonus or correction)
    anchor_ids: list[int] | None = None

    @property
    def num_steps(self) -> int:
        return len(self.accepted)

    def select(self, steps: Sequence[int]) -> CapturedSteps:
        """The same request's captured teacher at ``steps`` only (the selected anchors, in that order)."""
        idx = np.asarray(list(steps), dtype=np.int64)
        return CapturedSteps(
            [self.anchor_pos[i] for i in idx],
            [list(self.drafted[i]) for i in idx],
            [self.accepted[i] for i in idx],
            self.topk_ids[idx],
            self.topk_logprobs[idx],
            self.log_tail[idx],
            self.grammar,
            self.features,  # by position: the whole request's
            self.feature_seen,
            anchor_ids=None if self.anchor_ids is None else [self.anchor_ids[i] for i in idx],
        )

    def then(self, later: CapturedSteps) -> CapturedSteps:
        """This request's steps followed by its ``later`` ones (a capture taken while the request ran on): the
        step lists joined, the teacher rows padded to the longer block, the feature rows by position (``later``'s
        where it computed them)."""
        rows = max(self.topk_ids.shape[1], later.topk_ids.shape[1])

        def pad(a: np.ndarray, fill: float) -> np.ndarray:
            width = [(0, 0), (0, rows - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
            return np.pad(a, width, constant_values=fill)

        features, seen = self.features, self.feature_seen
        if later.features is not None and later.feature_seen is not None:
            if features is None or seen is None:
                features, seen = later.features, later.feature_seen
            else:
                size = max(len(seen), len(later.feature_seen))
                merged = torch.zeros(size, features.shape[-1], dtype=features.dtype)
                merged[: len(seen)] = features
                new = torch.as_tensor(later.feature_seen)
                merged[: len(new)][new] = later.features[new]
                seen = np.pad(seen, (0, size - len(seen))) | np.pad(later.feature_seen, (0, size - len(new)))
                features = merged
        both = self.anchor_ids is not None and later.anchor_ids is not None
        return CapturedSteps(
            self.anchor_pos + later.anchor_pos,
            self.drafted + later.drafted,
            self.accepted + later.accepted,
            np.concatenate([pad(self.topk_ids, 0), pad(later.topk_ids, 0)]),
            np.concatenate([pad(self.topk_logprobs, -np.inf), pad(later.topk_logprobs, -np.inf)]),
            np.concatenate([pad(self.log_tail, -np.inf), pad(later.log_tail, -np.inf)]),
            self.grammar or later.grammar,
            features,
            seen,
            self.prompt_ids if self.prompt_ids is not None else later.prompt_ids,
            (self.anchor_ids or []) + (later.anchor_ids or []) if both else None,
        )

    def record(self, request_id: str, version: int) -> RequestRecord:
        """The request these steps verified, as a rollout record served by draft ``version``: its prompt, the
        response its steps committed (each step's committed token and accepted drafts; the last step's bonus
        token is not captured, so the response stops before it) and the steps, with this capture as its teacher.
        Needs `prompt_ids` and `anchor_ids` (`rollout/verify_capture.py` keeps both)."""
        if self.prompt_ids is None or self.anchor_ids is None:
            raise ValueError(f"request {request_id}: captured steps without its prompt or committed tokens")
        response: list[int] = []
        for tok, d, a in zip(self.anchor_ids, self.drafted, self.accepted):
            response += [tok, *d[:a]]
        return RequestRecord(
            list(self.prompt_ids),
            response,
            list(self.anchor_pos),
            [list(d) for d in self.drafted],
            list(self.accepted),
            [version] * self.num_steps,
            [[] for _ in self.accepted],
            request_id=request_id,
            finish_reason="length",  # cut before the last bonus token: fewer tokens than the steps commit
            captured=self,
        )


def consistency_error(rec: RequestRecord) -> str | None:
    """Why a record breaks the invariants in the module docstring, or None if it is consistent."""
    n = len(rec.accepted)
    if not (len(rec.anchor_pos) == len(rec.drafted) == len(rec.policy_version) == n):
        return (
            f"per-step lists differ in length: anchor_pos {len(rec.anchor_pos)}, drafted {len(rec.drafted)}, "
            f"accepted {n}, policy_version {len(rec.policy_version)}"
        )
    for i, (a, d) in enumerate(zip(rec.accepted, rec.drafted)):
        if not 0 <= a <= len(d):
            return f"step {i}: accepted {a} outside [0, {len(d)}]"
    pos = len(rec.prompt_ids)
    for i, (p, a) in enumerate(zip(rec.anchor_pos, rec.accepted)):
        if p != pos:
            return f"step {i}: anchor_pos {p}, expected {pos}"
        pos += a + 1
    full = rec.committed_by_steps()
    got = len(rec.response_ids)
    if got > full or (got < full and rec.finish_reason not in ("length", "stop")):
        return f"response has {got} tokens but the steps commit {full} (finish_reason {rec.finish_reason!r})"
    seq = rec.prompt_ids + rec.response_ids
    for i, (p, a, d) in enumerate(zip(rec.anchor_pos, rec.accepted, rec.drafted)):
        if seq[p + 1 : p + 1 + a] != d[:a][: max(0, len(seq) - p - 1)]:
            return f"step {i}: accepted drafted ids {d[:a]} differ from the committed tokens"
    return None


# -------------------------------------------------------------------------------- driver -> replay -> learner


@dataclass
class ReplayItem:
    """One committed sequence and its selected anchors (recorded blocks)."""

    input_ids: list[int]  # prompt + response, committed tokens
    anchor_pos: list[int]  # (N,) index of the last committed token before each block
    drafted: list[list[int]]  # (N, K') recorded drafted target ids
    accepted: list[int]  # (N,) recorded acceptance
    policy_version: int
    # `teacher.source=verify`: the verification pass's teacher at these anchors (`CapturedSteps.select`, the same
    # steps in the same order); the replay then runs no teacher forward (`captured_teacher`)
    captured: CapturedSteps | None = None


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
    # log of the teacher's mass outside that support (top-k ids and draft_topm_ids), summed in log space over the
    # full draft-vocabulary teacher: exact where 1 - sum(p over the support) cancels to 0 in float32
    teacher_log_tail: torch.Tensor | None = None  # (N, K)
    replay_draft_flops: float = 0.0  # the replay's draft forward that found draft_topm_ids (training compute)
    # the teacher came from the rollout's verification pass (`captured_teacher`): the replay's target ran, if at
    # all, over the committed sequence only, for the features
    teacher_captured: bool = False
    features_captured: bool = False  # the features too (`captured_features`): the replay ran no target at all

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
        learner rank's share is balanced by). A captured teacher scored no branch: the sequence only."""
        if self.teacher_captured:
            return len(self.input_ids)
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
    # the replay ran the target (not for a standalone draft's sft_on_rollouts, nor for its captured teacher)
    target_ran: bool
    agree: int  # anchors whose greedy acceptance under replay equals the recorded one
    payload_bytes: int  # `payload_bytes`
    draft_flops: float = 0.0  # `TeacherItem.replay_draft_flops`

    @staticmethod
    def of(t: TeacherItem) -> TeacherSummary:
        teacher = t.teacher_logprobs is not None or t.teacher_topk_ids is not None
        ran = (teacher and not t.teacher_captured) or (t.features.numel() > 0 and not t.features_captured)
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


def captured_teacher(
    cap: CapturedSteps, num_speculative_tokens: int, topk: int | None = None
) -> tuple[torch.Tensor, ...]:
    """(topk_ids, topk_logprobs, log_tail, valid_len) of `TeacherItem` from the verification pass's rows of the
    selected steps: block position k = 1..K' of step i is verify row k-1 (the target at x_{<=n} y_{<k}, the
    rejected suffix included); the bonus row K' has no block position and is not used. Every drafted position
    has a teacher, also where the length cap cut the committed sequence short (the verification saw the block).
    ``topk`` below the captured width keeps the first ``topk`` (the capture is sorted) and folds the rest into
    the tail, in log space."""
    K = num_speculative_tokens
    kc = cap.topk_ids.shape[-1]
    k = kc if topk is None else min(topk, kc)
    ids_np = np.asarray(cap.topk_ids, dtype=np.int64)
    lps_np = np.array(cap.topk_logprobs, dtype=np.float32)  # a copy: Arrow's read-only buffers trouble torch
    N = len(cap.accepted)
    ids = torch.zeros(N, K, k, dtype=torch.long)
    lps = torch.full((N, K, k), -torch.inf)
    tail = torch.full((N, K), -torch.inf)
    valid = torch.tensor([min(len(y), K) for y in cap.drafted], dtype=torch.long)
    for i, v in enumerate(valid.tolist()):
        ids[i, :v] = torch.from_numpy(ids_np[i, :v, :k])
        vals = torch.from_numpy(lps_np[i, :v])
        lps[i, :v] = vals[:, :k]
        t = torch.from_numpy(np.array(cap.log_tail[i, :v], dtype=np.float32))
        tail[i, :v] = torch.cat([t[:, None], vals[:, k:]], -1).logsumexp(-1) if k < kc else t
    return ids, lps, tail, valid


def captured_features(cap: CapturedSteps, length: int) -> torch.Tensor | None:
    """(length, D) the captured feature rows of a committed sequence of ``length`` tokens, or None where the capture
    lacks one the student reads (a prefix-cache hit, a position never handed to the drafter). Rows 0..length-2 are
    the committed tokens' (`verify_capture._last_write`). The last token was an input only where a step is
    anchored on it (the length cap cut that step's tokens; its row 0 is the last write there); otherwise no block
    reads its row, which stays zeros."""
    if cap.features is None or cap.feature_seen is None:
        return None
    need = length if length - 1 in cap.anchor_pos else length - 1
    if len(cap.feature_seen) < need or not bool(cap.feature_seen[:need].all()):
        return None
    out = torch.zeros(length, cap.features.shape[-1], dtype=cap.features.dtype)
    out[:need] = cap.features[:need]
    return out


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype, bfloat16 included, which numpy lacks): `tensor_from_bytes` inverts it."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(tuple(shape))
    )


def payload_bytes(t: TeacherItem) -> int:
    """What one scored sequence ships to the learner (features + teacher)."""
    parts = [
        t.features,
        t.teacher_logprobs,
        t.teacher_topk_ids,
        t.teacher_topk_logprobs,
        t.draft_topm_ids,
        t.teacher_logprobs_at_draft,
        t.teacher_log_tail,
    ]
    return sum(x.numel() * x.element_size() for x in parts if x is not None)


def replay_cost(it: ReplayItem) -> int:
    """Tokens the replay forward of ``it`` scores: the sequence plus every anchor's rejected branch."""
    branch = sum(max(0, len(y) - a - 1) for y, a in zip(it.drafted, it.accepted))
    return len(it.input_ids) + branch


def learner_cost(t: TeacherItem) -> int:
    """The student's work on one sequence: its block positions (plus the sequence the features cover)."""
    return int(t.valid_len.sum()) + len(t.input_ids)


# ---------------------------------------------------------------------------------- the packed replay forward


@dataclass
class PackedBranches:
    """The committed sequence followed by every anchor's rejected branch, scored in ONE forward."""

    input_ids: torch.Tensor  # (T + B,)
    position_ids: torch.Tensor  # (T + B,)
    mask: torch.Tensor  # (T + B, T + B) additive: 0 where attention is allowed, -inf elsewhere
    rows: list[torch.Tensor]  # per anchor: the logit rows that are its teacher positions k = 1..valid


def pack_branches(it: ReplayItem, num_speculative_tokens: int) -> PackedBranches:
    """Block position k of anchor (n, y, a) has context x_{<=n} y_{<k}. For k <= a+1 that is the committed
    stream (row n+k-1). For k >= a+2 the context contains the rejected y_{a+1}: those rows are a branch
    y_{a+1}..y_{K'-1} appended after the stream at positions n+a+1.., attending to x_{<=n+a} and to the earlier
    tokens of its own branch only (a tree mask, as in tree-attention verification)."""
    T = len(it.input_ids)
    ids, pos, rows = list(it.input_ids), list(range(T)), []
    spans: list[tuple[int, int, int]] = []  # (first packed index, length, prefix end n+a inclusive)
    for n, y, a in zip(it.anchor_pos, it.drafted, it.accepted):
        kk = min(len(y), num_speculative_tokens)
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
