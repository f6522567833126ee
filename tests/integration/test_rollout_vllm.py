"""Rollout on the real vLLM CPU engine: lossless greedy speculative decoding, anchor records that match
vLLM's own counters, bad requests isolated, and in-place draft weight updates through a Ray rollout worker.

Target: the embedded SmolLM2-135M (fp32). Draft: the target without its last layer (standalone kind), which
accepts about half of its proposals, so both accepts and rejections are exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_opd_ray.rollout.engine import Sampling
from draft_opd_ray.rollout.records import tau, tau_vllm
from draft_opd_ray.wire import consistency_error
from tests.helpers import chat_prompt_ids, perturbed, spec_engine

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Explain what a prime number is.",
    "Give me a tip for learning to cook.",
    "What is 12 times 12?",
]
NUM_SPECULATIVE_TOKENS = 4
SAMPLING = Sampling(max_new_tokens=48, stop_token_ids=(2,))


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_target):
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

    target = embedded_target
    draft = build_standalone_from_target(target, tmp_path_factory.mktemp("draft"), layer_ids=list(range(29)))
    return target, draft, chat_prompt_ids(target, QUESTIONS)


@pytest.fixture(scope="module")
def plain_tokens(models):
    target, _, prompts = models
    engine = spec_engine(target, "none", None, NUM_SPECULATIVE_TOKENS, max_model_len=1024)
    try:
        return [r.response_ids for r in engine.generate(prompts, SAMPLING)]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def worker(models):
    import ray

    from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.rollout.engine import EngineRun
    from draft_opd_ray.rollout.worker import RolloutWorker

    target, draft, _ = models
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    actor = ray.remote(num_cpus=1)(RolloutWorker).remote(
        0,
        EngineRun(str(target), "standalone", str(draft)),
        DraftConfig(kind="standalone", num_speculative_tokens=NUM_SPECULATIVE_TOKENS),
        TargetConfig(max_model_len=1024),
        RolloutConfig(),
    )
    yield actor
    ray.get(actor.shutdown.remote())
    ray.shutdown()


def near_tie(target_path, prefix: list[int], a: int, b: int) -> bool:
    """True when the target's logits for tokens a and b after `prefix` are within numerical noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    return abs(float(logits[a] - logits[b])) < 1e-3


def test_greedy_speculative_equals_plain_and_records_match_vllm(models, plain_tokens, worker) -> None:
    import ray

    target, _, prompts = models
    recs = ray.get(worker.generate.remote(prompts, SAMPLING))
    for prompt, want, rec in zip(prompts, plain_tokens, recs):
        got = rec.response_ids
        if got != want:  # acceptable only at a numerical near-tie of the target's top two logits
            i = next(j for j, (x, y) in enumerate(zip(got, want)) if x != y)
            assert near_tie(target, prompt + want[:i], got[i], want[i]), (i, got[i], want[i])
        assert consistency_error(rec) is None, consistency_error(rec)
        assert rec.num_steps == rec.vllm_steps and sum(rec.accepted) == rec.vllm_accepted
        assert all(v == 0 for v in rec.policy_version)
    t, tv = tau(recs), tau_vllm(recs)
    assert abs(t / tv - 1) < 0.01, (t, tv)  # P2
    assert 1.2 < t < NUM_SPECULATIVE_TOKENS + 1  # accepts and rejections both happen with this draft
    assert any(a < NUM_SPECULATIVE_TOKENS for r in recs for a in r.accepted) and any(
        a > 0 for r in recs for a in r.accepted
    )


def test_bad_requests_do_not_disturb_the_batch(models, plain_tokens, worker) -> None:
    import ray

    _, _, prompts = models
    batch = [prompts[0], [], prompts[1], [5] * 2000]
    recs = ray.get(worker.generate.remote(batch, SAMPLING))
    assert recs[1].error == "empty prompt" and recs[1].finish_reason == "error"
    assert "exceeds max_model_len 1024" in recs[3].error
    assert recs[0].response_ids == plain_tokens[0] and recs[2].response_ids == plain_tokens[1]


def test_invalid_sampling_is_rejected(worker, models) -> None:
    import ray

    _, _, prompts = models
    with pytest.raises(ray.exceptions.RayTaskError, match="sampling.temperature: must be >= 0"):
        ray.get(worker.generate.remote(prompts[:1], Sampling(temperature=-1.0)))


# object_store (the transport between nodes) costs another 100 s of engine time: the slow tier runs it, as it does
# test_refit_vllm.py's
@pytest.mark.parametrize("transport", ["shm_file", pytest.param("object_store", marks=pytest.mark.slow)])
def test_weight_update_changes_tau_and_returns(models, worker, transport: str) -> None:
    import ray
    from safetensors.torch import load_file

    from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync

    _, draft, prompts = models
    original = load_file(str(draft / "model.safetensors"))
    noisy = perturbed(original, 0.3, seed=0)
    sync = SharedFileWeightSync([worker]) if transport == "shm_file" else ObjectStoreWeightSync([worker])
    before = ray.get(worker.generate.remote(prompts, SAMPLING))
    sync.publish(1, noisy)
    changed = ray.get(worker.generate.remote(prompts, SAMPLING))  # runs after the swap (actor call order)
    sync.publish(2, original)
    back = ray.get(worker.generate.remote(prompts, SAMPLING))
    assert sync.wait() == [2]  # the last publication, already applied
    assert all(v == 1 for r in changed for v in r.policy_version)
    assert all(v == 2 for r in back for v in r.policy_version)
    assert tau(changed) < tau(before) - 0.3, (tau(before), tau(changed))
    assert tau(back) == pytest.approx(tau(before), abs=1e-9)
    assert [r.response_ids for r in back] == [r.response_ids for r in before]  # the target never changed
    assert [r.response_ids for r in changed] == [r.response_ids for r in before]
    if isinstance(sync, SharedFileWeightSync):  # slot files are reused once applied, removed on close
        assert sync.slots <= 2
        sync.close()
        assert not Path(sync.dir).exists()
    with pytest.raises(ValueError, match="must increase"):
        sync.publish(2, original)
