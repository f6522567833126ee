"""The drafter side of the reference engine (`rollout/reference.py`): the contracts it drafts through and the
base of the feature-conditioned drafters.

`Drafter` proposes K = ``num_speculative_tokens`` tokens per sequence with their draft distributions q; a
`FeatureDrafter` (EAGLE-3, DFlash) is also handed the target's hidden states from the engine's own
verification pass, for positions 0..n-1 of a committed sequence x_0..x_n (the last token's state does not
exist yet), exactly what vLLM's proposers see after a verification step. Called without ``features`` (outside
the engine) a feature drafter runs one target forward itself. Each kind's drafter and its factory
(`DraftKind.drafter`) are in its folder (`drafts/<kind>/drafter.py`).

    drafter = draft_kind("eagle3").drafter(target, draft_dir, target_dir)
    stop = target_stop_token_ids(target_dir)  # every eos id of the target (models/target.py)
    records = speculative_generate(
        target, drafter, prompts, num_speculative_tokens=4, max_new_tokens=64, stop_token_ids=stop
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Seqs = Sequence[list[int]]  # committed token ids per sequence
Gen = torch.Generator | None  # the sampling generator (None: greedy or the global one)
Features = Sequence[torch.Tensor] | None  # per sequence (len - 1, F) target states; None: compute them
Proposal = tuple[list[list[int]], torch.Tensor]  # drafted ids (K per sequence), q (B, K, V)


class Drafter(Protocol):
    def propose(
        self, seqs: Seqs, num_speculative_tokens: int, temperature: float, generator: Gen
    ) -> Proposal:
        """Drafted ids (K per sequence) and the draft's distributions q over them: (B, K, V) probabilities
        (one-hot under greedy)."""
        ...


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter conditioned on target hidden states. The engine hands it, per sequence, the concatenated HF
    ``output_hidden_states[i]`` for i in ``hidden_state_indices`` at positions 0..len(seq)-2: (len(seq)-1, F).
    Without ``features`` it must compute them itself (one target forward)."""

    hidden_state_indices: tuple[int, ...]

    def propose(
        self,
        seqs: Seqs,
        num_speculative_tokens: int,
        temperature: float,
        generator: Gen,
        features: Features = None,
    ) -> Proposal: ...


def right_pad(seqs: Sequence[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, Lmax) and their attention mask (B, Lmax) (1 = real token)."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def padded_forward(
    model: torch.nn.Module, seqs: Sequence[list[int]], hidden_state_indices: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits (B, Lmax, V) in float32 of a causal LM over right-padded sequences, and, when
    ``hidden_state_indices`` is non-empty, the concatenation of those HF ``hidden_states`` entries
    (B, Lmax, F) (padded rows are garbage)."""
    ids, mask = right_pad(seqs)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=bool(hidden_state_indices))
    if not hidden_state_indices:
        return out.logits.float(), None
    feats = torch.cat([out.hidden_states[i] for i in hidden_state_indices], dim=-1)
    return out.logits.float(), feats


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probabilities of ``logits`` at ``temperature``; one-hot on the argmax when greedy (0)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


class FeatureDrafterBase:
    """Shared plumbing: pad sequences and their features, call the model's ``propose``."""

    def __init__(self, target: nn.Module, draft: Any) -> None:
        self.target = target
        self.draft = draft.eval()
        self.hidden_state_indices: tuple[int, ...] = tuple(draft.hidden_state_indices)

    def _check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")

    @torch.no_grad()
    def propose(
        self,
        seqs: Seqs,
        num_speculative_tokens: int,
        temperature: float,
        generator: Gen,
        features: Features = None,
    ) -> Proposal:
        """Drafted target ids (K per sequence) and q (B, K, V) over the target vocabulary (one-hot if greedy).

        features[b]: (len(seqs[b]) - 1, F) target states of every position but the last; None = compute them.
        """
        self._check_num_speculative_tokens(num_speculative_tokens)
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
            ids.to(dev),
            feats.to(dev),
            lengths,
            num_speculative_tokens,
            temperature=temperature,
            generator=generator,
        )
        return drafted.tolist(), q.float().cpu()
