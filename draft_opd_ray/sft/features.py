"""Target features for EAGLE-3 SFT: aux-layer hidden states and the target's soft labels, from the HF target.

For every trajectory (prompt + response, T tokens) this computes

* ``features`` (T, A*H): HF ``hidden_states[i]`` for the head's aux layer ids, concatenated (the head's input);
* ``topk_ids`` / ``topk_p`` (T, k): the target distribution at each position restricted to the draft vocabulary,
  renormalised there, truncated to its top k and renormalised again (draft ids, probabilities);
* ``top1`` (T,): the target's argmax over its full vocabulary (target id), for agreement metrics.

:class:`FeatureCache` computes them once for a whole trajectory set, keyed by (trajectories, aux layers, draft
vocabulary, k), into a folder of shards: ``shard_<j>.safetensors`` holds the sequences ``[lo, hi)`` of the set
flat (concatenated, ``offsets`` marks the boundaries), at most ``shard_bytes`` each (a longer sequence alone), and
``index.json``, written last, names them. A shard is written as soon as it is full, so the feature pass never
holds more than one shard in memory; data-parallel ranks each compute every ``world``-th shard on their own
device, then every rank reads the rows it trains on from the shards' memory maps (nothing is loaded whole).
:class:`OnTheFlyFeatures` computes the same tensors per batch instead (for data sets too large to cache). A target forward is several times faster per token than a TTT update, so
caching costs less than one epoch of recomputation and wins from the second epoch on.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draft_opd_ray.device import actor_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class FeatureSpec:
    """What a feature pass computes (module docstring): the inputs of the head's aux layers ``aux_layer_ids``, the
    teacher's top ``topk`` over the draft vocabulary ``draft_ids``; features stored in ``dtype``, the target run
    in ``forward`` (None: `forward_dtype()`)."""

    aux_layer_ids: Sequence[int]
    draft_ids: torch.Tensor
    topk: int = 16
    dtype: torch.dtype = torch.bfloat16
    forward: torch.dtype | None = None


def _alone() -> None:
    """The barrier of a group of one: nothing to wait for."""


@dataclass(frozen=True)
class PassShare:
    """This process's share of a feature pass a data-parallel group computes together: rank ``rank`` of
    ``world_size``; ``barrier`` (every rank of the group calls it) returns once all ranks reached it."""

    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = _alone


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
    """The HF target for the teacher-forced forward, frozen, on this process's device (`actor_device`: a
    learner rank's GPU; the CPU without one)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype or forward_dtype())
    model.eval()
    model.requires_grad_(False)
    return model.to(actor_device())


