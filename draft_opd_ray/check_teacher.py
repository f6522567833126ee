"""Is the teacher captured in the verification pass the replay's teacher? `python -m draft_opd_ray.check_teacher
[main's overrides] [check.* options]`.

It rolls prompts out with verify-pass capture on (`rollout/verify_capture.py`), replays the same records with the
replay actor's target forward (`opd/replay.py`, the whole vocabulary), and compares, at every drafted position
k = 1..K' of every step (rows 0..K'-1 of the verification pass):

* positions and valid lengths: the replay scores a block where the committed sequence holds its context; rows
  whose context the length cap cut off (accepted tokens after the last kept one) are counted, not compared;
* the top-k sets (a difference counts only where the replay's log-prob at a differing id is not tied, within the
  tolerance, with its k-th value);
* max |Δ log-prob| at the captured ids (≤ ``check.tolerance``, default 1e-4, which float32 meets) and the log of
  the mass outside the top-k, each in the draft's vocabulary (EAGLE-3: its d2t ids, renormalised);
* the target's feature rows of an EAGLE-3 draft, captured from what the drafter is handed (max |Δ| against the
  replay's forward, ``max_abs_feature_diff``, same tolerance); null with ``features_captured: false`` for the
  other kinds (DFlash's features come from the replay's forward);
* what the captured top-k leaves out of the draft's own distribution q at the same positions (the draft's top-m,
  m = ``check.draft_topm``, default `loss.draft_topm`, which `teacher.source=verify` cannot use): the mean q mass
  on the draft's top-m (``draft_topm_mass``), on those of its top-m ids outside the teacher's top-k
  (``draft_topm_outside_topk``), and on every id outside the teacher's top-k (``draft_mass_outside_topk``), each
  by k (``check.topk`` and `teacher.topk`: capture wider to see what a wider top-k would keep).

Options (Hydra-style ``key=value``, beside `main`'s overrides): ``check.prompts.*`` a prompt set as `data.eval`
takes it (default: 8 MT-Bench questions; ``check.prompts.source=jsonl check.prompts.path=FILE
check.prompts.text_field=prompt``), ``check.max_new_tokens`` (128), ``check.dtype`` (float32 | bfloat16: the
engine's and the replay's precision), ``check.topk`` (default `teacher.topk`), ``check.tolerance``. The draft is
`draft.path`, else the sft stage's warm start for this config (cached, or trained now).

The last line printed is one JSON object (`positions`, `max_abs_logprob_diff`, `max_abs_feature_diff`,
`topk_mismatches`, `ok`, ...). Exit 0 when ``ok``, 1 on a mismatch, 2 on bad input (one ``error:`` line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draft_opd_ray.config.schema import Config, PromptSetConfig
from draft_opd_ray.errors import ConfigError, DraftOPDError
from draft_opd_ray.wire import RequestRecord, TeacherItem

EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
PREFIX = "check."


def _default_prompts() -> PromptSetConfig:
    return PromptSetConfig(source="mtbench", split="all", max_prompts=8)


@dataclass
class CheckOptions:
    prompts: PromptSetConfig = field(default_factory=_default_prompts)
    max_new_tokens: int = 128
    dtype: str = "float32"  # float32 | bfloat16: the rollout engine's and the replay's target precision
    topk: int | None = None  # None: teacher.topk
    tolerance: float = 1e-4
    draft_topm: int | None = None  # None: loss.draft_topm (16 when that is 0)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"check.dtype: must be float32 or bfloat16, got {self.dtype}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"check.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.topk is not None and self.topk < 1:
            raise ConfigError(f"check.topk: must be >= 1, got {self.topk}")
        if self.draft_topm is not None and self.draft_topm < 1:
            raise ConfigError(f"check.draft_topm: must be >= 1, got {self.draft_topm}")
        self.prompts.check("check.prompts")


def parse(argv: Sequence[str]) -> tuple[list[str], CheckOptions]:
    """(`main`'s overrides, the check's options) from the command line; a `ConfigError` for a bad option."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ours = [a.lstrip("+")[len(PREFIX) :] for a in argv if a.lstrip("+").startswith(PREFIX)]
    rest = [a for a in argv if not a.lstrip("+").startswith(PREFIX)]
    schema = OmegaConf.structured(CheckOptions)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(ours))
        opts = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{PREFIX}{key}: {e.msg}" if key else str(e)) from None
    assert isinstance(opts, CheckOptions)
    return rest, opts


