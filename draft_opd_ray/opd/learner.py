"""Learner: a DeepSpeed engine over the draft that computes the student side of Draft-OPD replay and steps.

One call to `step` is one optimizer step over a global batch of anchors. The objective is normalised by the
global denominator (docs/design.md, "Objective"), computed from the anchors before any forward, so the loss does not
depend on how the batch is split into micro-batches or data-parallel ranks. Weights for the rollout
workers come out in the draft's checkpoint names (`rollout_state`).

`objective` "sft_on_rollouts" (the control without the on-policy signal): the blocks are the committed
continuations themselves, and the loss is cross-entropy on those committed tokens, normalised by their count.
"sft_on_rollouts_soft" (the same control with the teacher's soft labels): the same blocks, all of them accepted,
so the Draft-OPD objective reduces to forward KL to the teacher's top-k at every committed position.
The trained weights, the AdamW + DeepSpeed engine and the schedule are the SFT arm's (`draft_opd_ray.optim`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draft_opd_ray.algo.loss import (
    FullInputs,
    ObjectiveTerms,
    TokenInputs,
    TopkInputs,
    denominator,
    objective_terms,
    sft_terms,
)
from draft_opd_ray.checkpoint import plain
from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, LossConfig, OptimConfig
from draft_opd_ray.device import actor_device, node_threads
from draft_opd_ray.distributed import all_reduce_sum, init_process_group, world
from draft_opd_ray.opd.batch import committed_blocks
from draft_opd_ray.optim import (
    build_engine,
    load_optimizer_state,
    optimizer_state,
    step_with_grad_norm,
    trainable_parameters,
    update_lr_factor,
)
from draft_opd_ray.wire import TeacherItem


def split_mini_batches(batch: Sequence[TeacherItem], parts: int) -> list[list[TeacherItem]]:
    """min(parts, len(batch)) consecutive groups of whole sequences with about equal anchor counts, none empty."""
    return [[batch[i] for i in g] for g in split_by_anchors([len(b.anchor_pos) for b in batch], parts)]


def split_by_anchors(anchors: Sequence[int], parts: int) -> list[list[int]]:
    """`split_mini_batches` on the sequences' anchor counts alone: the groups' indices (what the driver can
    compute from `TeacherSummary`s without the items)."""
    if parts < 1:
        raise ValueError(f"mini_batches must be >= 1, got {parts}")
    parts = min(parts, len(anchors))
    total = sum(anchors)
    groups: list[list[int]] = [[]]
    seen = 0
    for i, n in enumerate(anchors):
        # a new group once this one holds its share of the anchors, or when each later group needs one of the rest
        left = len(anchors) - i
        if (
            groups[-1]
            and len(groups) < parts
            and (seen >= total * len(groups) / parts or left <= parts - len(groups))
        ):
            groups.append([])
        groups[-1].append(i)
        seen += n
    return groups


def _fetch(groups: Sequence[Sequence[Any]]) -> list[list[TeacherItem]]:
    """The groups with every object reference replaced by its `TeacherItem` (one `ray.get` for all of them)."""
    if all(isinstance(t, TeacherItem) for g in groups for t in g):
        return [list(g) for g in groups]
    import ray

    refs = list(
        dict.fromkeys(t for g in groups for t in g)
    )  # once each (`learner.epochs` repeats the groups)
    got = dict(zip(refs, ray.get(refs)))
    return [[got[t] for t in g] for g in groups]


def student_vocabulary(draft_ids: Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
    """(max id + 1,) target id -> student vocabulary index (-1: not in it), on ``device``; None: the student has
    the target's vocabulary."""
    if draft_ids is None:
        return None
    to_student = torch.full((max(draft_ids) + 1,), -1, dtype=torch.long, device=device)
    to_student[torch.tensor(list(draft_ids), device=device)] = torch.arange(len(draft_ids), device=device)
    return to_student