@torch.no_grad()
def target_features(
    model: Any,
    seqs: Sequence[Sequence[int]],
    aux_layer_ids: Sequence[int],
    draft_ids: torch.Tensor,
    topk: int,
    prompt_lens: Sequence[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One padded target forward over ``seqs`` on the model's device; per sequence (features, topk_ids, topk_p,
    top1), unpadded, on the CPU.

    With ``prompt_lens`` the target's LM head and the soft labels are computed only on the rows the SFT losses
    read (positions >= prompt_len - 1, which predict response tokens); the other rows get zeros. On SmolLM2 the
    49,152-way head is ~20% of a forward and ~30% of the rows are prompt rows."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(list(s))
        mask[b, : len(s)] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
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
    logp = torch.log_softmax(logits[:, draft_ids.to(device)].float(), dim=-1)  # (N, Vd)
    val, idx = logp.topk(topk, dim=-1)
    top1 = torch.zeros(B, T, dtype=torch.long, device=device)
    ki = torch.zeros(B, T, topk, dtype=torch.long, device=device)
    kp = torch.zeros(B, T, topk, device=device)
    top1[rows], ki[rows], kp[rows] = (
        logits.argmax(-1),
        idx,
        torch.softmax(val, dim=-1),
    )  # renormalised over top k
    feats, ki, kp, top1 = feats.cpu(), ki.cpu(), kp.cpu(), top1.cpu()
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


INDEX = "index.json"  # a cache folder's shard list, written once every shard is


def row_bytes(feature_width: int, topk: int, dtype: torch.dtype) -> int:
    """Bytes a shard stores per token: input id, features, top-k ids and probabilities, top-1 id."""
    return 4 + feature_width * dtype.itemsize + topk * (4 + 2) + 4


def plan_shards(lengths: Sequence[int], bytes_per_token: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges ``[lo, hi)`` of at most ``shard_bytes`` stored bytes each (a sequence longer
    than that alone), covering every sequence in order."""
    out: list[tuple[int, int]] = []
    lo, size = 0, 0
    for i, n in enumerate(lengths):
        if i > lo and size + n * bytes_per_token > shard_bytes:
            out.append((lo, i))
            lo, size = i, 0
        size += n * bytes_per_token
    if lo < len(lengths):
        out.append((lo, len(lengths)))
    return out


def _shard_name(j: int) -> str:
    return f"shard_{j:05d}.safetensors"


class FeatureCache:
    """The features of a whole trajectory set in a folder of shards (module docstring), read lazily: a sequence's
    rows come from its shard's memory map when asked (`get`), and only then."""

    def __init__(self, folder: Path, prompt_lens: Sequence[int]) -> None:
        index = json.loads((folder / INDEX).read_text())
        self.folder, self.prompt_lens = folder, list(prompt_lens)
        self.shards: list[tuple[int, int]] = [(int(lo), int(hi)) for lo, hi in index["shards"]]
        self.offsets: list[int] = [0]
        for n in index["lengths"]:
            self.offsets.append(self.offsets[-1] + int(n))
        self._his = [hi for _, hi in self.shards]
        self._open: dict[
            int, Any
        ] = {}  # shard -> its safetensors handle (a memory map), opened when first read
        self.rows_read = 0  # token rows materialised so far (what `get` read from the maps)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def _shard(self, j: int) -> Any:
        if j not in self._open:
            from safetensors import safe_open

            self._open[j] = safe_open(str(self.folder / _shard_name(j)), framework="pt")
        return self._open[j]

    def get(self, i: int) -> SeqFeatures:
        j = bisect.bisect_right(self._his, i)
        base = self.offsets[self.shards[j][0]]
        a, b = self.offsets[i] - base, self.offsets[i + 1] - base
        f = self._shard(j)

        def rows(name: str) -> torch.Tensor:
            return f.get_slice(name)[a:b]  # type: ignore[no-any-return]

        self.rows_read += b - a
        return SeqFeatures(
            rows("input_ids").long(),
            self.prompt_lens[i],
            rows("features"),
            rows("topk_ids").long(),
            rows("topk_p").float(),
            rows("top1").long(),
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
        folder: Path,
        spec: FeatureSpec,
        share: PassShare = PassShare(),
        *,
        batch_tokens: int = 4096,
        shard_bytes: int = 512 * 2**20,
    ) -> FeatureCache:
        """Compute (or reuse) the cache folder ``folder``. With several ranks (``share``) each computes the shards
        ``j % world_size == rank`` that are not on disk yet (a killed pass keeps its finished shards), then
        ``barrier()`` (every rank of the group calls it) waits for the others before rank 0 writes the index."""
        rank, world_size = share.rank, share.world_size
        if not (folder / INDEX).is_file():
            from draft_opd_ray.models.target import read_target_info

            width = len(spec.aux_layer_ids) * read_target_info(target).hidden_size
            lengths = [len(s) for s in seqs]
            plan = plan_shards(lengths, row_bytes(width, spec.topk, spec.dtype), shard_bytes)
            todo = [j for j in range(rank, len(plan), world_size) if not (folder / _shard_name(j)).is_file()]
            if todo:
                folder.mkdir(parents=True, exist_ok=True)
                model = load_hf_target(target, spec.forward)
                start, tokens = time.monotonic(), sum(sum(lengths[slice(*plan[j])]) for j in todo)
                bar = tqdm(total=tokens, desc="target features", unit="tok", disable=rank != 0)
                for j in todo:
                    lo, hi = plan[j]
                    _write_shard(
                        model,
                        seqs[lo:hi],
                        prompt_lens[lo:hi],
                        folder / _shard_name(j),
                        spec.aux_layer_ids,
                        spec.draft_ids,
                        topk=spec.topk,
                        dtype=spec.dtype,
                        batch_tokens=batch_tokens,
                        width=width,
                    )
                    bar.update(sum(lengths[lo:hi]))
                bar.close()
                log.info(
                    "target features: %d tokens in %.0f s (rank %d)", tokens, time.monotonic() - start, rank
                )
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the target's memory goes back before the draft trains
            share.barrier()
            if rank == 0:
                tmp = folder / (INDEX + ".tmp")
                tmp.write_text(json.dumps({"shards": plan, "lengths": lengths}))
                os.replace(tmp, folder / INDEX)
            share.barrier()
        return cls(folder, prompt_lens)


def _write_shard(
    model: Any,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    path: Path,
    aux_layer_ids: Sequence[int],
    draft_ids: torch.Tensor,
    *,
    topk: int,
    dtype: torch.dtype,
    batch_tokens: int,
    width: int,
) -> None:
    """The features of ``seqs`` (one shard) into ``path``, atomically; buffers of this shard only."""
    from safetensors.torch import save_file

    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    total = offsets[-1]
    feats = torch.empty(total, width, dtype=dtype)  # (N, A*H): the shard's tokens flat
    tk_ids = torch.empty(total, topk, dtype=torch.int32)
    tk_p = torch.empty(total, topk, dtype=torch.float16)
    top1 = torch.empty(total, dtype=torch.int32)
    for batch in length_batches([len(s) for s in seqs], batch_tokens):
        res = target_features(
            model, [seqs[i] for i in batch], aux_layer_ids, draft_ids, topk, [prompt_lens[i] for i in batch]
        )
        for i, (f, ki, kp, t1) in zip(batch, res):
            a, b = offsets[i], offsets[i + 1]
            feats[a:b], tk_ids[a:b], tk_p[a:b], top1[a:b] = f.to(dtype), ki.int(), kp.half(), t1.int()
    tensors = {
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "features": feats,
        "topk_ids": tk_ids,
        "topk_p": tk_p,
        "top1": top1,
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


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
