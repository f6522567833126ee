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

from draft_opd_ray.device import resolve_dtype
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.models import kinds
from draft_opd_ray.opd.refit import RefitAck
from draft_opd_ray.rollout.records import RequestRecord

SCHEDULER = "draft_opd_ray.rollout.vllm_ext.AnchorRecordingScheduler"
EXTENSION = "draft_opd_ray.rollout.vllm_ext.DraftWeightExtension"
BASELINES = ("none", "ngram")  # methods that are not a trained draft: plain decoding, prompt lookup
# checkpoint-name fragments vLLM's draft modules spell differently (beyond `opd/refit.served_key`'s rules)
VLLM_ALIASES: dict[str, dict[str, str]] = {"eagle3": {"midlayer.": "layers.0."}}
SHM = "/dev/shm"
SHM_MARGIN = 16 << 20  # bytes left free in /dev/shm beside a weights file (vLLM and NCCL use it too)


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


def speculative_config(kind: str, path: str | None, k: int) -> dict[str, Any] | None:
    """The exact `speculative_config` vLLM takes for a draft (None = plain decoding)."""
    if kind == BASELINES[0]:
        return None
    if kind == BASELINES[1]:
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    method = kinds.draft_kind(kind).vllm_method
    if path is None:
        raise ConfigError(f"draft.path: a {kind} draft needs a folder")
    return {"method": method, "model": str(path), "num_speculative_tokens": k}


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


def scratch_dir(nbytes: int) -> str | None:
    """Where to write a ``nbytes`` file the engine's worker reads: /dev/shm when it has room for it (memory, no
    disk), else None (the temp dir). Docker's default /dev/shm is 64 MB, less than a draft's weights."""
    try:
        st = os.statvfs(SHM)
    except OSError:  # no /dev/shm (not Linux)
        return None
    return SHM if st.f_bavail * st.f_frsize >= nbytes + SHM_MARGIN else None


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


