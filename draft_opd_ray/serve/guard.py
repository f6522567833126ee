"""The guard: a candidate draft version is published only if it is not worse than the serving one on recent traffic
it was not trained on.

Every `serve.holdout_every`-th finished request is held back from training; the guard keeps the last
`serve.guard_requests` of them. A candidate is scored against the serving draft on that slice from what the server
captured, with no engine and no target forward where the capture has the target's features (EAGLE-3): from every
committed position of every held-back request each draft proposes its greedy block, accepted as far as it matches
the committed continuation. At temperature 0 that continuation is the target's own greedy answer, so this is the
acceptance each draft would get from that position (the served chain visits a subset of the positions, the same for
both drafts). A request's counts are (positions, accepted tokens), as in `eval/stats.py`, and the decision reads the
paired difference of pooled τ, candidate minus serving, with its bootstrap interval: published when the interval's
lower end is at least ``-serve.guard_margin`` (a negative margin asks for an improvement), refused otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from draft_opd_ray.drafts.student import load_state
from draft_opd_ray.wire import RequestRecord, captured_features


@dataclass(frozen=True)
class Decision:
    publish: bool
    why: str
    diff: dict[str, float]  # `eval.stats.paired_diff` of candidate minus serving


def decide(
    candidate: Sequence[Mapping[str, float]], serving: Sequence[Mapping[str, float]], margin: float
) -> Decision:
    """Publish when the lower end of the paired difference's 95% interval (pooled τ, candidate − serving) is at
    least ``-margin``."""
    from draft_opd_ray.eval.stats import paired_diff

    d = paired_diff(candidate, serving)
    lo = d["pooled_lo"]
    text = f"τ {d['pooled']:+.4f} [{lo:+.4f}, {d['pooled_hi']:+.4f}] against the serving draft on {d['n']} held-back requests"
    if d["n"] == 0 or not lo >= -margin:
        return Decision(False, f"{text}: the lower end is below {-margin:+g}", d)
    return Decision(True, f"{text}: not worse than {-margin:+g}", d)


class GuardActor:
    """Two copies of the draft, the serving version and the candidate, scored on the same held-back requests."""

    def __init__(self, kind: str, draft_dir: str, target: str, num_speculative_tokens: int) -> None:
        from draft_opd_ray.drafts import registry

        k = registry.draft_kind(kind)
        self.serving = k.student(draft_dir, target)
        self.candidate = k.student(draft_dir, target)
        for s in (self.serving, self.candidate):
            s.model.eval()
        self.aux, _ = k.replay_needs(draft_dir, target)
        self.target, self._model = target, cast(Any, None)
        self.num_speculative_tokens = num_speculative_tokens

    def score(
        self, records: Sequence[RequestRecord], weights: Mapping[str, torch.Tensor]
    ) -> dict[str, list[Any]]:
        """``weights`` into the candidate; both drafts' counts on ``records``: {"candidate": [...], "serving": [...]}."""
        load_state(self.candidate.model, weights)
        out: dict[str, list[Any]] = {"candidate": [], "serving": []}
        with torch.no_grad():
            for r in records:
                ids = torch.tensor(r.prompt_ids + r.response_ids)
                feats = self._features(r, ids) if self.serving.features else None
                anchors = torch.arange(len(r.prompt_ids), len(ids) - 1)
                for name, student in (("candidate", self.candidate), ("serving", self.serving)):
                    blocks = student.greedy_blocks(ids, feats, anchors, self.num_speculative_tokens).tolist()
                    accepted = sum(_matched(r, int(n), y) for n, y in zip(anchors.tolist(), blocks))
                    out[name].append({"steps": len(blocks), "accepted": accepted})
        return out

    def publish(self) -> None:
        """The candidate is served now: it becomes the draft candidates are measured against."""
        load_state(self.serving.model, self.candidate.model.state_dict())

    def _features(self, r: RequestRecord, ids: torch.Tensor) -> torch.Tensor:
        """The target's feature rows of the request: captured by the server's engine, else a target forward."""
        got = captured_features(r.captured, len(ids)) if r.captured is not None else None
        if got is not None:
            return got.float()
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.target, dtype=torch.float32).eval()
        out = self._model.get_decoder()(ids[None], output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1).float()


def _matched(r: RequestRecord, n: int, block: Sequence[int]) -> int:
    """How far a block drafted from position ``n`` matches the committed tokens after it."""
    seq = r.prompt_ids + r.response_ids
    stream = seq[n + 1 : n + 1 + len(block)]
    a = 0
    while a < len(stream) and block[a] == stream[a]:
        a += 1
    return a
