"""A server's traffic as the verify-pass capture hands it out: steps of many requests, some still running.

The engine's workers keep every verification step of every request (`rollout/verify_capture.py`) and hand them out
when asked; a request that runs across two takes comes in two chunks, the first with its prompt. `Traffic` joins the
chunks by vLLM's request id (`CapturedSteps.then`) and closes a request at the first take that has no new steps of
it: it finished (or waited a whole poll in the queue: its later steps then come without a prompt and are counted
as `orphans`, not trained on). A closed request becomes a rollout record (`CapturedSteps.record`) whose steps carry
the draft version that served them, and adds to τ by version: committed tokens per verification step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from draft_opd_ray.wire import CapturedSteps, RequestRecord, consistency_error


@dataclass
class Traffic:
    open: dict[str, CapturedSteps] = field(default_factory=dict)
    versions: dict[str, list[int]] = field(default_factory=dict)  # per open request, the version of each step
    requests: int = 0  # closed requests turned into records
    orphans: int = 0  # chunks whose request's first steps this server never saw
    inconsistent: int = 0  # closed requests whose steps do not chain (a step without drafts in between)
    tau_sums: dict[int, list[int]] = field(default_factory=dict)  # version -> [committed tokens, steps]

    def add(self, taken: Mapping[str, CapturedSteps], version: int) -> list[RequestRecord]:
        """Take in one take's steps (served by draft ``version``); returns the requests this take closed."""
        closed = [rid for rid in self.open if rid not in taken]
        out = [r for rid in closed if (r := self._close(rid)) is not None]
        for rid, steps in taken.items():
            if rid in self.open:
                self.open[rid] = self.open[rid].then(steps)
            elif steps.prompt_ids is None:
                self.orphans += 1
                continue
            else:
                self.open[rid] = steps
            self.versions.setdefault(rid, []).extend([version] * steps.num_steps)
        return out

    def _close(self, rid: str) -> RequestRecord | None:
        steps, versions = self.open.pop(rid), self.versions.pop(rid)
        rec = steps.record(rid, versions[0])
        rec.policy_version = versions
        if consistency_error(rec) is not None:
            self.inconsistent += 1
            return None
        self.requests += 1
        for v, a in zip(versions, rec.accepted):
            sums = self.tau_sums.setdefault(v, [0, 0])
            sums[0] += a + 1
            sums[1] += 1
        return rec

    def tau_by_version(self) -> dict[int, float]:
        """Committed tokens per verification step of the closed requests' steps, by the version that drafted them."""
        return {v: round(t / n, 4) for v, (t, n) in sorted(self.tau_sums.items()) if n}