# ------------------------------------------------------------------------------------------------ the comparison


@dataclass
class Comparison:
    positions: int = 0  # drafted positions compared
    steps: int = 0
    cut_by_length: int = 0  # rows the replay cannot score: their context is past the kept response
    valid_len_mismatches: int = 0
    topk_mismatches: int = 0
    max_abs_logprob_diff: float = 0.0
    max_abs_tail_diff: float = 0.0
    uncaptured_requests: int = 0

    def ok(self, tolerance: float) -> bool:
        return (
            self.positions > 0
            and self.valid_len_mismatches == 0
            and self.topk_mismatches == 0
            and self.uncaptured_requests == 0
            and self.max_abs_logprob_diff <= tolerance
            and self.max_abs_tail_diff <= tolerance
        )


def compare(
    records: Sequence[RequestRecord], replayed: Sequence[TeacherItem], tolerance: float
) -> Comparison:
    """The captured teacher of every record against the replay's full teacher (`TeacherItem.teacher_logprobs`,
    log-probs over the same vocabulary) of the same record."""
    from draft_opd_ray.algo.loss import teacher_log_tail

    out = Comparison()
    for rec, item in zip(records, replayed):
        cap = rec.captured
        if cap is None:
            out.uncaptured_requests += int(rec.num_steps > 0 or not rec.error)
            continue
        T = len(rec.prompt_ids) + len(rec.response_ids)
        assert item.teacher_logprobs is not None
        for i, (n, y, a) in enumerate(zip(cap.anchor_pos, cap.drafted, cap.accepted)):
            out.steps += 1
            have, kk = int(item.valid_len[i]), len(y)
            on_stream = max(
                0, min(a + 1, kk, T - n)
            )  # the rows whose context is the kept sequence (`pack_branches`)
            reachable = on_stream + (kk - 1 - a if on_stream == a + 1 and a + 1 < kk else 0)
            if have != reachable:
                out.valid_len_mismatches += 1
            out.cut_by_length += len(y) - have
            if have == 0:
                continue
            lp = item.teacher_logprobs[i, :have].float()  # (v, Vd)
            ids = torch.from_numpy(cap.topk_ids[i, :have]).long()  # (v, k)
            vals = torch.from_numpy(cap.topk_logprobs[i, :have])
            out.max_abs_logprob_diff = max(
                out.max_abs_logprob_diff, float((lp.gather(-1, ids) - vals).abs().max())
            )
            tail = teacher_log_tail(lp, ids)
            got = torch.from_numpy(cap.log_tail[i, :have])
            both = torch.isfinite(tail) & torch.isfinite(got)
            if bool((torch.isfinite(tail) != torch.isfinite(got)).any()):
                out.max_abs_tail_diff = math.inf
            elif bool(both.any()):
                out.max_abs_tail_diff = max(out.max_abs_tail_diff, float((tail - got)[both].abs().max()))
            out.topk_mismatches += _topk_mismatches(lp, ids, tolerance)
            out.positions += have
    return out


def compare_features(
    records: Sequence[RequestRecord], replayed: Sequence[TeacherItem]
) -> tuple[float | None, float | None]:
    """(max |Δ|, max |feature|) of the captured feature rows (`wire.captured_features`) against the replay's
    forward, over every row a block reads: the scale says what an absolute difference is relative to (the residual
    stream of a deep layer runs to hundreds). |Δ| is inf where a record's capture lacks a row the student reads;
    (None, None): nothing captured."""
    from draft_opd_ray.wire import captured_features

    worst: float | None = None
    scale: float | None = None
    for rec, item in zip(records, replayed):
        if rec.captured is None or rec.captured.features is None:
            continue
        got = captured_features(rec.captured, len(item.input_ids))
        if got is None:
            return math.inf, scale
        need = len(item.input_ids) - (0 if len(item.input_ids) - 1 in rec.captured.anchor_pos else 1)
        if need == 0:
            continue
        want = item.features[:need].float()
        diff = float((got[:need].float() - want).abs().max())
        worst = diff if worst is None else max(worst, diff)
        top = float(want.abs().max())
        scale = top if scale is None else max(scale, top)
    return worst, scale


