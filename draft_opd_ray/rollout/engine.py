"""A vLLM engine doing target-verified speculative decoding that returns anchor records.

Used by the Ray rollout worker (draft_opd_ray.rollout.worker) and by evaluation. The engine checks each
request before submitting it (empty prompt, prompt too long for the model): a bad request gets a record
with `error` set and the others run normally. Start-up problems (draft and target vocabularies differ,
invalid sampling settings) raise ConfigError / ModelError before the engine starts.

Engine arguments that differ from vLLM's defaults on purpose: a recording engine runs with synchronous
scheduling (`async_scheduling=False`; CUDA's default, async, never hands the drafts to our scheduler), and a
tensor-parallel engine uses the multiprocessing executor (`distributed_executor_backend="mp"`): inside a Ray
actor in the run's placement group vLLM would pick its Ray executor, which refuses the actor's multi-GPU
bundle, while the actor already owns its GPUs. ``dtype="auto"`` is resolved here, on the engine's own node.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
from draft_opd_ray.device import resolve_dtype
from draft_opd_ray.drafts import registry
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.logs import tqdm_on_load
from draft_opd_ray.rollout.worker_ext import EXTENSION
from draft_opd_ray.sync import receiver as receiving
from draft_opd_ray.sync.refit import RefitAck
from draft_opd_ray.wire import CapturedSteps, RequestRecord

SCHEDULER = "draft_opd_ray.rollout.vllm_ext.AnchorRecordingScheduler"
BASELINES = ("none", "ngram")  # methods that are not a trained draft: plain decoding, prompt lookup


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # target log-prob of each committed token (costs a little)

    def check(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")


def speculative_config(kind: str, path: str | None, num_speculative_tokens: int) -> dict[str, Any] | None:
    """The exact `speculative_config` vLLM takes for a draft (None = plain decoding)."""
    if kind == BASELINES[0]:
        return None
    if kind == BASELINES[1]:
        return {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    method = registry.draft_kind(kind).vllm_method
    if path is None:
        raise ConfigError(f"draft.path: a {kind} draft needs a folder")
    return {"method": method, "model": str(path), "num_speculative_tokens": num_speculative_tokens}


def needs_eager() -> bool:
    """Eager mode where the platform has no graph capture worth its start-up (vLLM's CPU backend); CUDA graphs
    (and the compile they need) on GPUs."""
    import torch

    return not torch.cuda.is_available()


def async_by_default() -> bool:
    """Whether vLLM schedules asynchronously unless told not to: on GPUs for every draft method we serve
    (vLLM's `config/vllm.py`), never on CPU (`platforms/cpu.py` turns it off)."""
    import torch

    return torch.cuda.is_available()


def all_cores() -> str:
    """The cores this process may run on, as a ``VLLM_CPU_OMP_THREADS_BIND`` list (e.g. "0-1")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


@contextlib.contextmanager
def _env(name: str, value: str | None):  # type: ignore[no-untyped-def]
    """``name=value`` while the engine process starts (it reads its environment then); None: leave it."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _engine_kwargs(
    spec: dict[str, Any] | None, record: bool, extension: bool, run: EngineRun
) -> dict[str, Any]:
    """The engine arguments that differ from vLLM's defaults on purpose (module docstring)."""
    kwargs: dict[str, Any] = {}
    if spec is not None:
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "detailed"
        if run.capture_topk is not None:
            # the worker records (verify-pass capture): vLLM's scheduling stays as it is, async on CUDA. Prefix
            # caching stays on: the teacher rows are verification rows, which every step computes (a prefix-cache
            # hit skips prompt rows only, which the teacher capture does not read); feature capture reads them
            kwargs["worker_extension_cls"] = EXTENSION
            if run.capture_features:
                kwargs["enable_prefix_caching"] = False
        elif record:
            kwargs["scheduler_cls"] = SCHEDULER
            # the engine core hands drafts to a custom Scheduler only when synchronous (v1/engine/core.py);
            # not recording (eval speed runs, serving) keeps vLLM's default, async on CUDA
            kwargs["async_scheduling"] = False
            print("[engine] anchor recording: async_scheduling=False (synchronous scheduling)", flush=True)
        if extension:
            kwargs["worker_extension_cls"] = EXTENSION
    if not tqdm_on_load():  # a quiet run: no weight-loading bars (logs.py)
        kwargs["use_tqdm_on_load"] = False
    if run.weight_transfer is not None:
        kwargs["weight_transfer_config"] = {"backend": run.weight_transfer}
    if run.tensor_parallel > 1:  # the actor owns its GPUs: vLLM's Ray executor would refuse its bundle
        kwargs["distributed_executor_backend"] = "mp"
    return kwargs


@dataclass(frozen=True)
class EngineRun:
    """What only the run knows about one engine (the rest is `draft.num_speculative_tokens`, `target.*`,
    `rollout.kvcache_gb` / `rollout.gpu_memory_utilization`): the target's folder; ``draft_kind``, the method it
    speculates with (a draft kind with its folder ``draft_path``, or one of `BASELINES`); ``record``: anchor
    records (synchronous scheduling); ``cpu_bind``: on CPU, the cores the engine's threads run on
    (``VLLM_CPU_OMP_THREADS_BIND``, e.g. :func:`all_cores` for an engine alone on the machine; None keeps the
    environment's: vLLM's ``auto`` puts every engine on one core and leaves the other for the frontend);
    ``tensor_parallel``: GPUs (ranks) the engine shards the target and draft over (vLLM's
    ``tensor_parallel_size``); ``weight_transfer``: a vLLM weight-transfer backend ("nccl") to receive draft
    weights through (`sync/nccl.py`), None: files only; ``dtype``: the precision a stage serves the target in
    when it is not `target.dtype` (the SFT answers: `sft.trajectory_dtype`); ``auto`` = `device.resolve_dtype` on
    the engine's node; ``capture_topk``: record in the workers instead (`rollout/verify_capture.py`, no scheduler
    subclass, vLLM's scheduling as it is) and keep the verification pass's teacher top-``capture_topk`` of every
    step on each record (`RequestRecord.captured`), over ``capture_vocab`` (the draft's vocabulary as target ids)
    when given; ``capture_features``: also the target's feature rows the drafter is handed (EAGLE-3), with vLLM's
    prefix cache off (a cache hit computes no prompt rows)."""

    target: str | Path
    draft_kind: str
    draft_path: str | Path | None = None
    record: bool = True
    seed: int = 0
    cpu_bind: str | None = None
    tensor_parallel: int = 1
    weight_transfer: str | None = None
    dtype: str | None = None
    capture_topk: int | None = None
    capture_vocab: tuple[int, ...] | None = None
    capture_features: bool = False


class SpecDecodeEngine:
    """vLLM `LLM` + anchor recording + in-place draft updates. Create inside a `__main__`-guarded process."""

    def __init__(
        self, run: EngineRun, draft: DraftConfig, target: TargetConfig, rollout: RolloutConfig
    ) -> None:
        """Proposes `draft.num_speculative_tokens` tokens a step; serves the target as `target.dtype` (or
        ``run.dtype``) within `target.max_model_len`, with `rollout.kvcache_gb` of CPU KV cache and
        `rollout.gpu_memory_utilization` of a GPU."""
        draft_kind, draft_path = run.draft_kind, run.draft_path
        if draft_path is not None and draft_kind in registry.KINDS:
            registry.KINDS[draft_kind].check_folder(run.target, draft_path)
        # whole GiB (config checks it)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(rollout.kvcache_gb)))
        from vllm import LLM

        spec = speculative_config(
            draft_kind, str(draft_path) if draft_path else None, draft.num_speculative_tokens
        )
        self.spec_config = spec
        self.target = str(run.target)
        self.draft_kind = draft_kind
        self.max_model_len = target.model_len()
        self.record = run.record and spec is not None
        kwargs = _engine_kwargs(spec, self.record, draft_kind in registry.KINDS, run)
        with _env("VLLM_CPU_OMP_THREADS_BIND", run.cpu_bind):
            self.llm = LLM(
                self.target,
                dtype=resolve_dtype(run.dtype or target.dtype),  # type: ignore[arg-type]
                max_model_len=self.max_model_len,
                enforce_eager=needs_eager(),
                tensor_parallel_size=run.tensor_parallel,
                seed=run.seed,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                **kwargs,
            )
        self.version = 0
        self.capture = self.record and run.capture_topk is not None
        if self.capture and run.capture_topk is not None:
            self._install_capture(run.capture_topk, run.capture_vocab, run.capture_features)

    def _install_capture(self, topk: int, vocab: tuple[int, ...] | None, features: bool) -> None:
        from draft_opd_ray.rollout.support import vllm_version
        from draft_opd_ray.rollout.verify_capture import TESTED_VLLM

        got = self.llm.collective_rpc("install_verify_capture", args=(topk, vocab, features))[0]
        runner, tapped = got["runner"], bool(got["features"])
        version = vllm_version() or "vLLM (unknown version)"
        if not version.endswith(f" {TESTED_VLLM}"):
            print(
                f"[engine] warning: verify-pass capture was tested on vLLM {TESTED_VLLM}, this is {version}: "
                "check_teacher tells whether its teacher still equals the replay's",
                flush=True,
            )
        print(
            f"[engine] verify-pass capture on {runner}: teacher top-{topk} at every verification step"
            + (", and the target's feature rows (prefix cache off)" if tapped else "")
            + (
                " (no drafter to tap here: the replay computes the features)"
                if features and not tapped
                else ""
            ),
            flush=True,
        )

    # ------------------------------------------------------------------------------------------ generation

    def _request_error(self, ids: Sequence[int], sampling: Sampling) -> str:
        if len(ids) == 0:
            return "empty prompt"
        if len(ids) + sampling.max_new_tokens > self.max_model_len:
            return (
                f"prompt of {len(ids)} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return ""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[RequestRecord]:
        """Speculative decoding of token-id prompts; one record per prompt, in order."""
        from vllm import SamplingParams, TokensPrompt

        sampling.check()
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            seed=sampling.seed if sampling.temperature > 0 else None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            logprobs=0 if sampling.logprobs else None,
            detokenize=False,
        )
        records = [
            RequestRecord(prompt_ids=list(p), response_ids=[], request_id=str(i))
            for i, p in enumerate(prompts)
        ]
        ok = []
        for rec in records:
            rec.error = self._request_error(rec.prompt_ids, sampling)
            if rec.error:
                rec.finish_reason = "error"
            else:
                ok.append(rec)
        if ok:
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in ok], params, use_tqdm=False
            )
            captured = self._take_capture() if self.capture else {}
            for rec, out in zip(ok, outs):
                self._fill(rec, out, captured.get(out.request_id))
        return records

    def _take_capture(self) -> dict[str, CapturedSteps]:
        """The steps the workers captured, by the request ids `LLM.generate` returns (rank 0's copy)."""
        from draft_opd_ray.rollout.verify_capture import decode, external_id

        taken = self.llm.collective_rpc("take_verify_capture")[0]
        return {external_id(rid): decode(d) for rid, d in taken.items()}

    def _fill(self, rec: RequestRecord, out: Any, captured: CapturedSteps | None = None) -> None:
        from draft_opd_ray.rollout.vllm_ext import TRACE_KEY

        comp = out.outputs[0]
        rec.response_ids = list(comp.token_ids)
        rec.finish_reason = str(comp.finish_reason or "")
        m = comp.spec_decode_metrics
        if m is not None:
            d = m.to_dict()
            rec.vllm_steps = int(d["num_spec_steps"])
            rec.vllm_accepted = int(d["num_accepted_draft_tokens"])
        if self.capture:
            rec.captured = captured
            if captured is not None:
                rec.anchor_pos = list(captured.anchor_pos)
                rec.drafted = [list(d) for d in captured.drafted]
                rec.accepted = list(captured.accepted)
                rec.policy_version = [self.version] * captured.num_steps
                rec.teacher_logprob_drafted = [[] for _ in captured.accepted]
            return
        steps = (out.kv_transfer_params or {}).get(TRACE_KEY, []) if self.record else []
        base = len(rec.prompt_ids)
        for before, drafted, accepted, lp in steps:
            rec.anchor_pos.append(base + before - 1)
            rec.drafted.append(list(drafted))
            rec.accepted.append(int(accepted))
            rec.policy_version.append(self.version)
            # target log-probs of the committed tokens; for accepted drafted tokens these are the drafted ones
            rec.teacher_logprob_drafted.append(list(lp[:accepted]))

    # ------------------------------------------------------------------------------------------ weights

    def load_draft_weights(self, weights: dict[str, Any], version: int) -> None:
        """Swap the draft's weights in place (between generation rounds); later records carry `version`. The
        full draft state goes through one file the engine's workers read (`sync.receiver.weights_file`)."""
        with receiving.weights_file(weights) as path:
            self.load_draft_weights_file(path, version)

    def load_draft_weights_file(self, path: str, version: int) -> None:
        """Like `load_draft_weights`, from a safetensors file with the full draft state that someone on this
        node already wrote (`SharedFileWeightSync` writes one per version for all workers on the node)."""
        receiving.apply_file(self.llm, path, version)
        self.version = version

    def nccl_init(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the sender's NCCL group as ranks ``rank_offset..`` (`sync.receiver.join_nccl`)."""
        receiving.join_nccl(self.llm, address, port, rank_offset, world_size)

    def load_draft_weights_nccl(self, plan: dict[str, list[Any]], version: int) -> None:
        """Receive a new draft version by NCCL broadcast (`sync.receiver.apply_nccl`)."""
        receiving.apply_nccl(self.llm, plan, version)
        self.version = version

    def refit_ack(self, receiver: str) -> RefitAck:
        """The refit proof of what this engine serves (`sync.receiver.refit_ack`), with the checkpoint names
        vLLM's module for this draft kind spells differently (`DraftKind.vllm_aliases`)."""
        kind = registry.KINDS.get(self.draft_kind)
        return receiving.refit_ack(self.llm, receiver, kind.vllm_aliases if kind else {})

    def shutdown(self) -> None:
        import gc

        engine = getattr(self, "llm", None)
        if engine is not None:
            with contextlib.suppress(Exception):  # best effort on teardown
                engine.llm_engine.engine_core.shutdown()
            del self.llm
        gc.collect()
