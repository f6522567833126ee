"""vLLM extension points for anchor recording and in-place draft weight updates (no fork, no patching).

Both classes are loaded by qualified name inside vLLM's own processes:

* `AnchorRecordingScheduler` (`LLM(..., scheduler_cls=...)`, runs in the EngineCore process): after each
  model step it reads, per request, the drafted ids the target just verified
  (`SchedulerOutput.scheduled_spec_decode_tokens`) and the tokens the target sampled for them
  (`ModelRunnerOutput.sampled_token_ids`: the accepted drafts plus one correction/bonus token), so
  accepted = len(sampled) - 1, exactly vLLM's own counter. The step list travels back to the driver on
  the request's final output in `kv_transfer_params` (a free-form dict vLLM copies verbatim into
  `RequestOutput.kv_transfer_params`; unused when no KV connector is configured, which we check). It needs
  synchronous scheduling (`async_scheduling=False`, which `SpecDecodeEngine` passes when it records): with async
  scheduling on, vLLM's engine core never hands the drafts to a plain `Scheduler` subclass and the scheduled
  drafts are -1 placeholders, so it refuses to start, and a step with placeholder drafts raises.
* `DraftWeightExtension` (`LLM(..., worker_extension_cls=...)`, mixed into the worker): methods callable
  from the driver through `llm.collective_rpc`. `load_draft_weights` reloads the running draft with vLLM's
  in-place reloader (the one `Worker.reload_weights` uses for the target): on CPU the linear weights are
  repacked after loading, so a plain `model.load_weights` afterwards does not take. `draft_fingerprints`
  reads the served draft back (the refit proof, `opd/refit.py`). The draft is the model runner's
  `get_draft_model()` (Model Runner V2, which CUDA selects, holds it in `speculator`; V1 and the CPU runner in
  `drafter`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

TRACE_KEY = "draft_opd_ray_steps"
VERSION_KEY = "draft_opd_ray_policy_version"
PLACEHOLDER = -1  # the draft id vLLM's AsyncScheduler schedules before the drafts exist


class AnchorRecordingScheduler(Scheduler):
    """Records (committed-before, drafted, accepted, target log-probs) for every verification step."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if vllm_config.kv_transfer_config is not None:
            raise ValueError("anchor recording uses kv_transfer_params; it cannot run with a KV connector")
        if vllm_config.scheduler_config.async_scheduling:
            raise ValueError(
                "anchor recording needs async_scheduling=False: with async scheduling the engine core never "
                "hands the drafts to this scheduler and every verification step would go unrecorded"
            )
        super().__init__(vllm_config, *args, **kwargs)
        self._steps: dict[str, list[tuple[int, list[int], int, list[float]]]] = {}

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled_all = model_runner_output.sampled_token_ids
        if spec and sampled_all:
            index = model_runner_output.req_id_to_index
            lps = model_runner_output.logprobs
            for rid, drafted in spec.items():
                if PLACEHOLDER in drafted:
                    raise RuntimeError(
                        f"request {rid}: the verified drafts {list(drafted)} hold async-scheduling placeholders "
                        f"({PLACEHOLDER}): anchor recording needs the engine started with async_scheduling=False"
                    )
                req, i = self.requests.get(rid), index.get(rid)
                if req is None or i is None or i >= len(sampled_all) or not sampled_all[i]:
                    continue
                sampled = sampled_all[i]
                lp: list[float] = []
                if (
                    lps is not None
                    and req.sampling_params is not None
                    and req.sampling_params.logprobs is not None
                ):
                    start = int(lps.cu_num_generated_tokens[i])
                    lp = lps.logprobs[start : start + len(sampled), 0].tolist()
                # num_output_tokens = tokens committed before this step = index of drafted[0] in the output
                self._steps.setdefault(rid, []).append(
                    (req.num_output_tokens, list(drafted), len(sampled) - 1, lp)
                )
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for rid in scheduler_output.finished_req_ids:  # aborted without a final output
            self._steps.pop(rid, None)
        if self._steps:
            for eco in outputs.values():
                for out in eco.outputs:
                    if out.finish_reason is not None and out.request_id in self._steps:
                        params = dict(out.kv_transfer_params or {})
                        params[TRACE_KEY] = self._steps.pop(out.request_id)
                        out.kv_transfer_params = params
        return outputs