@torch.no_grad()
def draft_mass(student: Any, replayed: Sequence[TeacherItem], ks: Sequence[int], m: int) -> dict[str, Any]:
    """Means over every scored drafted position of the draft's own q (`Student.block_hidden` x `lm_head`, its
    vocabulary, as the learner computes it): its mass on its own top ``m`` (``draft_topm_mass``), and for each
    teacher top-k width in ``ks`` its mass on those top-``m`` ids outside the teacher's top k
    (``draft_topm_outside_topk[k]``) and on every id outside it (``draft_mass_outside_topk[k]``: what the verify
    source's topk estimator sees only as the tail)."""
    top_m, n = 0.0, 0
    outside_m = dict.fromkeys(ks, 0.0)
    outside = dict.fromkeys(ks, 0.0)
    for item in replayed:
        assert item.teacher_logprobs is not None
        hidden = student.block_hidden(item.to("cpu"))  # (N, K, H)
        for j, v in enumerate(item.valid_len.tolist()):
            if v == 0:
                continue
            q = torch.softmax((hidden[j, :v] @ student.lm_head.T).float(), -1)  # (v, Vd)
            qm, ids = q.topk(min(m, q.shape[-1]), dim=-1)
            top_m += float(qm.sum())
            for k in ks:
                in_teacher = torch.zeros_like(q, dtype=torch.bool)
                in_teacher.scatter_(-1, item.teacher_logprobs[j, :v].topk(k, dim=-1).indices, True)
                outside_m[k] += float((qm * ~in_teacher.gather(-1, ids)).sum())
                outside[k] += float((q * ~in_teacher).sum())
            n += v
    n = max(n, 1)
    return {
        "draft_topm_mass": top_m / n,
        "draft_topm_outside_topk": {str(k): v / n for k, v in outside_m.items()},
        "draft_mass_outside_topk": {str(k): v / n for k, v in outside.items()},
    }


def _topk_mismatches(lp: torch.Tensor, ids: torch.Tensor, tolerance: float) -> int:
    """Rows whose captured top-k set differs from the replay's by an id that is not tied with the k-th value."""
    k = ids.shape[-1]
    ref_vals, ref_ids = lp.topk(k, dim=-1)
    kth = ref_vals[:, -1]
    bad = 0
    for j in range(len(lp)):
        diff = set(ref_ids[j].tolist()) ^ set(ids[j].tolist())
        if any(abs(float(lp[j, t]) - float(kth[j])) > tolerance for t in diff):
            bad += 1
    return bad


# ------------------------------------------------------------------------------------------------ the run


def _draft_folder(cfg: Config, target: str, train: list[list[int]], stop: Sequence[int], tmp: Path) -> str:
    """`draft.path`, else the sft stage's warm start (its run files go to ``tmp``; a draft it trains now is also
    cached, and the cached copy is the one returned then)."""
    if cfg.draft.path is not None:
        return str(cfg.draft.path)
    from draft_opd_ray.metrics import MetricsLogger
    from draft_opd_ray.sft.stage import run_sft_stage

    print(
        "[check] no draft.path: the sft stage's warm start for this config (cached, or trained now)",
        flush=True,
    )
    for _ in range(
        2
    ):  # a freshly trained draft is returned from the run dir: the second call finds the cache
        metrics = MetricsLogger(tmp, wandb_mode="disabled")
        try:
            draft = run_sft_stage(
                cfg, target=target, prompts=train, run_dir=tmp, metrics=metrics, stop_token_ids=stop
            )
        finally:
            metrics.close()
        if not draft.is_relative_to(tmp):
            break
    return str(draft)


