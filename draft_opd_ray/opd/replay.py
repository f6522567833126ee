"""ReplayActor: teacher log-probs (and target features) on the draft's own blocks at the selected anchors
(docs/design.md, "Replay"). Runs on the devices that hold the target; the data contracts and the packing math are
in `wire.py`, the per-kind redraft in each kind's student (`drafts/<kind>/student.py`).

For one committed sequence x (prompt + response, length T) and its anchors (n, y_1..y_K', a):
- one target forward over x gives the features the EAGLE-3 student conditions on and the teacher
  distribution p_k for every k <= a+1 (there the block's context x_{<=n} y_{<k} IS the committed stream);
- the positions after the first rejection (k >= a+2) have the rejected token y_{a+1} in their context: each
  anchor's branch y_{a+1}..y_{K'-1} is appended to the same forward with a tree mask (it sees x_{<=n+a} and
  itself), so the shared prefix is scored once and a sequence with all its anchors costs one forward over
  T + (branch tokens) -- P4 in docs/benchmarks.md.
Teacher log-probs ship in the draft's vocabulary (EAGLE-3: the d2t ids, renormalised).

`replay.mode`: "recorded" scores the blocks the rollout recorded (one forward per sequence). "redraft" first
re-runs the CURRENT draft (the actor holds a copy; the weight sync publishes to it like to the rollout workers)
greedily from every anchor, then scores those blocks: a forward over x for the features the draft conditions on
(none for a standalone LM), the draft's blocks, then the packed forward above. Redrafted blocks take as
"accepted" their leading agreement with the committed stream, which under greedy rollouts is the target's greedy
acceptance; random anchors (no recorded block) need this mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draft_opd_ray.algo.loss import teacher_log_tail
from draft_opd_ray.config.schema import DraftConfig, LossConfig, ReplayConfig, TeacherConfig
from draft_opd_ray.device import actor_device, node_threads
from draft_opd_ray.sync.refit import RefitAck
from draft_opd_ray.wire import (
    ReplayItem,
    TeacherItem,
    TeacherSummary,
    captured_features,
    captured_teacher,
    pack_branches,
)


@dataclass(frozen=True)
class ReplayRun:
    """What only the run knows about a replay actor (the rest is `draft.*`, `teacher.*`, `loss.*`, `replay.*`):
    the target's folder, the draft's feature layers (``aux_layer_ids``) and vocabulary (``draft_ids``; None: the
    target's) as its folder gives them (`DraftKind.replay_needs`), the draft folder (a copy is held for
    `replay.mode=redraft` and `loss.draft_topm`), and its torch threads: ``cpu_share`` (reserved cores, sharers)
    sets them from this node's cores (`device.node_threads`), else ``num_threads`` when given."""

    target: str
    aux_layer_ids: Sequence[int]
    draft_ids: Sequence[int] | None
    draft_dir: str | None = None
    num_threads: int | None = None
    cpu_share: tuple[int, int] | None = None


def replay_draft_topm(loss: LossConfig, teacher: TeacherConfig, replay: ReplayConfig) -> int:
    """`loss.draft_topm` where it is used: Draft-OPD's topk estimator with the replay's teacher (the controls train
    on committed tokens; the verification pass's teacher has no value at ids it did not rank, `opd.source`)."""
    from draft_opd_ray.opd.source import teacher_source

    used = loss.objective == "opd" and loss.estimator == "topk" and teacher.topk is not None
    return loss.draft_topm if used and not teacher_source(teacher, loss, replay).verify else 0


