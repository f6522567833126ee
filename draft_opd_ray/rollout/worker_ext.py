"""The worker extension every rollout engine's workers carry (`LLM(..., worker_extension_cls=EXTENSION)`).

It adds to the weight receiver (`sync/receiver.py`: new draft versions, the refit proof) the two calls of the
verify-pass capture (`rollout/verify_capture.py`): `install_verify_capture` wraps the model runner's rejection
sampler once the engine is up, `take_verify_capture` hands the captured steps to the engine's owner through
`llm.collective_rpc` (every rank returns its own; rank 0's are the ones the owner reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draft_opd_ray.rollout import verify_capture
from draft_opd_ray.sync.receiver import DraftWeightExtension


class RolloutWorkerExtension(DraftWeightExtension):
    """Worker-side methods; `self` is vLLM's worker. Call with `llm.collective_rpc(name, args=...)`."""

    def install_verify_capture(
        self, topk: int, vocab_ids: Sequence[int] | None, features: bool = False
    ) -> dict[str, Any]:
        """Capture the teacher's top ``topk`` (over ``vocab_ids`` when given) at every verification step from now
        on, and with ``features`` the target's feature rows the drafter is handed. Returns the runner's class name
        and whether the feature rows are tapped (the owner's start-up line says which)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        verify_capture.install(runner, topk, vocab_ids, features)
        return {"runner": type(runner).__name__, "features": verify_capture.taps_features(runner)}

    def take_verify_capture(self) -> dict[str, dict[str, Any]]:
        """Every request's captured steps since the last call, keyed by vLLM's internal request id."""
        capture = getattr(self.model_runner, verify_capture.ATTRIBUTE, None)  # type: ignore[attr-defined]
        if not isinstance(capture, verify_capture.VerifyCapture):
            raise RuntimeError("verify-pass capture is not installed on this engine")
        return {rid: verify_capture.encode(steps) for rid, steps in capture.take().items()}


EXTENSION = f"{RolloutWorkerExtension.__module__}.{RolloutWorkerExtension.__qualname__}"