class DraftWeightExtension:
    """Worker-side methods; `self` is vLLM's worker. Call with `llm.collective_rpc(name, args=...)`."""

    _draft_version: int = 0

    def _draft_module(self) -> Any:
        """The served draft module: the runner's `get_draft_model()` (V2's `speculator.model`, V1's unwrapped
        `drafter.model`), else, for a runner without that method, V1's `drafter.model`."""
        runner = self.model_runner  # type: ignore[attr-defined]
        get = getattr(runner, "get_draft_model", None)
        model = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
        if model is None:
            raise RuntimeError(
                f"this engine has no draft model to update: its {type(runner).__name__} serves none "
                "(is speculative decoding on, with a draft model rather than ngram?)"
            )
        return model

    def draft_version(self) -> int:
        return self._draft_version

    def set_draft_version(self, version: int) -> int:
        """The version just received by another path (vLLM's weight-transfer engine)."""
        self._draft_version = int(version)
        return self._draft_version

    def draft_param_names(self) -> list[str]:
        return [name for name, _ in self._draft_module().named_parameters()]

    def draft_fingerprints(self) -> dict[str, Any]:
        """This rank's refit proof: the version it serves, the draft's dtype and the fingerprint of every draft
        tensor as the engine computes with it. A linear layer whose weight the CPU backend repacked into a
        kernel handle (its `weight` left empty) is read back through that kernel: identity rows in, W^T out,
        exactly (each output is one weight times 1 plus zeros)."""
        import torch

        from draft_opd_ray.opd.refit import tensor_fingerprint

        model = self._draft_module()
        dtype = self.vllm_config.speculative_config.draft_model_config.dtype  # type: ignore[attr-defined]
        out: dict[str, list[int]] = {}
        with torch.no_grad():
            for mod_name, mod in model.named_modules():
                for p_name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                    if p_name in mod._non_persistent_buffers_set:
                        continue
                    if t.numel() == 0 and p_name == "weight" and hasattr(mod, "quant_method"):
                        t = _read_back_linear(mod)
                    out[f"{mod_name}.{p_name}" if mod_name else p_name] = list(tensor_fingerprint(t, dtype))
        return {"version": self._draft_version, "dtype": str(dtype).removeprefix("torch."), "tensors": out}

    def load_draft_weights(self, path: str, version: int) -> int:
        """Replace the draft's weights in place from a safetensors file (checkpoint names, as in the
        exported folder). A file, not tensors: collective_rpc's serializer does not carry tensors."""
        import types

        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = load_file(path)
        cfg = self.vllm_config  # type: ignore[attr-defined]
        spec = cfg.speculative_config
        draft_cfg = types.SimpleNamespace(
            model_config=spec.draft_model_config,
            load_config=spec.draft_load_config or cfg.load_config,
            lora_config=None,
        )
        with set_current_vllm_config(cfg):
            reload_weights(
                draft_cfg,  # type: ignore[arg-type]  # only model_config / load_config / lora_config are read
                self._draft_module(),
                weights_iterator=iter(weights.items()),
                weights_path=None,
                is_checkpoint_format=True,
            )
        self._draft_version = int(version)
        return len(weights)


def _read_back_linear(layer: Any, rows: int = 2048) -> Any:
    """W^T of a linear layer (this rank's shard) from its forward kernel, ``rows`` identity rows at a time."""
    import torch

    k = int(getattr(layer, "input_size_per_partition", getattr(layer, "input_size", 0)))
    dtype, dev = layer.params_dtype, next(iter(layer.parameters())).device
    eye = torch.eye(k, dtype=dtype, device=dev)
    parts = [layer.quant_method.apply(layer, eye[i : i + rows]) for i in range(0, k, rows)]
    return torch.cat(parts)  # (K, N)
