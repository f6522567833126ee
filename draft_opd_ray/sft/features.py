"""Target features for EAGLE-3 SFT: aux-layer hidden states and the target's soft labels, from the HF target.

For every trajectory (prompt + response, T tokens) this computes

* ``features`` (T, A*H): HF ``hidden_states[i]`` for the head's aux layer ids, concatenated (the head's input);
* ``topk_ids`` / ``topk_p`` (T, k): the target distribution at each position restricted to the draft vocabulary,
  renormalised there, truncated to its top k and renormalised again (draft ids, probabilities);
* ``top1`` (T,): the target's argmax over its full vocabulary (target id), for agreement metrics.

:class:`FeatureCache` computes them once for a whole trajectory set and stores them flat (sequences concatenated,
``offsets`` marks the boundaries) in one safetensors file in bf16/fp16, keyed by (trajectories, aux layers, draft
vocabulary, k); loading is a memory map. :class:`OnTheFlyFeatures` computes the same tensors per batch instead
(for data sets too large to cache). A target forward is several times faster per token than a TTT update, so
caching costs less than one epoch of recomputation and wins from the second epoch on (docs/LOG.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draft_opd_ray.device import resolve_dtype

log = logging.getLogger(__name__)


@dataclass
class SeqFeatures:
    """Features of one sequence (see the module docstring); rows are positions 0..T-1."""

    input_ids: torch.Tensor  # (T,) int64
    prompt_len: int
    features: torch.Tensor  # (T, A*H)
    topk_ids: torch.Tensor  # (T, k) int64 draft ids
    topk_p: torch.Tensor  # (T, k) float
    top1: torch.Tensor  # (T,) int64 target ids


def forward_dtype(name: str = "auto") -> torch.dtype:
    """Precision of the teacher-forced target forward (`teacher.dtype`; auto: bfloat16 where it is fast)."""
    return getattr(torch, resolve_dtype(name))  # type: ignore[no-any-return]


def load_hf_target(target: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype or forward_dtype())
    model.eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def target_features(
    model: Any,
    seqs: Sequence[Sequence[int]],
    aux_layer_ids: Sequence[int],
    draft_ids: torch.Tensor,
    topk: int,
    prompt_lens: Sequence[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One padded target forward over ``seqs``; per sequence (features, topk_ids, topk_p, top1), unpadded.

    With ``prompt_lens`` the target's LM head and the soft labels are computed only on the rows the SFT losses
    read (positions >= prompt_len - 1, which predict response tokens); the other rows get zeros. On SmolLM2 the
    49,152-way head is ~20% of a forward and ~30% of the rows are prompt rows."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(list(s))
        mask[b, : len(s)] = 1
    out = model.get_decoder()(input_ids=ids, attention_mask=mask, output_hidden_states=bool(aux_layer_ids))
    feats = (  # (B, T, A*H); none for a standalone draft
        torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
        if aux_layer_ids
        else out.last_hidden_state.new_zeros(B, T, 0)
    )
    rows = mask.bool()
    if prompt_lens is not None:
        for b, p in enumerate(prompt_lens):
            rows[b, : max(0, p - 1)] = False
    logits = model.get_output_embeddings()(out.last_hidden_state[rows])  # (N, V)
    logp = torch.log_softmax(logits[:, draft_ids].float(), dim=-1)  # (N, Vd)
    val, idx = logp.topk(topk, dim=-1)
    top1 = torch.zeros(B, T, dtype=torch.long)
    ki = torch.zeros(B, T, topk, dtype=torch.long)
    kp = torch.zeros(B, T, topk)
    top1[rows], ki[rows], kp[rows] = (
        logits.argmax(-1),
        idx,
        torch.softmax(val, dim=-1),
    )  # renormalised over top k
    return [
        (feats[b, : len(s)], ki[b, : len(s)], kp[b, : len(s)], top1[b, : len(s)]) for b, s in enumerate(seqs)
    ]


def length_batches(lengths: Sequence[int], batch_tokens: int, seed: int | None = None) -> list[list[int]]:
    """Sequences grouped by similar length into batches of <= batch_tokens padded tokens. ``seed``: equal
    lengths in random order and the batches shuffled (training); None: in index order (the feature pass)."""
    rng = random.Random(seed)
    tie = (lambda i: rng.random()) if seed is not None else (lambda i: i)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], tie(i)))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    if seed is not None:
        rng.shuffle(out)
    return out


class FeatureCache:
    """Flat on-disk features of a whole trajectory set (computed once; memory-mapped afterwards)."""

    def __init__(self, path: Path, prompt_lens: Sequence[int]) -> None:
        from safetensors.torch import load_file

        t = load_file(str(path))
        self.offsets = t["offsets"].tolist()
        self.input_ids, self.features = t["input_ids"], t["features"]
        self.topk_ids, self.topk_p, self.top1 = t["topk_ids"], t["topk_p"], t["top1"]
        self.prompt_lens = list(prompt_lens)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def get(self, i: int) -> SeqFeatures:
        a, b = self.offsets[i], self.offsets[i + 1]
        return SeqFeatures(
            self.input_ids[a:b].long(),
            self.prompt_lens[i],
            self.features[a:b],
            self.topk_ids[a:b].long(),
            self.topk_p[a:b].float(),
            self.top1[a:b].long(),
        )

    @staticmethod
    def key(
        traj_path: Path,
        aux_layer_ids: Sequence[int],
        draft_ids: torch.Tensor,
        topk: int,
        dtype: str,
        forward: torch.dtype | None = None,
    ) -> str:
        h = hashlib.sha256(traj_path.read_bytes())
        h.update(f"{list(aux_layer_ids)}:{topk}:{dtype}".encode())
        fwd = forward or forward_dtype()
        if str(fwd).removeprefix("torch.") != dtype:  # the forward's precision, where it differs
            h.update(f":forward={fwd}".encode())
        h.update(draft_ids.numpy().tobytes())
        return h.hexdigest()[:20]

    @classmethod
    def build(
        cls,
        target: str | os.PathLike[str],
        seqs: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        path: Path,
        aux_layer_ids: Sequence[int],
        draft_ids: torch.Tensor,
        *,
        topk: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        forward: torch.dtype | None = None,
        batch_tokens: int = 4096,
    ) -> FeatureCache:
        """Compute (or reuse) the cache file ``path``; writes it atomically. ``forward``: the target's precision
        (default: `forward_dtype()`), ``dtype``: the stored features'."""
        if not path.is_file():
            from safetensors.torch import save_file

            model = load_hf_target(target, forward)
            n = len(seqs)
            offsets = [0]
            for s in seqs:
                offsets.append(offsets[-1] + len(s))
            total = offsets[-1]
            A_H = len(aux_layer_ids) * model.config.hidden_size
            feats = torch.empty(total, A_H, dtype=dtype)
            tk_ids = torch.empty(total, topk, dtype=torch.int32)
            tk_p = torch.empty(total, topk, dtype=torch.float16)
            top1 = torch.empty(total, dtype=torch.int32)
            start = time.monotonic()
            bar = tqdm(total=total, desc="target features", unit="tok")
            for batch in length_batches([len(s) for s in seqs], batch_tokens):
                res = target_features(
                    model,
                    [seqs[i] for i in batch],
                    aux_layer_ids,
                    draft_ids,
                    topk,
                    [prompt_lens[i] for i in batch],
                )
                for i, (f, ki, kp, t1) in zip(batch, res):
                    a, b = offsets[i], offsets[i + 1]
                    feats[a:b], tk_ids[a:b], tk_p[a:b], top1[a:b] = f.to(dtype), ki.int(), kp.half(), t1.int()
                bar.update(sum(len(seqs[i]) for i in batch))
            bar.close()
            log.info("target features: %d tokens in %.0f s", total, time.monotonic() - start)
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tensors = {
                "offsets": torch.tensor(offsets, dtype=torch.int64),
                "input_ids": ids,
                "features": feats,
            }
            tensors |= {"topk_ids": tk_ids, "topk_p": tk_p, "top1": top1}
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
            del model
            assert n == len(offsets) - 1
        return cls(path, prompt_lens)


class OnTheFlyFeatures:
    """The same interface as :class:`FeatureCache`, computing each sequence's features when asked."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        seqs: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        aux_layer_ids: Sequence[int],
        draft_ids: torch.Tensor,
        topk: int = 16,
        forward: torch.dtype | None = None,
    ) -> None:
        self.model = load_hf_target(target, forward)
        self.seqs, self.prompt_lens = [list(s) for s in seqs], list(prompt_lens)
        self.aux, self.draft_ids, self.topk = list(aux_layer_ids), draft_ids, topk

    def __len__(self) -> int:
        return len(self.seqs)

    def length(self, i: int) -> int:
        return len(self.seqs[i])

    def get_many(self, idx: Sequence[int]) -> list[SeqFeatures]:
        res = target_features(
            self.model,
            [self.seqs[i] for i in idx],
            self.aux,
            self.draft_ids,
            self.topk,
            [self.prompt_lens[i] for i in idx],
        )
        return [
            SeqFeatures(torch.tensor(self.seqs[i]), self.prompt_lens[i], f, ki, kp, t1)
            for i, (f, ki, kp, t1) in zip(idx, res)
        ]

    def get(self, i: int) -> SeqFeatures:
        return self.get_many([i])[0]
