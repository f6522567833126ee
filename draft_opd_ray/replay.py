"""ReplayActor: teacher log-probs (and target features) on the draft's own blocks at the selected anchors
(DESIGN.md §2.3). Runs on the devices that hold the target.

For one committed sequence x (prompt + response, length T) and its anchors (n, y_1..y_K', a):
- one target forward over x gives the features the EAGLE-3 student conditions on and the teacher
  distribution p_k for every k <= a+1 (there the block's context x_{<=n} y_{<k} IS the committed stream);
- the positions after the first rejection (k >= a+2) have the rejected token y_{a+1} in their context: they
  are scored from the prefix KV cache of that same forward, cropped after x_{n+a}, by feeding the branch
  y_{a+1}..y_{K'-1} (prefix KV reuse: one short forward per anchor, not a full re-forward).
Teacher log-probs ship in the draft's vocabulary (EAGLE-3: the d2t ids, renormalised).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

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
    features: torch.Tensor  # (T, A*H) target aux hidden states (HF hidden_states[i], i in aux ids)
    anchor_pos: torch.Tensor  # (N,) long
    drafted: torch.Tensor  # (N, K) long, right-padded with 0
    valid_len: torch.Tensor  # (N,) long, K' <= K positions that have a teacher
    accepted: torch.Tensor  # (N,) long, recorded acceptance (clipped to valid_len)
    replay_accepted: torch.Tensor  # (N,) long, greedy acceptance recomputed by the teacher
    teacher_logprobs: torch.Tensor  # (N, K, Vd) log p_k over the draft vocabulary
    policy_version: int


class ReplayActor:
    def __init__(
        self,
        target: str,
        *,
        aux_layer_ids: Sequence[int],
        draft_ids: Sequence[int] | None,
        k: int,
        dtype: str = "float32",
        num_threads: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
        self.aux = list(aux_layer_ids)
        self.draft_ids = torch.tensor(list(draft_ids)) if draft_ids is not None else None
        self.k = k

    @torch.no_grad()
    def score(self, items: Sequence[ReplayItem]) -> list[TeacherItem]:
        return [self._score_one(it) for it in items]

    def _to_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.draft_ids is not None:
            logits = logits[..., self.draft_ids]
        return torch.log_softmax(logits.float(), dim=-1)

    def _score_one(self, it: ReplayItem) -> TeacherItem:
        ids = torch.tensor(it.input_ids)
        T, N, K = len(it.input_ids), len(it.anchor_pos), self.k
        out = self.model(ids[None], output_hidden_states=True, use_cache=True)
        logits = out.logits[0]  # (T, V)
        feats = torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1)  # (T, A*H)
        cache = out.past_key_values
        drafted = torch.zeros(N, K, dtype=torch.long)
        valid = torch.zeros(N, dtype=torch.long)
        acc = torch.zeros(N, dtype=torch.long)
        replay_acc = torch.zeros(N, dtype=torch.long)
        teacher = None
        for j, (n, y, a) in enumerate(zip(it.anchor_pos, it.drafted, it.accepted)):
            kk = min(len(y), K)
            block = torch.empty(kk, logits.shape[-1])
            on_stream = min(a + 1, kk, T - n)  # k <= a+1 positions present in the committed stream
            block[:on_stream] = logits[n : n + on_stream]
            if on_stream == a + 1 and a + 1 < kk:  # branch after the first rejection
                branch = copy.deepcopy(cache)
                if n + a + 1 < T:
                    branch.crop(n + a + 1 - T)  # negative: drop the tail, keep x_0..x_{n+a}
                pos = torch.arange(n + a + 1, n + kk)[None]
                br = self.model(
                    torch.tensor([y[a : kk - 1]]), past_key_values=branch, position_ids=pos, use_cache=True
                )
                block[a + 1 : kk] = br.logits[0]
                have = kk
            else:
                have = on_stream
            drafted[j, :kk] = torch.tensor(y[:kk])
            valid[j] = have
            acc[j] = min(a, have)
            match = (block[:have].argmax(-1) == drafted[j, :have]).long()
            replay_acc[j] = int(match.cumprod(0).sum())
            lp = self._to_draft_vocab(block)
            if teacher is None:
                teacher = torch.zeros(N, K, lp.shape[-1])
            teacher[j, :kk] = lp
        assert teacher is not None
        return TeacherItem(
            ids,
            feats.float(),
            torch.tensor(it.anchor_pos),
            drafted,
            valid,
            acc,
            replay_acc,
            teacher,
            it.policy_version,
        )
