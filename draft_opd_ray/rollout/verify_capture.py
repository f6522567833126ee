"""The teacher from the verification pass: what vLLM's rejection sampler receives, kept per request and step.

In a speculative-decoding step the target scores the last committed token x_n and the drafted y_1..y_K' in one
forward; its logit row j is the target at x_{<=n} y_{<=j}. Rows 0..K'-1 are therefore exactly the teacher p_1..p_K'
a replay would compute on the draft's block (the rejected suffix included), and row K' is the bonus position. This
module keeps, at every verification step of every request, from the **raw** rows (before temperature, top-p and
penalties; after a grammar bitmask, which vLLM applies in place before the sampler, so a capture notes it):

    the anchor position n, the drafted ids, the accepted count a (the sampler's own output), and per row
    j = 0..K' the teacher's top-k ids and log-probs and the log of the mass outside them (`CapturedSteps`).

It is the one place the project wraps a vLLM object: the model runner's ``rejection_sampler`` instance attribute,
installed from the worker extension after start-up (the engine's profiling run calls the sampler with dummy rows,
so it is not wrapped then) and never by editing vLLM. Two runners, two call signatures, tested against the
installed files (tests/conformance/test_verify_capture.py):

* V1 (`v1/worker/gpu_model_runner.py`, and the CPU runner, its subclass): ``rejection_sampler(metadata,
  draft_probs, logits, sampling_metadata)``; request b owns logits rows ``cu_num_sampled[b-1]..cu_num_sampled[b]``
  (its K' draft rows, then its bonus row: `_calc_spec_decode_metadata`), its id is ``input_batch.req_ids[b]``, the
  row's token index is ``metadata.logits_indices`` and its position ``runner.positions`` there.
* Model Runner V2 (`v1/worker/gpu/model_runner.py`, CUDA's default): ``rejection_sampler(logits, input_batch,
  draft_logits, invalid_drafts)``; request b owns rows ``input_batch.cu_num_logits[b]..[b+1]``, the drafted ids
  are the input ids one token after each row, positions are ``input_batch.positions``.

Nothing here synchronises the device with the host: the top-k, the positions and the accepted counts stay device
tensors until `take` (after generation), so CUDA graphs (the logits come after the graphed forward) and async
scheduling keep their pace. Imports only numpy, torch and `wire` (where `CapturedSteps` is documented).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from draft_opd_ray.wire import CapturedSteps, tensor_bytes, tensor_from_bytes

TESTED_VLLM = "0.32.0"  # the vLLM version this wrap was checked against (conformance tier)
ATTRIBUTE = "rejection_sampler"  # the model runner's instance attribute this module wraps
PLACEHOLDER = -1  # a rejected position in the sampler's output (v1/sample/rejection_sampler.py)


def teacher_rows(logits: torch.Tensor, k: int, vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(top-k log-probs (R, k), their ids (R, k), log tail (R,)) of raw logit rows (R, V), in float32, over
    ``vocab_ids`` (renormalised) when given. The tail is a logsumexp over the ids outside the top-k, as the
    replay's `algo.loss.teacher_log_tail` computes it (exact where 1 - sum(top-k) cancels in float32)."""
    x = logits.float() if vocab_ids is None else logits.index_select(-1, vocab_ids).float()
    lp = torch.log_softmax(x, dim=-1)
    k = min(k, lp.shape[-1])
    vals, ids = lp.topk(k, dim=-1)
    tail = lp.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return vals, ids, tail


@dataclass
class _Call:
    """One sampler call, device tensors kept as they were made (no host sync until `take`)."""

    req_ids: list[str]
    num_draft: list[int]  # per request, host
    rows: list[int]  # per request: first logits row (host)
    anchor: torch.Tensor  # (B,) positions of each request's first row
    tokens: torch.Tensor  # (B,) the committed token each request's first row scores (x_n)
    drafted: torch.Tensor  # (sum num_draft,) flat
    vals: torch.Tensor  # (R, k)
    ids: torch.Tensor  # (R, k)
    tail: torch.Tensor  # (R,)
    accepted: torch.Tensor  # (B,)
    grammar: bool


