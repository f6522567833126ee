"""The server's spec-decode counters by draft version, on vLLM's own Prometheus `/metrics`.

vLLM counts drafts, drafted tokens and accepted tokens for the whole engine (`vllm:spec_decode_num_drafts_total`
and its siblings); a server whose draft changes needs them by version. These are the same three counts, labelled
with `draft_version`, from the requests the learning task closes (so they trail vLLM's by a poll), plus the
version served and the learner's decisions:

    draft_opd_ray:spec_decode_num_drafts_total{draft_version="2"}          verification steps drafted by version 2
    draft_opd_ray:spec_decode_num_draft_tokens_total{draft_version="2"}    tokens it drafted
    draft_opd_ray:spec_decode_num_accepted_tokens_total{draft_version="2"} of them accepted
    draft_opd_ray:draft_version                                            the version served now
    draft_opd_ray:draft_decisions_total{decision="published"}              candidates published, refused, ...

Mean acceptance length of a version, as vLLM defines it: 1 + accepted_tokens / drafts. They go into the registry
vLLM's `/metrics` reads (prometheus_client's default one, or its multiprocess files when vLLM runs several API
server processes), so a Prometheus that scrapes vLLM gets them with no new route.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draft_opd_ray.wire import RequestRecord

PREFIX = "draft_opd_ray:"


class VersionCounters:
    def __init__(self, registry: Any = None) -> None:
        """The counters, registered in ``registry`` (default: prometheus_client's, which vLLM's `/metrics` reads)."""
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = REGISTRY if registry is None else registry
        by = ["draft_version"]
        self.drafts = Counter(
            f"{PREFIX}spec_decode_num_drafts", "Verification steps, by draft version.", by, registry=reg
        )
        self.draft_tokens = Counter(
            f"{PREFIX}spec_decode_num_draft_tokens", "Drafted tokens, by draft version.", by, registry=reg
        )
        self.accepted = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens",
            "Accepted drafted tokens, by draft version.",
            by,
            registry=reg,
        )
        self.version = Gauge(
            f"{PREFIX}draft_version",
            "The draft version served.",
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self.decisions = Counter(
            f"{PREFIX}draft_decisions",
            "The learner's candidates and rollbacks, by decision.",
            ["decision"],
            registry=reg,
        )
        self.version.set(0)

    def add(self, records: Sequence[RequestRecord]) -> None:
        """The closed requests' verification steps, each counted under the version that drafted it."""
        for r in records:
            for version, drafted, accepted in zip(r.policy_version, r.drafted, r.accepted, strict=True):
                v = str(version)
                self.drafts.labels(v).inc()
                self.draft_tokens.labels(v).inc(len(drafted))
                self.accepted.labels(v).inc(accepted)

    def decided(self, decision: str, served: int) -> None:
        """A candidate's (or a rollback's) decision, and the version served after it."""
        self.decisions.labels(decision).inc()
        self.version.set(served)
