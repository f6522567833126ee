"""A standalone draft LM in the reference engine: a plain causal LM proposing autoregressively."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from draft_opd_ray.drafts.drafter import sampling_probs
from draft_opd_ray.drafts.standalone.model import load_standalone


class CausalLMDrafter:
    """A standalone draft LM with the target's tokenizer proposes ``num_speculative_tokens`` tokens
    autoregressively: one forward over the left-padded prefixes fills a KV cache, then one single-token
    forward per further draft token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def propose(
        self,
        seqs: Sequence[list[int]],
        num_speculative_tokens: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[list[list[int]], torch.Tensor]:
        L = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, L - len(s) :] = 1
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
        )
        toks, qs = [], []
        for j in range(num_speculative_tokens):
            q = sampling_probs(out.logits[:, -1].float(), temperature)  # (B, V)
            tok = (
                q.argmax(-1) if temperature == 0 else torch.multinomial(q, 1, generator=generator).squeeze(-1)
            )
            toks.append(tok)
            qs.append(q)
            if j == num_speculative_tokens - 1:
                break
            mask = torch.cat([mask, mask.new_ones((len(seqs), 1))], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return torch.stack(toks, dim=1).tolist(), torch.stack(qs, dim=1)  # (B, K, V)


def standalone_drafter(
    target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]
) -> Any:
    return CausalLMDrafter(load_standalone(draft_dir, target_dir).eval())


drafter = standalone_drafter  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
