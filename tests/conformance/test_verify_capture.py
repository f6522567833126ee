"""The verify-pass capture (`rollout/verify_capture.py`) against the installed vLLM's files: the attribute it
wraps, the two call signatures, the row layouts it reads and the request ids it maps. Each test names the file it
reads; a change there that would make the capture read the wrong rows fails here, not silently in a run.

Files: vllm/v1/sample/rejection_sampler.py, vllm/v1/worker/gpu_model_runner.py, vllm/v1/spec_decode/metadata.py,
vllm/v1/worker/gpu/model_runner.py, vllm/v1/worker/gpu/spec_decode/rejection_sampler.py,
vllm/v1/worker/gpu/input_batch.py, vllm/v1/engine/input_processor.py, vllm/v1/worker/gpu_input_batch.py,
vllm/v1/worker/gpu/states.py; for the feature rows
vllm/v1/spec_decode/llm_base_proposer.py, vllm/v1/attention/backend.py, vllm/model_executor/models/llama.py and
vllm/model_executor/models/interfaces.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from functools import partial

import numpy as np
import torch

from draft_opd_ray.rollout import verify_capture as vc


def _flat(src: str) -> str:
    return re.sub(r"\s+", "", src)


def test_the_pinned_vllm_is_the_one_installed() -> None:
    """The wrap was checked on `TESTED_VLLM`; another version must be checked again (check_teacher) and pinned."""
    from draft_opd_ray.rollout.support import vllm_version

    assert (vllm_version() or "").endswith(f" {vc.TESTED_VLLM}"), vllm_version()


def test_v1_sampler_signature_and_placeholder() -> None:
    """vllm/v1/sample/rejection_sampler.py: `forward(metadata, draft_probs, logits, sampling_metadata)`, rejected
    positions marked `PLACEHOLDER_TOKEN_ID` (-1) in `sampled_token_ids`."""
    from vllm.v1.sample import rejection_sampler as rs

    params = list(inspect.signature(rs.RejectionSampler.forward).parameters)
    assert params == ["self", "metadata", "draft_probs", "logits", "sampling_metadata"]
    assert rs.PLACEHOLDER_TOKEN_ID == vc.PLACEHOLDER


def test_v1_runner_holds_and_calls_the_sampler_as_wrapped() -> None:
    """vllm/v1/worker/gpu_model_runner.py: the runner keeps the sampler in the instance attribute `ATTRIBUTE`,
    calls it positionally with (metadata, draft_probs, logits, sampling_metadata) on the raw logits, and keeps
    the token positions in `self.positions`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    init = _flat(inspect.getsource(GPUModelRunner.__init__))
    assert f"self.{vc.ATTRIBUTE}=RejectionSampler(" in init
    assert "self.positions=torch.zeros(" in init
    sample = _flat(inspect.getsource(GPUModelRunner._sample))
    assert f"self.{vc.ATTRIBUTE}(spec_decode_metadata,draft_probs,logits,sampling_metadata,)" in sample