class VerifyCapture:
    """Stands in for the runner's rejection sampler: keeps the teacher rows, then calls vLLM's sampler unchanged
    (same arguments, same output). ``v2``: Model Runner V2's call signature."""

    def __init__(self, runner: Any, inner: Any, topk: int, vocab_ids: Sequence[int] | None, v2: bool) -> None:
        self.runner, self.inner, self.topk, self.v2 = runner, inner, int(topk), v2
        self.vocab_ids = None if vocab_ids is None else torch.as_tensor(list(vocab_ids), dtype=torch.long)
        self.calls: list[_Call] = []
        # each request's prompt ids, read from the runner when the request is first seen (`prompt_ids`) and handed
        # out with its first steps: a server's traffic is known nowhere else in the engine's workers
        self.prompts: dict[str, list[int] | torch.Tensor] = {}
        self.handed: set[str] = set()  # requests whose prompt went out (forgotten once the runner drops them)
        # the target's feature rows the drafter was handed (`FeatureTap`), per request: (positions, rows) chunks
        self.features: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __getattr__(self, name: str) -> Any:  # everything else the runner reads from its sampler
        if name == "inner":  # not set yet (a copy, an unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the teacher is read before the sampler runs: vLLM may update `logits` in place
        pending = self._v2_rows(*args, **kwargs) if self.v2 else self._v1_rows(*args, **kwargs)
        out = self.inner(*args, **kwargs)
        if pending is not None:
            pending.accepted = self._accepted(out, len(pending.req_ids))
            self.calls.append(pending)
        return out

    # ---- the two runners' row maps -----------------------------------------------------------------------

    def _v1_rows(
        self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any
    ) -> _Call | None:
        batch = self.runner.input_batch
        num_draft = [int(n) for n in metadata.num_draft_tokens]
        if not any(num_draft) or len(batch.req_ids) < len(num_draft):
            return None
        first = np.concatenate([[0], np.cumsum(np.asarray(num_draft) + 1)[:-1]]).astype(np.int64)
        where = torch.as_tensor(first, device=logits.device)
        tokens = metadata.logits_indices.index_select(0, where.to(metadata.logits_indices.device))
        anchor = self.runner.positions.index_select(0, tokens.to(self.runner.positions.device).long())
        committed = self.runner.input_ids.gpu.index_select(
            0, tokens.to(self.runner.input_ids.gpu.device).long()
        )
        req_ids = list(batch.req_ids[: len(num_draft)])
        self._see(req_ids)
        vals, ids, tail = teacher_rows(logits, self.topk, self._vocab(logits))
        return _Call(
            req_ids,
            num_draft,
            first.tolist(),
            anchor,
            committed,
            metadata.draft_token_ids,
            vals,
            ids,
            tail,
            torch.empty(0),
            False,  # V1 applies a grammar bitmask before the call and does not say so: V2 does (invalid_drafts)
        )

    def _v2_rows(
        self,
        logits: torch.Tensor,
        input_batch: Any,
        draft_logits: Any = None,
        invalid_drafts: Any = None,
    ) -> _Call | None:
        cu = np.asarray(input_batch.cu_num_logits_np, dtype=np.int64)[: input_batch.num_reqs + 1]
        num_draft = (np.diff(cu) - 1).clip(min=0).tolist()
        if not any(num_draft):
            return None
        first = cu[:-1]
        idx = input_batch.logits_indices  # (R,) token index of every logits row
        where = torch.as_tensor(first, device=idx.device)
        anchor = input_batch.positions.index_select(0, idx.index_select(0, where).long())
        is_draft = np.ones(int(cu[-1]), dtype=bool)
        is_draft[cu[1:] - 1] = False  # each request's last row is its bonus row
        draft_rows = torch.as_tensor(np.nonzero(is_draft)[0], device=idx.device)
        drafted = input_batch.input_ids.index_select(0, idx.index_select(0, draft_rows).long() + 1)
        committed = input_batch.input_ids.index_select(0, idx.index_select(0, where).long())
        req_ids = list(input_batch.req_ids[: input_batch.num_reqs])
        self._see(req_ids)
        vals, ids, tail = teacher_rows(logits, self.topk, self._vocab(logits))
        return _Call(
            req_ids,
            num_draft,
            first.tolist(),
            anchor,
            committed,
            drafted,
            vals,
            ids,
            tail,
            torch.empty(0),
            invalid_drafts is not None,
        )

    def _see(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            if rid not in self.prompts and rid not in self.handed:
                self.prompts[rid] = prompt_ids(self.runner, rid)

    def _forget(self) -> None:
        """Drop what is kept for requests the runner no longer holds (finished, aborted)."""
        live = live_requests(self.runner)
        self.handed &= live
        for rid in [r for r in self.prompts if r not in live]:
            del self.prompts[rid]

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.vocab_ids is not None and self.vocab_ids.device != logits.device:
            self.vocab_ids = self.vocab_ids.to(logits.device)
        return self.vocab_ids

    def _accepted(self, out: Any, batch: int) -> torch.Tensor:
        """(B,) drafted tokens the sampler accepted: V2 counts its sampled tokens (accepted + 1); V1 marks
        rejected positions with `PLACEHOLDER` in a (B, max_spec_len + 1) tensor."""
        if self.v2:
            return out.num_sampled[:batch] - 1
        return (out.sampled_token_ids[:batch] != PLACEHOLDER).sum(-1) - 1

    # ---- handing the steps out -----------------------------------------------------------------------------

    def take(self) -> dict[str, CapturedSteps]:
        """Every request's steps captured since the last `take` (vLLM's internal request ids), in step order; the
        capture starts empty again. The one host sync of the capture happens here."""
        steps: dict[str, list[tuple[int, list[int], int, np.ndarray, np.ndarray, np.ndarray, bool, int]]] = {}
        for c in self.calls:
            anchor = c.anchor.cpu().tolist()
            committed = c.tokens.cpu().tolist()
            drafted = c.drafted.cpu().tolist()
            accepted = c.accepted.cpu().tolist()
            vals, ids, tail = c.vals.cpu().numpy(), c.ids.cpu().numpy(), c.tail.cpu().numpy()
            d0 = 0
            for b, (rid, nd, r0) in enumerate(zip(c.req_ids, c.num_draft, c.rows)):
                if nd > 0:
                    rows = slice(r0, r0 + nd + 1)
                    steps.setdefault(rid, []).append(
                        (
                            int(anchor[b]),
                            [int(t) for t in drafted[d0 : d0 + nd]],
                            int(accepted[b]),
                            ids[rows],
                            vals[rows],
                            tail[rows],
                            c.grammar,
                            int(committed[b]),
                        )
                    )
                d0 += nd
        self.calls = []
        if self.features and torch.cuda.is_available():
            torch.cuda.synchronize()  # the feature rows' non-blocking copies into pinned host memory are done
        out = {rid: _pack(s, self.topk) for rid, s in steps.items()}
        for rid, got in out.items():  # the prompt goes out once, with a request's first steps
            prompt = self.prompts.pop(rid, None)
            if prompt is not None:
                got.prompt_ids = [int(t) for t in (prompt.tolist() if torch.is_tensor(prompt) else prompt)]
                self.handed.add(rid)
        self._forget()
        for rid, chunks in self.features.items():
            if rid in out:
                out[rid].features, out[rid].feature_seen = _last_write(chunks)
        # a running request with rows but no step yet (its prefill came just before this take) keeps them for
        # the take that has its first steps
        live = live_requests(self.runner) if self.features else set()
        self.features = {r: c for r, c in self.features.items() if r not in out and r in live}
        return out


def _last_write(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, np.ndarray]:
    """(P, D) feature rows by position, in the target's dtype, and (P,) which positions were seen, from a request's
    chunks in step order. A step's rows past its accepted tokens (the rejected suffix) sit at positions the next
    step computes again from committed tokens, so the last row written at a position is the committed token's;
    positions past the request's last input token keep a rejected row and are not read
    (`wire.captured_features`)."""
    size = max(int(pos.max()) + 1 for pos, _ in chunks if pos.numel())
    first = chunks[0][1]
    feats = torch.zeros(size, first.shape[-1], dtype=first.dtype)
    seen = np.zeros(size, dtype=bool)
    for pos, rows in chunks:
        feats[pos.cpu().long()] = rows.cpu()
        seen[pos.cpu().numpy()] = True
    return feats, seen


def _host_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy on the host: a clone on CPU, a non-blocking device-to-host copy on a GPU (no sync per step)."""
    return x.clone() if x.device.type == "cpu" else x.to("cpu", non_blocking=True)


class FeatureTap:
    """Stands in for the drafter's bound `propose` (an instance attribute on vLLM's proposer object, which the
    runner's isinstance checks still see as itself): records the rows of ``target_hidden_states`` (EAGLE-3: the
    target's auxiliary layers, concatenated in the draft's order) with ``target_positions`` per request, then calls
    `propose` unchanged. Requests are the batch order of ``common_attn_metadata.query_start_loc_cpu`` and
    `input_batch.req_ids` (v1/worker/gpu_model_runner.py, `propose_draft_token_ids`)."""

    def __init__(self, runner: Any, inner: Any, capture: VerifyCapture) -> None:
        self.runner, self.inner, self.capture = runner, inner, capture

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("target_hidden_states")
        positions = kwargs.get("target_positions")
        meta = kwargs.get("common_attn_metadata")
        if hidden is not None and positions is not None and meta is not None and positions.dim() == 1:
            starts = meta.query_start_loc_cpu.tolist()
            req_ids = self.runner.input_batch.req_ids
            for b in range(min(len(starts) - 1, len(req_ids))):
                a, e = starts[b], starts[b + 1]
                if e > a:  # copies: the runner reuses its buffers next step
                    self.capture.features.setdefault(req_ids[b], []).append(
                        (_host_copy(positions[a:e]), _host_copy(hidden[a:e]))
                    )
        return self.inner(*args, **kwargs)


def _pack(steps: list[tuple[Any, ...]], topk: int) -> CapturedSteps:
    S = len(steps)
    K1 = max(len(s[3]) for s in steps)
    k = steps[0][3].shape[-1] if S else topk
    ids = np.zeros((S, K1, k), dtype=np.int32)
    vals = np.full((S, K1, k), -np.inf, dtype=np.float32)
    tail = np.full((S, K1), -np.inf, dtype=np.float32)
    for i, s in enumerate(steps):
        n = len(s[3])
        ids[i, :n], vals[i, :n], tail[i, :n] = s[3], s[4], s[5]
    return CapturedSteps(
        [s[0] for s in steps],
        [s[1] for s in steps],
        [s[2] for s in steps],
        ids,
        vals,
        tail,
        any(s[6] for s in steps),
        anchor_ids=[s[7] for s in steps],
    )


def install(runner: Any, topk: int, vocab_ids: Sequence[int] | None, features: bool = False) -> VerifyCapture:
    """Wrap ``runner``'s rejection sampler (idempotent: a second install replaces the settings, keeps vLLM's
    sampler). Model Runner V2 is told apart by its `speculator` attribute (V1 and the CPU runner have `drafter`).
    ``features``: also tap the V1 drafter's `propose` for the target's feature rows (`FeatureTap`; EAGLE-3), where
    there is one (not on Model Runner V2: `taps_features` says)."""
    current = getattr(runner, ATTRIBUTE, None)
    if current is None:
        raise RuntimeError(
            f"{type(runner).__name__} has no {ATTRIBUTE}: verify-pass capture needs speculative decoding on"
        )
    inner = current.inner if isinstance(current, VerifyCapture) else current
    v2 = hasattr(runner, "speculator")
    if v2 and not v2_rows_are_host_known(runner):
        raise RuntimeError(
            "verify-pass capture reads Model Runner V2's rows from cu_num_logits_np, which adaptive verification "
            "or several sampled tokens per step make a bound, not the rows: use teacher.source=replay"
        )
    capture = VerifyCapture(runner, inner, topk, vocab_ids, v2=v2)
    setattr(runner, ATTRIBUTE, capture)
    if features and not v2:  # Model Runner V2 has no drafter to tap: the replay computes its features
        drafter = runner.drafter
        bound = drafter.propose
        bound = bound.inner if isinstance(bound, FeatureTap) else bound
        drafter.propose = FeatureTap(runner, bound, capture)  # an instance attribute over the class's method
    return capture


def prompt_ids(runner: Any, rid: str) -> list[int] | torch.Tensor:
    """Request ``rid``'s prompt ids as the runner holds them: V1's `requests[rid].prompt_token_ids` (a host list;
    empty for a prompt given as embeddings), Model Runner V2's row of `req_states.all_token_ids` up to its
    `prompt_len` (a device slice, copied without a host sync)."""
    states = getattr(runner, "req_states", None)
    if states is not None and hasattr(runner, "speculator"):  # Model Runner V2 (v1/worker/gpu/states.py)
        i = states.req_id_to_index[rid]
        return states.all_token_ids.gpu[i, : int(states.prompt_len.np[i])].clone()
    ids = runner.requests[
        rid
    ].prompt_token_ids  # V1 and CPU (v1/worker/gpu_input_batch.py, CachedRequestState)
    return list(ids) if ids is not None else []


def live_requests(runner: Any) -> set[str]:
    """The request ids the runner holds now (V1: `requests`; Model Runner V2: `req_states.req_id_to_index`)."""
    states = getattr(runner, "req_states", None)
    if states is not None and hasattr(runner, "speculator"):
        return set(states.req_id_to_index)
    return set(runner.requests)


def v2_rows_are_host_known(runner: Any) -> bool:
    """Model Runner V2 lays out one logits row per drafted token plus one bonus row per request, as
    ``cu_num_logits_np`` says, unless adaptive verification re-assigns drafts on the device or the model samples
    several tokens a step (`GPUModelRunner.prepare_inputs`, v1/worker/gpu/model_runner.py)."""
    state = getattr(runner, "model_state", None)
    per_step = getattr(state, "num_new_sampled_tokens_per_step", 1)
    return getattr(runner, "adaptive_verification", None) is None and per_step == 1


def encode(steps: CapturedSteps) -> dict[str, Any]:
    """``steps`` as plain values for vLLM's `collective_rpc` (its serializer carries bytes, not tensors)."""
    return {
        "anchor_pos": steps.anchor_pos,
        "drafted": steps.drafted,
        "accepted": steps.accepted,
        "shape": list(steps.topk_ids.shape),
        "topk_ids": steps.topk_ids.tobytes(),
        "topk_logprobs": steps.topk_logprobs.tobytes(),
        "log_tail": steps.log_tail.tobytes(),
        "grammar": steps.grammar,
        "features": None if steps.features is None else tensor_bytes(steps.features),
        "feature_shape": None if steps.features is None else list(steps.features.shape),
        "feature_dtype": None if steps.features is None else str(steps.features.dtype).removeprefix("torch."),
        "feature_seen": None if steps.feature_seen is None else steps.feature_seen.tobytes(),
        "prompt_ids": steps.prompt_ids,
        "anchor_ids": steps.anchor_ids,
    }