class SpecDecodeEngine:
    """vLLM `LLM` + anchor recording + in-place draft updates. Create inside a `__main__`-guarded process."""

    def __init__(
        self,
        target: str | Path,
        *,
        draft_kind: str,
        draft_path: str | Path | None,
        num_speculative_tokens: int,
        max_model_len: int = 2048,
        dtype: str = "float32",
        kvcache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        record: bool = True,
        seed: int = 0,
        cpu_bind: str | None = None,
        tensor_parallel: int = 1,
        weight_transfer: str | None = None,
    ) -> None:
        """``cpu_bind``: on CPU, the cores the engine's threads run on (``VLLM_CPU_OMP_THREADS_BIND``, e.g.
        :func:`all_cores` for an engine alone on the machine); None keeps the environment's (vLLM's ``auto``
        puts every engine on one core and leaves the other for the frontend). ``tensor_parallel``: GPUs (ranks)
        the engine shards the target and draft over (vLLM's ``tensor_parallel_size``). ``weight_transfer``: a vLLM
        weight-transfer backend ("nccl") to receive draft weights through (`opd/nccl_sync.py`); None: files only.
        ``dtype``: the target's (and vLLM's draft's) precision; ``auto`` = `device.resolve_dtype` on this node."""
        if draft_path is not None and draft_kind in kinds.KINDS:
            kinds.check_draft_matches_target(target, draft_path, draft_kind)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kvcache_gb)))  # whole GiB (config checks it)
        from vllm import LLM

        spec = speculative_config(draft_kind, str(draft_path) if draft_path else None, num_speculative_tokens)
        self.spec_config = spec
        self.target = str(target)
        self.draft_kind = draft_kind
        self.max_model_len = max_model_len
        self.record = record and spec is not None
        kwargs: dict[str, Any] = {}
        if spec is not None:
            kwargs["speculative_config"] = spec
            kwargs["per_request_spec_decode_metrics"] = "detailed"
            if self.record:
                kwargs["scheduler_cls"] = SCHEDULER
                # the engine core hands drafts to a custom Scheduler only when synchronous (v1/engine/core.py);
                # not recording (eval speed runs, serving) keeps vLLM's default, async on CUDA
                kwargs["async_scheduling"] = False
                print(
                    "[engine] anchor recording: async_scheduling=False (synchronous scheduling)", flush=True
                )
            if draft_kind in kinds.KINDS:
                kwargs["worker_extension_cls"] = EXTENSION
        if weight_transfer is not None:
            kwargs["weight_transfer_config"] = {"backend": weight_transfer}
        if tensor_parallel > 1:  # the actor owns its GPUs: vLLM's Ray executor would refuse its bundle
            kwargs["distributed_executor_backend"] = "mp"
        with _env("VLLM_CPU_OMP_THREADS_BIND", cpu_bind):
            self.llm = LLM(
                self.target,
                dtype=resolve_dtype(dtype),  # type: ignore[arg-type]
                max_model_len=max_model_len,
                enforce_eager=needs_eager(),
                tensor_parallel_size=tensor_parallel,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                **kwargs,
            )
        self.version = 0

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
            for rec, out in zip(ok, outs):
                self._fill(rec, out)
        return records

    def _fill(self, rec: RequestRecord, out: Any) -> None:
        from draft_opd_ray.rollout.vllm_ext import TRACE_KEY

        comp = out.outputs[0]
        rec.response_ids = list(comp.token_ids)
        rec.finish_reason = str(comp.finish_reason or "")
        m = comp.spec_decode_metrics
        if m is not None:
            d = m.to_dict()
            rec.vllm_steps = int(d["num_spec_steps"])
            rec.vllm_accepted = int(d["num_accepted_draft_tokens"])
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
        """Swap the draft's weights in place (between generation rounds); later records carry `version`.

        The full draft state (checkpoint names) is written once to a file in shared memory that the engine's
        worker process reads (the temp dir when /dev/shm lacks room: `scratch_dir`); vLLM's reloader needs every
        weight, not a subset."""
        import tempfile

        from draft_opd_ray.opd.weight_sync import write_safetensors

        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        with tempfile.NamedTemporaryFile(
            dir=scratch_dir(nbytes), prefix="draft_opd_ray_", suffix=".safetensors"
        ) as f:
            write_safetensors(f.name, weights)
            self.load_draft_weights_file(f.name, version)

    def load_draft_weights_file(self, path: str, version: int) -> None:
        """Like `load_draft_weights`, from a safetensors file with the full draft state that someone on this
        node already wrote (`SharedFileWeightSync` writes one per version for all workers on the node)."""
        self.llm.collective_rpc("load_draft_weights", args=(path, version))
        # cached prompt blocks hold KV computed by the old draft: drop them
        self.llm.reset_prefix_cache()
        self.version = version

    def nccl_init(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the sender's NCCL group (vLLM's weight-transfer engine, backend "nccl"), this engine's ranks at
        ``rank_offset`` + tensor-parallel rank. A group joined before is dropped first (it is re-formed when
        an engine restarted, `NcclWeightSync.restarted`)."""
        self.llm.shutdown_weight_transfer_engine()
        self.llm.init_weight_transfer_engine(
            {
                "init_info": {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": rank_offset,
                    "world_size": world_size,
                    "packed": True,
                }
            }
        )

    def load_draft_weights_nccl(self, plan: dict[str, list[Any]], version: int) -> None:
        """Receive a new draft version by NCCL broadcast: every rank loads the checkpoint-named tensors of
        ``plan`` (names, dtype names, shapes) in vLLM's layerwise reload, started and finished around it."""
        self.llm.start_draft_weight_update()
        self.llm.update_weights({"update_info": plan})
        self.llm.finish_weight_update()
        self.llm.collective_rpc("set_draft_version", args=(version,))
        self.llm.reset_prefix_cache()
        self.version = version

    def refit_ack(self, receiver: str) -> RefitAck:
        """The refit proof (`opd/refit.py`): every rank's draft read back from the engine, fingerprinted, and
        the ranks combined into one report of what this engine serves."""
        from draft_opd_ray.opd.refit import combine_ranks

        ranks = self.llm.collective_rpc("draft_fingerprints")
        versions = {int(r["version"]) for r in ranks}
        spec = self.llm.llm_engine.vllm_config.speculative_config
        assert spec is not None  # an engine without a draft has nothing to refit
        return RefitAck(
            receiver=receiver,
            version=versions.pop() if len(versions) == 1 else -1,  # ranks that disagree serve no one version
            dtype=str(ranks[0]["dtype"]),
            tensors=combine_ranks(
                [{n: (int(a), int(b)) for n, (a, b) in r["tensors"].items()} for r in ranks]
            ),
            aliases=dict(VLLM_ALIASES.get(self.draft_kind, {})),
            # KV heads fewer than the ranks are replicated: the check counts them (`refit.kv_replicas`)
            tensor_parallel=int(spec.draft_parallel_config.tensor_parallel_size),
            kv_heads=int(spec.draft_model_config.get_total_num_kv_heads()),
        )

    def shutdown(self) -> None:
        import gc

        engine = getattr(self, "llm", None)
        if engine is not None:
            with contextlib.suppress(Exception):  # best effort on teardown
                engine.llm_engine.engine_core.shutdown()
            del self.llm
        gc.collect()
