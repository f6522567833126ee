"""Feature-conditioned drafters for the reference engine (draft_opd_ray.rollout.reference): EAGLE-3 and DFlash.

Both implement `FeatureDrafter`: `speculative_generate` hands them the target's hidden states from its own
verification pass, for positions 0..n-1 of a committed sequence x_0..x_n (the last token's state does not
exist yet), exactly what vLLM's proposers see after a verification step:

* EAGLE-3: ``hidden_state_indices`` = ``aux_layer_ids`` (aux id i = HF ``hidden_states[i]`` = input of target
  layer i). Row t of the head consumes (f_t, x_{t+1}); the first draft comes from row n-1, later steps feed the
  head's own pre-norm output (Eagle3Draft.propose).
* DFlash: ``hidden_state_indices`` = ``target_layer_ids`` + 1 (id i = output of layer i, as vLLM adds 1); the
  block [x_n, MASK...] sees context strictly before the anchor n (DFlashDraft.propose).

Called without ``features`` (outside the engine) a drafter runs one target forward itself. The factories at the
end build the drafter of an exported folder of each kind (the `drafter` entry of `models/kinds.py`; a standalone
draft is the reference engine's plain `CausalLMDrafter`).

    drafter = Eagle3Drafter(target, load_eagle3(draft_dir, target_dir))
    stop = target_stop_token_ids(target_dir)  # every eos id of the target (models/target.py)
    records = speculative_generate(target, drafter, prompts, k=4, max_new_tokens=64, stop_token_ids=stop)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from draft_opd_ray.models.dflash import DFlashDraft
from draft_opd_ray.models.eagle3 import Eagle3Draft
from draft_opd_ray.rollout.reference import CausalLMDrafter, padded_forward, right_pad


class _FeatureDrafter:
    """Shared plumbing: pad sequences and their features, call the model's ``propose``."""

    def __init__(self, target: nn.Module, draft: Eagle3Draft | DFlashDraft) -> None:
        self.target = target
        self.draft = draft.eval()
        self.hidden_state_indices: tuple[int, ...] = tuple(draft.hidden_state_indices)

    def _check_k(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")

    @torch.no_grad()
    def propose(
        self,
        seqs: Sequence[list[int]],
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        features: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Drafted target ids (k per sequence) and q (B, k, V) over the target vocabulary (one-hot if greedy).

        features[b]: (len(seqs[b]) - 1, F) target states of every position but the last; None = compute them.
        """
        self._check_k(k)
        if min(len(s) for s in seqs) < 2:
            raise ValueError(
                "a feature-conditioned draft needs >= 2 committed tokens (one with a target state)"
            )
        if features is None:
            _, full = padded_forward(self.target, seqs, self.hidden_state_indices)
            assert full is not None
            features = [full[b, : len(s) - 1] for b, s in enumerate(seqs)]
        ids, _ = right_pad(seqs)
        B, T = ids.shape
        feats = features[0].new_zeros((B, T, features[0].shape[-1]))  # (B, T, F), rows >= n stay zero
        for b, (s, f) in enumerate(zip(seqs, features)):
            if f.shape[0] != len(s) - 1:
                raise ValueError(
                    f"sequence {b}: {f.shape[0]} feature rows for {len(s)} tokens (want len - 1)"
                )
            feats[b, : f.shape[0]] = f
        dev = next(self.draft.parameters()).device
        lengths = torch.tensor([len(s) for s in seqs], device=dev)
        drafted, q = self.draft.propose(
            ids.to(dev), feats.to(dev), lengths, k, temperature=temperature, generator=generator
        )
        return drafted.tolist(), q.float().cpu()


class Eagle3Drafter(_FeatureDrafter):
    """EAGLE-3 head (`Eagle3Draft`) proposing k tokens autoregressively on its own hidden states."""

    def __init__(self, target: nn.Module, draft: Eagle3Draft) -> None:
        super().__init__(target, draft)


class DFlashDrafter(_FeatureDrafter):
    """DFlash block drafter (`DFlashDraft`): one forward proposes k <= block_size - 1 tokens."""

    def __init__(self, target: nn.Module, draft: DFlashDraft) -> None:
        super().__init__(target, draft)
        self.block_size = draft.config.block_size

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= self.block_size - 1:
            raise ValueError(f"k must be in [1, block_size - 1 = {self.block_size - 1}], got {k}")


def eagle3_drafter(target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Any:
    from draft_opd_ray.models.eagle3 import load_eagle3

    return Eagle3Drafter(target, load_eagle3(draft_dir, target_dir).float())


def dflash_drafter(target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Any:
    from draft_opd_ray.models.dflash import load_dflash

    return DFlashDrafter(target, load_dflash(draft_dir, target_dir).float())


def standalone_drafter(
    target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]
) -> Any:
    from draft_opd_ray.models.standalone import load_standalone

    return CausalLMDrafter(load_standalone(draft_dir, target_dir).eval())