def test_v1_rows_are_contiguous_per_request_with_the_bonus_last() -> None:
    """vllm/v1/worker/gpu_model_runner.py (`_calc_spec_decode_metadata`, run here on vLLM's own example) and
    vllm/v1/spec_decode/metadata.py: request b owns logits rows first_b..first_b + K'_b, its K'_b draft rows and
    then its bonus row; the capture reads exactly those, and the drafted ids vLLM verifies."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = {f.name for f in dataclasses.fields(SpecDecodeMetadata)}
    assert {"draft_token_ids", "num_draft_tokens", "logits_indices", "bonus_logits_indices"} <= fields
    fake = types.SimpleNamespace(
        _arange_scratch=np.zeros(1024, dtype=np.int32),
        arange_np=np.arange(1024, dtype=np.int64),
        input_ids=types.SimpleNamespace(gpu=torch.arange(1024) + 9000),
        device=torch.device("cpu"),
    )
    fake._get_cumsum_and_arange = partial(GPUModelRunner._get_cumsum_and_arange, fake)
    num_draft = np.array([3, 0, 2, 0, 1], dtype=np.int32)
    meta = GPUModelRunner._calc_spec_decode_metadata(fake, num_draft, np.array([4, 104, 107, 207, 209]))
    first = np.concatenate([[0], np.cumsum(num_draft + 1)[:-1]])
    assert meta.bonus_logits_indices.tolist() == (first + num_draft).tolist()
    targets = np.concatenate([np.arange(f, f + n) for f, n in zip(first, num_draft)])
    assert meta.target_logits_indices.tolist() == targets.tolist()

    accepted = [1, 0, 2, 0, 0]

    def inner(metadata, draft_probs, logits, sampling_metadata):  # type: ignore[no-untyped-def]
        out = torch.full((5, metadata.max_spec_len + 1), vc.PLACEHOLDER)
        for b, a in enumerate(accepted):
            out[b, : a + 1] = 0
        return types.SimpleNamespace(sampled_token_ids=out)

    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=[f"r{b}-x" for b in range(5)]),
        positions=torch.arange(1024) * 2,
        input_ids=fake.input_ids,  # the buffer vLLM read the drafted ids from
        requests={f"r{b}-x": types.SimpleNamespace(prompt_token_ids=[b]) for b in range(5)},
        rejection_sampler=inner,
    )
    cap = vc.install(runner, 2, None)
    runner.rejection_sampler(meta, None, torch.randn(int(first[-1]) + 2, 16), None)
    steps = cap.take()
    assert sorted(steps) == ["r0-x", "r2-x", "r4-x"]
    # the drafted ids are the tokens after each draft row's token (vLLM's draft_token_ids), anchors the first row's
    assert steps["r0-x"].drafted == [[9001, 9002, 9003]] and steps["r0-x"].anchor_pos == [0]
    assert steps["r2-x"].drafted == [[9105, 9106]] and steps["r2-x"].anchor_pos == [2 * 104]
    assert steps["r4-x"].drafted == [[9208]] and steps["r4-x"].anchor_pos == [2 * 207]
    assert [steps[r].accepted for r in ("r0-x", "r2-x", "r4-x")] == [[1], [2], [0]]
    # the committed token each block follows: the input id at its first row, one before its first drafted id
    assert [steps[r].anchor_ids for r in ("r0-x", "r2-x", "r4-x")] == [[9000], [9104], [9207]]


def test_v2_runner_calls_the_sampler_as_wrapped() -> None:
    """vllm/v1/worker/gpu/model_runner.py: V2 keeps the sampler in `ATTRIBUTE`, calls it with (logits,
    input_batch, draft_logits, invalid_drafts), lays out K'_b + 1 logits rows per request (`cu_num_logits_np`)
    unless adaptive verification or several sampled tokens per step change that (the capture refuses those:
    `v2_rows_are_host_known` reads these two attributes), and holds the draft in `speculator`."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner)
    flat = _flat(src)
    assert f"self.{vc.ATTRIBUTE}:RejectionSampler|None=None" in flat
    assert f"sampler_output=self.{vc.ATTRIBUTE}(logits,input_batch," in flat
    assert "self.speculator.draft_logits,invalid_drafts,)" in flat
    assert "num_logits=num_draft_tokens_per_req+num_bonus_tokens" in flat
    assert "num_bonus_tokens=self.model_state.num_new_sampled_tokens_per_step" in flat
    assert "self.adaptive_verification=maybe_create_adaptive_verification_manager(" in flat
    assert "self.speculator" in src and "self.drafter" not in src


def test_v2_sampler_signature_and_output() -> None:
    """vllm/v1/worker/gpu/spec_decode/rejection_sampler.py: `__call__(logits, input_batch, draft_logits,
    invalid_drafts)`, its output counts the sampled tokens per request (`num_sampled` = accepted + 1)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    params = list(inspect.signature(RejectionSampler.__call__).parameters)
    assert params == ["self", "logits", "input_batch", "draft_logits", "invalid_drafts"]
    assert "num_sampled=num_sampled," in _flat(inspect.getsource(RejectionSampler.__call__))


def test_v2_input_batch_has_the_fields_the_capture_reads() -> None:
    """vllm/v1/worker/gpu/input_batch.py: `InputBatch` carries the ids, count, row offsets, token indices,
    positions and input ids the V2 row map reads."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    fields = {f.name for f in dataclasses.fields(InputBatch)}
    assert {"req_ids", "num_reqs", "cu_num_logits_np", "logits_indices", "positions", "input_ids"} <= fields