class ReplayActor:
    def __init__(
        self,
        run: ReplayRun,
        draft: DraftConfig,
        teacher: TeacherConfig,
        loss: LossConfig,
        replay: ReplayConfig,
    ) -> None:
        """The teacher is `teacher.*`, the setting the SFT feature pass reads too: the target run in
        `teacher.dtype` (``auto`` resolved on this node, not the driver's) and its probabilities kept per position:
        payload "topk" ships the top `teacher.topk` ids and log-probs, `teacher.topk=null` payload "full", log p_k
        over the whole draft vocabulary (N x K x Vd floats per sequence). Blocks of K = `draft.num_speculative_tokens`.
        `replay.mode` "redraft" holds the draft (`draft.kind`, ``run.draft_dir``) and takes its later versions
        through ``load_draft_weights_file`` / ``load_draft_weights``. `loss.objective=sft_on_rollouts` ships only the
        target features: no teacher distribution is computed. `loss.draft_topm` > 0 where it is used
        (`replay_draft_topm`, payload "topk"): the actor also holds the draft, kept current as in redraft, and
        ships the teacher's log-probs at the draft's own top ``draft_topm`` ids of every block position beside the
        teacher's top-k, so the estimator's support holds the draft's confident tokens."""
        self.payload = "full" if teacher.topk is None else "topk"
        self.topk, self.mode = teacher.topk or 1, replay.mode
        self.teacher = loss.objective != "sft_on_rollouts"
        self.draft_topm = (
            replay_draft_topm(loss, teacher, replay) if self.payload == "topk" and self.teacher else 0
        )
        self.student = None
        self.draft_version = 0
        self.device = actor_device()
        if self.mode == "redraft" or self.draft_topm > 0:
            if run.draft_dir is None:
                raise ValueError(
                    "replay mode redraft and draft_topm > 0 need the draft folder (ReplayRun.draft_dir)"
                )
            from draft_opd_ray.drafts import registry

            self.student = registry.draft_kind(draft.kind).student(run.draft_dir, run.target)
            self.student.model.to(self.device).eval()
        from transformers import AutoModelForCausalLM

        from draft_opd_ray.device import resolve_dtype

        if run.cpu_share is not None:
            torch.set_num_threads(node_threads(*run.cpu_share))
        elif run.num_threads:
            torch.set_num_threads(run.num_threads)
        # `auto` is resolved here: this node's hardware decides, not the driver's
        self.dtype = getattr(torch, resolve_dtype(teacher.dtype))
        self.target = run.target
        self._model: Any = None
        self.aux = list(run.aux_layer_ids)
        # a captured teacher (and captured features) need no target here (`_from_capture`): load on first use
        if not (teacher.source == "verify" and self.mode == "recorded"):
            self._model = self._load_target(AutoModelForCausalLM)
        ids = run.draft_ids
        self.draft_ids = torch.tensor(list(ids), device=self.device) if ids is not None else None
        self.scored = 0  # sequences this actor has scored (its share: `ReplayGroup`)
        self.num_speculative_tokens = draft.num_speculative_tokens

    def _load_target(self, auto: Any) -> Any:
        model = auto.from_pretrained(self.target, dtype=self.dtype)
        return model.to(self.device).eval()

    @property
    def model(self) -> Any:
        """The target (loaded on first use where a captured teacher may make it unneeded)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = self._load_target(AutoModelForCausalLM)
        return self._model

    @torch.no_grad()
    def score(self, items: Sequence[ReplayItem]) -> list[TeacherItem]:
        if self.mode == "redraft":
            items = [self._redraft(it) for it in items]
        self.scored += len(items)
        return [self._score_one(it).to("cpu") for it in items]

    def score_split(self, items: Sequence[ReplayItem]) -> list[Any]:
        """`score` as separate return objects (call with ``num_returns=len(items) + 1``): the summaries the driver
        reads, then every `TeacherItem`, which stays in this node's object store until a learner rank fetches
        it (`ReplayGroup.score_refs`): the driver never holds the features."""
        out = self.score(items)
        return [[TeacherSummary.of(t) for t in out], *out]

    def scored_sequences(self) -> int:
        """How many sequences this actor has scored so far."""
        return self.scored

    # ---- redraft: the current draft's own blocks -----------------------------------------------------------

    def load_draft_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """A new draft version (the names of `Learner.rollout_state`); redraft uses it from the next call on."""
        if self.student is None:
            raise RuntimeError("this replay actor holds no draft (replay mode recorded, draft_topm 0)")
        from draft_opd_ray.drafts.student import load_state

        load_state(self.student.model, weights)
        self.draft_version = int(version)
        return self.draft_version

    def set_draft_version(self, version: int) -> int:
        """The version of the weights it was built with (a resumed run starts at its checkpoint's)."""
        self.draft_version = int(version)
        return self.draft_version

    def load_draft_weights_file(self, path: str, version: int) -> int:
        from safetensors.torch import load_file

        return self.load_draft_weights(load_file(path), version)

    def _redraft(self, it: ReplayItem) -> ReplayItem:
        """`it` with the current draft's greedy blocks from its anchors."""
        assert self.student is not None
        ids = torch.tensor(it.input_ids, device=self.device)
        feats = None
        if self.student.features:  # the target hidden states the draft conditions on
            feats = self._features(ids).float()
        anchors = torch.tensor(it.anchor_pos, device=self.device)
        blocks = self.student.greedy_blocks(ids, feats, anchors, self.num_speculative_tokens)
        drafted, accepted = [], []
        for n, y in zip(it.anchor_pos, blocks.tolist()):  # the stream ends at T-1: a <= T-1-n
            stream = it.input_ids[n + 1 : n + 1 + len(y)]
            a = 0
            while a < len(stream) and a < len(y) and y[a] == stream[a]:
                a += 1
            drafted.append(y)
            accepted.append(a)
        return ReplayItem(it.input_ids, list(it.anchor_pos), drafted, accepted, self.draft_version)

    def _features(self, ids: torch.Tensor) -> torch.Tensor:
        """(T, A*H) the target's hidden states at the draft's feature layers over ``ids``: the decoder stack alone
        (HF `get_decoder`), no LM head, which at a small target's vocabulary is a large share of the forward."""
        decoder = self.model.get_decoder()
        out = decoder(ids[None], output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1)

    def _to_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.draft_ids is not None:
            logits = logits[..., self.draft_ids]
        return torch.log_softmax(logits.float(), dim=-1)

    def _features_only(self, it: ReplayItem, captured: torch.Tensor | None = None) -> TeacherItem:
        """The target features of the committed sequence, no teacher (blocks on the committed stream only):
        ``captured`` (the engine's rows, `wire.captured_features`), else a forward of the target's decoder."""
        ids = torch.tensor(it.input_ids)
        T, N, K = len(ids), len(it.anchor_pos), self.num_speculative_tokens
        feats = torch.zeros(T, 0)
        if captured is not None:
            feats = captured.to(self.dtype)  # shipped in the target's precision, as the forward's are
        elif self.aux:
            feats = self._features(ids.to(self.device)).cpu()  # target's dtype
        drafted = torch.zeros(N, K, dtype=torch.long)
        for j, y in enumerate(it.drafted):
            drafted[j, : min(len(y), K)] = torch.tensor(y[:K], dtype=torch.long)
        valid = torch.tensor([min(len(y), K) for y in it.drafted], dtype=torch.long)
        acc = torch.minimum(torch.tensor(it.accepted, dtype=torch.long), valid)
        return TeacherItem(
            ids, feats, torch.tensor(it.anchor_pos), drafted, valid, acc, acc, None, it.policy_version
        )

    def _from_capture(self, it: ReplayItem) -> TeacherItem:
        """The teacher the verification pass captured (`wire.captured_teacher`) and, where the draft conditions on
        target features, the rows the engine captured too (`wire.captured_features`, EAGLE-3), else a forward of
        the target's decoder over the committed sequence: no branch, no teacher forward, and with captured features
        no target forward at all. The acceptance is the verification's own, so ``replay_accepted`` is
        ``accepted``."""
        assert it.captured is not None
        feats = captured_features(it.captured, len(it.input_ids)) if self.aux else None
        item = self._features_only(it, feats)
        ids, lps, tail, valid = captured_teacher(it.captured, self.num_speculative_tokens, self.topk)
        item.valid_len = valid
        item.accepted = torch.minimum(item.accepted, valid)
        item.replay_accepted = item.accepted.clone()
        item.teacher_topk_ids, item.teacher_topk_logprobs, item.teacher_log_tail = ids, lps, tail
        item.teacher_captured = True
        item.features_captured = feats is not None
        return item

    def _score_one(self, it: ReplayItem) -> TeacherItem:
        if not self.teacher:
            return self._features_only(it)
        if it.captured is not None and self.payload == "topk" and self.mode == "recorded":
            return self._from_capture(it)
        T, N, K = len(it.input_ids), len(it.anchor_pos), self.num_speculative_tokens
        packed = pack_branches(it, K)
        dev = self.device
        out = self.model(
            packed.input_ids[None].to(dev),
            attention_mask=packed.mask[None, None].to(dev, self.model.dtype),
            position_ids=packed.position_ids[None].to(dev),
            output_hidden_states=bool(self.aux),
            use_cache=False,
        )
        logits = out.logits[0].float()  # (T + B, V)
        feats = (  # (T, A*H); a standalone draft needs none
            torch.cat([out.hidden_states[i][0, :T] for i in self.aux], dim=-1)
            if self.aux
            else logits.new_zeros(T, 0)
        ).cpu()
        drafted = torch.zeros(N, K, dtype=torch.long)
        valid = torch.zeros(N, dtype=torch.long)
        acc = torch.zeros(N, dtype=torch.long)
        replay_acc = torch.zeros(N, dtype=torch.long)
        teacher: torch.Tensor | None = None
        for j, (rows, y, a) in enumerate(zip(packed.rows, it.drafted, it.accepted)):
            have = len(rows)
            block = logits[rows.to(dev)]
            kk = min(len(y), K)
            drafted[j, :kk] = torch.tensor(y[:kk])
            valid[j] = have
            acc[j] = min(a, have)
            match = (block.argmax(-1).cpu() == drafted[j, :have]).long()
            replay_acc[j] = int(match.cumprod(0).sum())
            lp = self._to_draft_vocab(block).cpu()
            if teacher is None:
                teacher = torch.zeros(N, K, lp.shape[-1])
            teacher[j, :have] = lp
        assert teacher is not None
        item = TeacherItem(
            torch.tensor(it.input_ids),
            feats,  # in the target's precision (teacher.dtype): bfloat16 ships half the bytes of float32
            torch.tensor(it.anchor_pos),
            drafted,
            valid,
            acc,
            replay_acc,
            teacher,
            it.policy_version,
        )
        if self.payload == "topk":
            k = min(self.topk, teacher.shape[-1])
            item.teacher_topk_logprobs, item.teacher_topk_ids = teacher.topk(k, dim=-1)
            if self.draft_topm > 0:
                item.draft_topm_ids = self._draft_topm(item)
                item.teacher_logprobs_at_draft = teacher.gather(-1, item.draft_topm_ids)
                assert self.student is not None  # one forward of the student (no backward)
                item.replay_draft_flops = self.student.flops(item, backward=False)
            item.teacher_log_tail = teacher_log_tail(teacher, item.teacher_topk_ids, item.draft_topm_ids)
            item.teacher_logprobs = None
        return item

    def _draft_topm(self, item: TeacherItem) -> torch.Tensor:
        """(N, K, m) the current draft's own top ``draft_topm`` ids (its vocabulary) at every block position."""
        assert self.student is not None
        hidden = self.student.block_hidden(item.to(self.device))  # (N, K, H)
        logits = hidden @ self.student.lm_head.T
        m = min(self.draft_topm, logits.shape[-1])
        return logits.topk(m, dim=-1).indices.cpu()

    def refit_ack(self) -> RefitAck:
        """The refit proof of the draft copy redraft uses (`sync/refit.py`): its tensors, fingerprinted as held."""
        from draft_opd_ray.sync.refit import fingerprints

        if self.student is None:
            raise RuntimeError("this replay actor holds no draft (replay mode recorded, draft_topm 0)")
        state = self.student.model.state_dict()
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
        tensors = fingerprints((n, t.cpu()) for n, t in state.items())
        return RefitAck("replay actor", self.draft_version, str(dtype).removeprefix("torch."), tensors)
