"""Where Draft-OPD's teacher comes from (`teacher.source`, docs/design.md "The teacher from the verification
pass"): `verify`, the rows the rollout's verification pass computed (captured in the workers,
`rollout/verify_capture.py`), or `replay`, a second target forward over the draft's blocks (`opd/replay.py`).

`verify` is the default and applies wherever the capture holds what the loss reads: Draft-OPD's `topk` estimator on
recorded blocks. Everything else takes the replay, and `teacher_source` says why in one line (preflight prints it):

* the controls (`loss.objective=sft_on_rollouts*`) score committed continuations, not drafted blocks;
* `loss.estimator=full|token` needs the whole teacher distribution; the capture keeps a top-k and its tail;
* `replay.mode=redraft` (and random anchors, which need it) scores the current draft's blocks, which no
  verification pass saw.

Under `verify` the support of the topk estimator is the teacher's top-k and its tail: the draft's own top-m
(`loss.draft_topm`) needs the teacher at ids the verification did not rank, so it is not used there
(measured in docs/LOG.md: the share of the draft's top-m mass outside the captured top-k). Imports only the schema.
"""

from __future__ import annotations

from dataclasses import dataclass

from draft_opd_ray.config.schema import LossConfig, ReplayConfig, TeacherConfig


@dataclass(frozen=True)
class TeacherSource:
    name: str  # "verify" | "replay"
    why: str

    @property
    def verify(self) -> bool:
        return self.name == "verify"


def teacher_source(teacher: TeacherConfig, loss: LossConfig, replay: ReplayConfig) -> TeacherSource:
    """The source a config gets and why (module docstring)."""
    if teacher.source == "replay":
        return TeacherSource("replay", "teacher.source=replay")
    if loss.objective != "opd":
        return TeacherSource(
            "replay", f"loss.objective={loss.objective} scores committed continuations, not drafted blocks"
        )
    if loss.estimator != "topk" or teacher.topk is None:
        return TeacherSource(
            "replay",
            f"loss.estimator={loss.estimator} needs the whole teacher distribution; the capture keeps a top-k",
        )
    if replay.mode == "redraft":
        return TeacherSource(
            "replay", "replay.mode=redraft scores the current draft's blocks, which no verification pass saw"
        )
    topm = "; loss.draft_topm unused: the pass ranked no other ids" if loss.draft_topm else ""
    return TeacherSource(
        "verify",
        f"top-{teacher.topk} and tail per drafted position from the rollouts' verification pass{topm}",
    )


def describe_source(
    teacher: TeacherConfig, loss: LossConfig, replay: ReplayConfig, kind: str, captured: bool, features: bool
) -> str:
    """The preflight line: which source, why, and what target forward the replay still runs for a draft of ``kind``
    that conditions on target ``features``, ``captured`` with the teacher where its drafter is handed them."""
    src = teacher_source(teacher, loss, replay)
    if not src.verify:
        return f"teacher: replay ({src.why})"
    if captured:
        forward = f"{kind} features captured too (rollout prefix cache off): no replay target forward"
    elif features:
        forward = f"the replay's target runs its decoder over committed tokens only, for the {kind} features"
    else:
        forward = "no replay target forward"
    return f"teacher: verify ({src.why}); {forward}"