def test_the_prompt_and_committed_tokens_come_from_where_the_runners_keep_them() -> None:
    """What a server's capture rebuilds a request from (`prompt_ids`, `live_requests`, the anchor rows' input ids):
    vllm/v1/worker/gpu_model_runner.py keeps each request's `CachedRequestState` (with `prompt_token_ids`,
    vllm/v1/worker/gpu_input_batch.py) in `self.requests` until it finishes, and the step's input ids in the
    `CpuGpuBuffer` `self.input_ids`; vllm/v1/worker/gpu/states.py (Model Runner V2) keeps `req_id_to_index`,
    `prompt_len` (host `.np`) and `all_token_ids` (device `.gpu`) rows, prompt first."""
    from vllm.v1.worker.gpu.states import RequestState
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    init = _flat(inspect.getsource(GPUModelRunner.__init__))
    assert "self.requests:dict[str,CachedRequestState]={}" in init
    assert "self.input_ids=self._make_buffer(self.max_num_tokens,dtype=torch.int32)" in init
    assert "prompt_token_ids" in {f.name for f in dataclasses.fields(CachedRequestState)}
    update = _flat(inspect.getsource(GPUModelRunner._update_states))
    assert "self.requests.pop(req_id,None)" in update  # a finished request leaves `requests`
    states = _flat(inspect.getsource(RequestState))
    for name in (
        "self.req_id_to_index:dict[str,int]={}",
        "self.all_token_ids=StagedWriteTensor(",
        "self.prompt_len=UvaBackedTensor(",
        "self.all_token_ids.stage_write(req_idx,0,all_token_ids)",
    ):
        assert name in states, name
    add = _flat(inspect.getsource(RequestState.add_request))
    assert "self.prompt_len.np[req_idx]=prompt_len" in add


def test_worker_request_ids_map_back_to_the_callers() -> None:
    """vllm/v1/engine/input_processor.py: the engine core and its workers see the caller's id plus "-" and 8
    random characters; `external_id` gives the caller's back."""
    from vllm.v1.engine.input_processor import InputProcessor

    for rid in ("0", "17", "chat-cmpl-abc"):
        req = types.SimpleNamespace(request_id=rid, external_req_id=None)
        InputProcessor.assign_request_id(req)  # type: ignore[arg-type]
        assert req.request_id != rid and vc.external_id(req.request_id) == rid


def test_a_capturing_engine_keeps_vllms_scheduling() -> None:
    """A recording engine with capture has no scheduler subclass and leaves async scheduling and prefix caching as
    vLLM chooses (on CUDA: async on); it carries the worker extension."""
    from draft_opd_ray.rollout.engine import EngineRun, _engine_kwargs
    from draft_opd_ray.rollout.worker_ext import EXTENSION

    spec = {"method": "eagle3", "model": "d", "num_speculative_tokens": 4}
    kw = _engine_kwargs(spec, True, True, EngineRun("t", "eagle3", "d", capture_topk=16))
    assert "scheduler_cls" not in kw and "async_scheduling" not in kw
    assert kw["worker_extension_cls"] == EXTENSION and "enable_prefix_caching" not in kw
    old = _engine_kwargs(spec, True, True, EngineRun("t", "eagle3", "d"))
    assert old["async_scheduling"] is False and "scheduler_cls" in old


def test_v1_runner_hands_the_drafter_the_feature_rows_by_keyword() -> None:
    """vllm/v1/worker/gpu_model_runner.py (`propose_draft_token_ids`), vllm/v1/spec_decode/llm_base_proposer.py and
    vllm/v1/attention/backend.py: EAGLE-3's drafter is called by keyword with the target's auxiliary rows
    (`target_hidden_states`, concatenated), their `target_positions` and `common_attn_metadata`, whose
    `query_start_loc_cpu` splits the rows by request in batch order; `propose` takes those names. The feature
    capture (`FeatureTap`) reads exactly these."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = _flat(inspect.getsource(GPUModelRunner.propose_draft_token_ids))
    assert "self.drafter.propose(num_speculative_tokens=" in src
    for name in ("target_positions=target_positions", "target_hidden_states=target_hidden_states"):
        assert name in src, name
    assert "common_attn_metadata=common_attn_metadata" in src
    assert "target_hidden_states=torch.cat([h[:total_num_tokens]forhinaux_hidden_states],dim=-1)" in src
    params = inspect.signature(SpecDecodeBaseProposer.propose).parameters
    assert {"target_positions", "target_hidden_states", "common_attn_metadata"} <= set(params)
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert "query_start_loc_cpu" in fields


def test_eagle3_aux_rows_are_hfs_hidden_states_at_the_same_ids() -> None:
    """vllm/model_executor/models/llama.py and vllm/model_executor/models/interfaces.py: after layer idx runs, the
    row for auxiliary id idx+1 is `hidden_states + residual` (the residual stream leaving layer idx), and id
    `start_layer` is the embeddings: HF's `hidden_states[i]` for every id below the last layer, the rows the
    replay ships (`opd/replay.py`)."""
    from vllm.model_executor.models import interfaces, llama

    model = _flat(inspect.getsource(llama.LlamaModel.forward))
    assert "self._maybe_add_hidden_state(aux_hidden_states,self.start_layer,hidden_states,residual)" in model
    assert "self._maybe_add_hidden_state(aux_hidden_states,idx+1,hidden_states,residual)" in model
    add = _flat(inspect.getsource(interfaces))
    assert "value=hidden_states+residualifresidualisnotNoneelsehidden_states" in add