def run(cfg: Config, opts: CheckOptions) -> dict[str, Any]:
    from draft_opd_ray.driver import load_prompts, prepare_target
    from draft_opd_ray.models.target import stop_token_ids

    cfg.rollout.max_new_tokens = opts.max_new_tokens  # the check's rollouts: their length sizes the engine
    target, tokenizer, info = prepare_target(cfg)
    stop = stop_token_ids(info, tokenizer)
    prompts = load_prompts(cfg, tokenizer, opts.prompts)
    train = load_prompts(cfg, tokenizer, "train") if cfg.draft.path is None else []
    with tempfile.TemporaryDirectory(prefix="check_teacher_") as tmp:
        draft = _draft_folder(cfg, target, train, stop, Path(tmp))
    return _check(cfg, opts, target, stop, prompts, draft)


def _check(
    cfg: Config, opts: CheckOptions, target: str, stop: Sequence[int], prompts: list[list[int]], draft: str
) -> dict[str, Any]:
    """Roll ``prompts`` out with capture, replay the records, compare (module docstring)."""
    from draft_opd_ray.config.schema import LossConfig, ReplayConfig, TeacherConfig
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun
    from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine, all_cores
    from draft_opd_ray.wire import ReplayItem

    kind = draft_kind(cfg.draft.kind)
    kind.check_folder(target, draft)
    features, draft_ids = kind.replay_needs(draft, target)
    topk = opts.topk or cfg.teacher.topk or 16
    engine = SpecDecodeEngine(
        EngineRun(
            target,
            cfg.draft.kind,
            draft,
            dtype=opts.dtype,
            cpu_bind=all_cores(),
            capture_topk=topk,
            capture_vocab=tuple(draft_ids) if draft_ids is not None else None,
            capture_features=kind.features_from_drafter,
        ),
        cfg.draft,
        cfg.target,
        cfg.rollout,
    )
    sampling = Sampling(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=opts.max_new_tokens,
        seed=cfg.seed,
        stop_token_ids=tuple(stop),
    )
    try:
        records = engine.generate(prompts, sampling)
    finally:
        engine.shutdown()
    print(f"[check] {len(records)} requests rolled out with capture; replaying them", flush=True)
    replay = ReplayActor(
        ReplayRun(target, features, draft_ids),  # the features: the draft's own q at the same positions
        cfg.draft,
        TeacherConfig(dtype=opts.dtype, topk=None),
        LossConfig(estimator="full"),
        ReplayConfig(mode="recorded"),
    )
    ran = [r for r in records if not r.error]
    items = replay.score(
        [ReplayItem(r.prompt_ids + r.response_ids, r.anchor_pos, r.drafted, r.accepted, 0) for r in ran]
    )
    c = compare(ran, items, opts.tolerance)
    feature_diff, feature_scale = compare_features(ran, items) if kind.features_from_drafter else (None, None)
    m = opts.draft_topm or cfg.loss.draft_topm or 16
    student = kind.student(draft, target)
    student.model.eval()
    return {
        **dataclasses.asdict(c),
        **draft_mass(student, items, sorted({topk, cfg.teacher.topk or topk}), m),
        "draft_topm": m,
        "max_abs_feature_diff": feature_diff,
        "max_abs_feature": feature_scale,
        "features_captured": feature_diff is not None,
        "feature_conditioned": bool(features),
        "requests": len(ran),
        "draft_kind": cfg.draft.kind,
        "draft": draft,
        "dtype": opts.dtype,
        "topk": topk,
        "tolerance": opts.tolerance,
        "ok": c.ok(opts.tolerance) and (feature_diff is None or feature_diff <= opts.tolerance),
    }


def main(argv: Sequence[str] | None = None) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from draft_opd_ray.config.store import compose

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        overrides, opts = parse(args)
        cfg = compose(overrides)
        result = run(cfg, opts)
    except (DraftOPDError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    print(json.dumps(result, sort_keys=True), flush=True)
    sys.exit(0 if result["ok"] else EXIT_MISMATCH)


if __name__ == "__main__":
    main()