def decode(d: dict[str, Any]) -> CapturedSteps:
    shape = tuple(d["shape"])
    features = seen = None
    if d.get("features") is not None:
        features = tensor_from_bytes(d["features"], d["feature_dtype"], d["feature_shape"])
        seen = np.frombuffer(d["feature_seen"], dtype=bool).copy()
    return CapturedSteps(
        list(d["anchor_pos"]),
        [list(x) for x in d["drafted"]],
        list(d["accepted"]),
        np.frombuffer(d["topk_ids"], dtype=np.int32).reshape(shape).copy(),
        np.frombuffer(d["topk_logprobs"], dtype=np.float32).reshape(shape).copy(),
        np.frombuffer(d["log_tail"], dtype=np.float32).reshape(shape[:2]).copy(),
        bool(d["grammar"]),
        features,
        seen,
        d.get("prompt_ids"),
        d.get("anchor_ids"),
    )


def external_id(internal: str) -> str:
    """The id a caller gave a request, from the id the engine core and its workers see: vLLM appends "-" and 8
    random characters (`InputProcessor.assign_request_id`)."""
    return internal.rsplit("-", 1)[0]


def taps_features(runner: Any) -> bool:
    """Whether ``runner``'s drafter hands its feature rows to the capture (`install` with ``features``)."""
    drafter = getattr(runner, "drafter", None)
    return isinstance(getattr(drafter, "__dict__", {}).get("propose"), FeatureTap)
