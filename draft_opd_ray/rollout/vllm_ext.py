"""vLLM's scheduler extension point for anchor recording (no fork, no patching).

`AnchorRecordingScheduler` (`LLM(..., scheduler_cls=...)`, runs in the EngineCore process): after each
model step it reads, per request, the drafted ids the target just verified
(`SchedulerOutput.scheduled_spec_decode_tokens`) and the tokens the target sampled for them
(`ModelRunnerOutput.sampled_token_ids`: the accepted drafts plus one correction/bonus token), so
accepted = len(sampled) - 1, exactly vLLM's own counter. The step list travels back to the driver on
the request's final output in `kv_transfer_params` (a free-form dict vLLM copies verbatim into
`RequestOutput.kv_transfer_params`; unused when no KV connector is configured, which we check). It needs
synchronous scheduling (`async_scheduling=False`, which `SpecDecodeEngine` passes when it records): with async
scheduling on, vLLM's engine core never hands the drafts to a plain `Scheduler` subclass and the scheduled
drafts are -1 placeholders, so it refuses to start, and a step with placeholder drafts raises.

The worker extension that receives draft weights (`DraftWeightExtension`) lives with the rest of weight sync,
in `sync/receiver.py`.
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