@dataclass(frozen=True)
class LearnerRun:
    """What only the run knows about one learner rank (the rest is `draft.*`, `loss.*`, `optim.*`, `learner.*`):
    the draft folder it starts from, the target's folder, ``total_steps`` optimizer updates of the whole run (the
    schedule's length); ``rank`` of a data-parallel group of ``world_size`` learner actors meeting at rank 0's
    ``master`` (address, port; one rank needs none); its torch threads: ``cpu_share`` (reserved cores, sharers)
    sets them from this node's cores (`device.node_threads`), else ``num_threads`` when given."""

    draft_dir: str
    target: str
    total_steps: int
    rank: int = 0
    world_size: int = 1
    master: tuple[str, int] | None = None
    num_threads: int | None = None
    cpu_share: tuple[int, int] | None = None


class Learner:
    def __init__(
        self,
        run: LearnerRun,
        draft: DraftConfig,
        loss: LossConfig,
        optim: OptimConfig,
        learner: LearnerConfig,
    ) -> None:
        """The student of `draft.kind` (its LM head trained with `draft.train_lm_head`), the objective `loss.*`,
        AdamW and its schedule `optim.*`, the DeepSpeed engine `learner.*` (``auto`` precision resolved on this
        rank's node, not the driver's)."""
        from draft_opd_ray.device import resolve_dtype
        from draft_opd_ray.drafts.registry import draft_kind

        if run.cpu_share is not None:
            torch.set_num_threads(node_threads(*run.cpu_share))
        elif run.num_threads:
            torch.set_num_threads(run.num_threads)
        init_process_group(learner.backend, rank=run.rank, world_size=run.world_size, master=run.master)
        self.device = actor_device()
        self.target = run.target
        self.student = draft_kind(draft.kind).student(run.draft_dir, run.target)
        self.model = self.student.model
        self.spec, self.objective = loss, loss.objective
        self.engine, _, self.scheduler = build_engine(
            self.model,
            trainable_parameters(self.model, draft.kind, draft.train_lm_head),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            zero_stage=learner.zero_stage,
            dtype=resolve_dtype(learner.dtype),
            grad_clip=optim.grad_clip,
            lr_lambda=lambda s: update_lr_factor(s, run.total_steps, optim.warmup_ratio, optim.schedule),
        )
        self.version = 0
        self.grad_clip = optim.grad_clip
        self.to_student = student_vocabulary(self.student.draft_ids, self.device)

    def step(self, batch: Sequence[TeacherItem], mini_batches: int = 1) -> dict[str, float]:
        """One Draft-OPD step: `mini_batches` optimizer updates over the step's anchors (verl's PPO mini-batches).

        The sequences are split into `mini_batches` groups of about equal anchor counts, in order; each group is
        one optimizer update normalised by its own denominator. The replay forward, which dominates a step's cost,
        is paid once for all of them. `version` counts calls (published weight versions), not updates.
        """
        return self.step_shards(split_mini_batches(batch, mini_batches))

    def step_shards(self, groups: Sequence[Sequence[TeacherItem]]) -> dict[str, float]:
        """One Draft-OPD step of this rank: one optimizer update per group, of this rank's share of that group
        (possibly none). Every rank of the group gets the same number of groups; the denominator of each update
        is summed over the ranks first, so the ranks' gradients add up to the whole group's. Returns this rank's
        sums (the driver adds the ranks': `LearnerGroup.step`). The items may come as object references (the
        loop's path: `ReplayGroup.score_refs`): they are fetched here, from the replay actors' nodes."""
        rows = [self._update(g) for g in _fetch(groups)]
        nonfinite = float(sum("nonfinite" in r for r in rows))
        done = [r for r in rows if "skipped" not in r and "nonfinite" not in r]
        if not done:  # nothing applied: the weights are still the last published version
            return {"skipped": 1.0, "nonfinite_updates": nonfinite}
        self.version += 1
        out: dict[str, float] = {}
        for r in done:
            for k, v in r.items():
                out[k] = out.get(k, 0.0) + v
        for k in ("loss", "denominator", "grad_norm"):
            out[k] /= len(done)
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        out["updates"] = float(len(done))
        out["nonfinite_updates"] = nonfinite
        return out

    def _student_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> the student's vocabulary (-1 where it has no such token), on the map's device (the
        learner's) whatever device ``target_ids`` come on."""
        if self.to_student is None:
            return target_ids
        ids = target_ids.to(self.to_student.device)
        inside = ids < len(self.to_student)
        return torch.where(inside, self.to_student[ids.clamp(max=len(self.to_student) - 1)], -1)

    def _sft_labels(self, b: TeacherItem) -> tuple[torch.Tensor, torch.Tensor]:
        """sft_on_rollouts: (N, K) the committed tokens in the student's vocabulary, and (N, K) where they count
        (valid block positions with a committed token the student has); on the labels' device."""
        labels = self._student_ids(committed_blocks(b))
        K = labels.shape[1]
        mask = torch.arange(K, device=labels.device)[None, :] < b.valid_len.to(labels.device)[:, None]
        return labels, mask & (labels >= 0)

    def _inputs(
        self, b: TeacherItem, rows: torch.Tensor, mask: torch.Tensor
    ) -> FullInputs | TopkInputs | TokenInputs:
        """The estimator's inputs at the valid block positions (``rows``: student hidden states there)."""
        lm_head = self.student.lm_head
        est = self.spec.estimator
        if est == "topk":
            if b.teacher_topk_ids is None or b.teacher_topk_logprobs is None:
                raise ValueError("loss.estimator=topk needs the replay's topk payload (teacher.topk set)")
            own = b.draft_topm_ids, b.teacher_logprobs_at_draft  # the draft's own top-m (`loss.draft_topm`)
            return TopkInputs(
                rows @ lm_head.T,
                b.teacher_topk_ids[mask],
                b.teacher_topk_logprobs[mask],
                own[0][mask] if own[0] is not None else None,
                own[1][mask] if own[1] is not None else None,
                b.teacher_log_tail[mask] if b.teacher_log_tail is not None else None,
            )
        if b.teacher_logprobs is None:
            raise ValueError(f"loss.estimator={est} needs the replay's full payload (teacher.topk=null)")
        teacher = b.teacher_logprobs[mask]  # (T, Vd)
        if est == "full":
            return FullInputs(rows, lm_head, teacher)
        drafted = self._student_ids(b.drafted)[mask]
        committed = self._student_ids(committed_blocks(b))[mask]
        # past the stream (k > a+1: reverse KL only, the forward term has weight 0 there) or outside a reduced
        # draft vocabulary: the drafted id stands in. At the correction position a+1 the latter makes the Bernoulli
        # forward KL act on the rejected drafted token instead of the committed one (`token` estimator only; the
        # default `topk` has no such case)
        committed = torch.where(committed >= 0, committed, drafted)
        return TokenInputs(
            rows @ lm_head.T,
            committed,
            drafted,
            teacher.gather(-1, committed[:, None])[:, 0],
            teacher.gather(-1, drafted[:, None])[:, 0],
        )

    def _terms(self, b: TeacherItem) -> ObjectiveTerms:
        """This sequence's objective terms (numerator with grad; divide by the global denominator)."""
        b = b.to(self.device)
        K = b.drafted.shape[1]
        hidden = self.student.block_hidden(b)  # (N, K, H)
        mask = torch.arange(K, device=self.device)[None, :] < b.valid_len[:, None]  # (N, K)
        if self.objective == "sft_on_rollouts":
            labels, keep = self._sft_labels(b)
            return sft_terms(hidden[keep] @ self.student.lm_head.T, labels[keep])
        return objective_terms(self._inputs(b, hidden[mask], mask), b.accepted, b.valid_len, K, self.spec)

    def _denominator(self, batch: Sequence[TeacherItem]) -> float:
        """This rank's share of the denominator, from the anchors alone (before any forward)."""
        K = batch[0].drafted.shape[1]
        if self.objective == "sft_on_rollouts":  # the items may be on the CPU (as they arrive) or the device
            return float(sum(int(self._sft_labels(b)[1].sum()) for b in batch))
        acc = torch.cat([b.accepted for b in batch])
        valid = torch.cat([b.valid_len for b in batch])
        return denominator(acc, valid, K, self.spec)

    def _update(self, batch: Sequence[TeacherItem]) -> dict[str, float]:
        (global_den,) = all_reduce_sum([self._denominator(batch) if batch else 0.0])
        if global_den <= 0:  # the same on every rank: all skip together
            return {"skipped": 1.0}
        # a rank without data still joins the gradient all-reduce, with zeros
        total: torch.Tensor = sum(
            (p.sum() * 0.0 for p in self.engine.module.parameters() if p.requires_grad),
            torch.zeros((), device=self.device),
        )
        sums: dict[str, float] = {}
        flops = 0.0
        for b in batch:  # one micro-batch per sequence; gradients add up to the whole-batch gradient
            terms = self._terms(b)
            flops += self.student.flops(b)
            total = total + terms.numerator / global_den
            for k, v in terms.metrics.items():
                if k.startswith("n_") or k in ("rej_weight",):
                    sums[k] = sums.get(k, 0.0) + float(v)
        self.engine.backward(total * world()[1])  # DeepSpeed averages gradients over the data-parallel ranks
        (bad,) = all_reduce_sum([0.0 if self._finite(total) else 1.0])
        if bad:  # on every rank alike: nothing applied, the lr schedule does not advance
            self.engine.optimizer.zero_grad(set_to_none=True)
            self.engine.zero_grad()
            return {"nonfinite": 1.0}
        norm = step_with_grad_norm(self.engine)
        return {
            "loss": float(total.detach()),
            "grad_norm": norm,
            "clipped_updates": float(norm > self.grad_clip > 0),
            "anchors": float(sum(len(b.anchor_pos) for b in batch)),
            "denominator": global_den,
            "flops_draft_step": flops,
            **sums,
        }

    def _finite(self, loss: torch.Tensor) -> bool:
        """Whether the update's loss and this rank's gradients are all finite (under ZeRO-2/3 the gradients live
        in DeepSpeed's partitions, not in ``p.grad``: there the loss is what is checked)."""
        if not bool(torch.isfinite(loss.detach()).all()):
            return False
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def world_size(self) -> int:
        """The size of the data-parallel group this rank joined."""
        return world()[1]

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The draft's weights in the names its exported folder (and so vLLM's reloader) uses."""
        return self.student.rollout_state()

    def save(self, out_dir: str) -> str:
        return self.student.save(out_dir)

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer, schedule and version as CPU tensors and plain data: the driver (which may have no
        GPU) holds it and writes it with `torch.save`; the resume reads it with `checkpoint.load_state`."""
        return {
            "optimizer": optimizer_state(self.engine.optimizer),
            "scheduler": plain(self.scheduler.state_dict()),
            "version": self.version,
        }

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """`optimizer_state`'s output of the same rank (read on the CPU), onto this rank's device."""
        load_optimizer_state(self.engine.optimizer, state["optimizer"], self.device)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    # ---- NCCL weight sync (`sync/nccl.py`): rank 0 is the sender --------------------------------------

    def nccl_endpoint(self) -> tuple[str, int]:
        from draft_opd_ray.sync.nccl import free_endpoint, require_cuda

        require_cuda("learner")
        return free_endpoint()

    def nccl_open(self, address: str, port: int, world_size: int) -> None:
        """Join a new group as its sender; a group formed before (re-formed after an engine restarted) is
        dropped first."""
        from draft_opd_ray.sync.nccl import NcclSender

        old = getattr(self, "_sender", None)
        if old is not None:
            old.close()
        self._sender = NcclSender(address, port, world_size)

    def nccl_send(self) -> None:
        """Broadcast the current draft (`rollout_state`, as `nccl_plan` announced it) to every engine rank."""
        self._sender.send(self.student.rollout_state())
