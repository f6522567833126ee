"""Learner: a DeepSpeed engine over the draft that computes the student side of Draft-OPD replay and steps.

One call to `step` is one optimizer step over a global batch of anchors. The objective is normalised by the
global denominator (docs/design.md, "Objective"), computed from the anchors before any forward, so the loss does not
depend on how the batch is split into micro-batches or data-parallel ranks. Weights for the rollout
workers come out in the draft's checkpoint names (`rollout_state`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from draft_opd_ray.algo.loss import FullInputs, LossSpec, TopkInputs, denominator, objective_terms
from draft_opd_ray.distributed import init_process_group
from draft_opd_ray.opd.batch import TeacherItem


def lr_lambda(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    warm = max(1, int(total * warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    if schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def split_mini_batches(batch: Sequence[TeacherItem], parts: int) -> list[list[TeacherItem]]:
    """min(parts, len(batch)) consecutive groups of whole sequences with about equal anchor counts, none empty."""
    if parts < 1:
        raise ValueError(f"mini_batches must be >= 1, got {parts}")
    parts = min(parts, len(batch))
    total = sum(len(b.anchor_pos) for b in batch)
    groups: list[list[TeacherItem]] = [[]]
    seen = 0
    for i, b in enumerate(batch):
        # a new group once this one holds its share of the anchors, or when each later group needs one of the rest
        left = len(batch) - i
        if (
            groups[-1]
            and len(groups) < parts
            and (seen >= total * len(groups) / parts or left <= parts - len(groups))
        ):
            groups.append([])
        groups[-1].append(b)
        seen += len(b.anchor_pos)
    return groups


class Learner:
    def __init__(
        self,
        draft_dir: str,
        target: str,
        *,
        kind: str = "eagle3",
        spec: LossSpec,
        lr: float,
        betas: Sequence[float],
        weight_decay: float,
        warmup_ratio: float,
        schedule: str,
        total_steps: int,
        zero_stage: int,
        grad_clip: float,
        num_threads: int | None = None,
        backend: str = "auto",
    ) -> None:
        import deepspeed

        from draft_opd_ray.opd.students import make_student

        if num_threads:
            torch.set_num_threads(num_threads)
        init_process_group(backend)
        self.target = target
        self.student = make_student(kind, draft_dir, target)
        self.model = self.student.model
        self.spec = spec
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, total_steps, warmup_ratio, schedule)
        )
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": zero_stage},
            "gradient_clipping": grad_clip,
        }
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=opt, lr_scheduler=sched, config=ds_config
        )
        self.version = 0

    def step(self, batch: Sequence[TeacherItem], mini_batches: int = 1) -> dict[str, float]:
        """One Draft-OPD step: `mini_batches` optimizer updates over the step's anchors (verl's PPO mini-batches).

        The sequences are split into `mini_batches` groups of about equal anchor counts, in order; each group is
        one optimizer update normalised by its own denominator. The replay forward, which dominates a step's cost,
        is paid once for all of them. `version` counts calls (published weight versions), not updates.
        """
        groups = split_mini_batches(batch, mini_batches)
        rows = [self._update(g) for g in groups]
        self.version += 1
        done = [r for r in rows if "skipped" not in r]
        if not done:
            return {"skipped": 1.0}
        out: dict[str, float] = {}
        for r in done:
            for k, v in r.items():
                out[k] = out.get(k, 0.0) + v
        for k in ("loss", "denominator"):
            out[k] /= len(done)
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        out["updates"] = float(len(done))
        return out

    def _update(self, batch: Sequence[TeacherItem]) -> dict[str, float]:
        K = batch[0].drafted.shape[1]
        acc = torch.cat([b.accepted for b in batch])
        valid = torch.cat([b.valid_len for b in batch])
        global_den = denominator(acc, valid, K, self.spec)
        if global_den <= 0:
            return {"skipped": 1.0}
        total = None
        sums: dict[str, float] = {}
        flops = 0.0
        for b in batch:  # one micro-batch per sequence; gradients add up to the whole-batch gradient
            hidden = self.student.block_hidden(b)  # (N, K, H)
            mask = torch.arange(K)[None, :] < b.valid_len[:, None]  # (N, K)
            inputs: FullInputs | TopkInputs
            if self.spec.estimator == "topk":
                if b.teacher_topk_ids is None or b.teacher_topk_logprobs is None:
                    raise ValueError("loss.estimator=topk needs the replay's topk payload")
                inputs = TopkInputs(
                    student_logits=hidden[mask] @ self.student.lm_head.T,
                    teacher_ids=b.teacher_topk_ids[mask],
                    teacher_logprobs=b.teacher_topk_logprobs[mask],
                )
            else:
                if b.teacher_logprobs is None:
                    raise ValueError(f"loss.estimator={self.spec.estimator} needs the replay's full payload")
                inputs = FullInputs(
                    hidden=hidden[mask],
                    lm_head=self.student.lm_head,
                    teacher_logits=b.teacher_logprobs[mask],
                )
            terms = objective_terms(inputs, b.accepted, b.valid_len, K, self.spec)
            flops += self.student.flops(b)
            part = terms.numerator / global_den
            total = part if total is None else total + part
            for k, v in terms.metrics.items():
                if k.startswith("n_") or k in ("rej_weight",):
                    sums[k] = sums.get(k, 0.0) + float(v)
        assert total is not None
        self.engine.backward(total)
        self.engine.step()
        return {
            "loss": float(total.detach()),
            "anchors": float(len(acc)),
            "denominator": global_den,
            "flops_draft_step": flops,
            **sums,
        }

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The draft's weights in the names its exported folder (and so vLLM's reloader) uses."""
        return self.student.rollout_state()

    def save(self, out_dir: str) -> str:
        return self.student.save(out_dir)

    def optimizer_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.engine.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
