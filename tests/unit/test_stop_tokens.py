"""Stop tokens come from the target, never from SmolLM2's vocabulary: a target whose answers end at ids 300 / 301
(config.json and generation_config.json) and 302 (its tokenizer's eos), none of them 2, is sampled with all three
by every stage (the SFT answers, Draft-OPD's rollouts, eval, the reference engine), and the caches of what the
answers made are keyed by them."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.config.schema import (
    ClusterConfig,
    Config,
    DataConfig,
    DraftConfig,
    EvalConfig,
    PromptSetConfig,
    RolloutConfig,
    TargetConfig,
    WandbConfig,
)
from draft_opd_ray.models.target import read_target_info, stop_token_ids, target_stop_token_ids

STOPS = (300, 301, 302)


class Stop(Exception):
    """Ends a stage at the call a test looks at."""


@pytest.fixture(scope="module")
def qwen_like_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with eos 300 in config.json, [300, 301] in generation_config.json and the tokenizer's eos
    token moved to id 302 (as Qwen3: several eos ids, none of them 2)."""
    out = tmp_path_factory.mktemp("stops") / "target"
    shutil.copytree(tiny_target, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 300, "pad_token_id": 300}))
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [300, 301]}))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok, "eos_token": "st"}))  # "st" is id 302
    return out


def test_stop_ids_are_every_eos_id_of_the_target(qwen_like_target: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_like_target)
    assert tok.eos_token_id == 302
    info = read_target_info(qwen_like_target)
    assert stop_token_ids(info, tok) == target_stop_token_ids(qwen_like_target) == STOPS
    assert stop_token_ids(info) == (300, 301)  # without a tokenizer: the config files' only
    # a tokenizer eos the config files already name is not repeated
    assert stop_token_ids(info, type("Tok", (), {"eos_token_id": 301})()) == (300, 301)


def test_reference_engine_stops_at_the_first_of_any_stop_id() -> None:
    from draft_opd_ray.drafts.standalone.drafter import CausalLMDrafter
    from draft_opd_ray.rollout.reference import speculative_generate, target_generate
    from tests.helpers import tiny_lm

    target, draft = tiny_lm(64, 0), tiny_lm(64, 1)
    prompts = [[5, 9, 11, 3]]
    free = target_generate(target, prompts, max_new_tokens=30)[0]
    late, early = free[12], free[6]  # two tokens it emits; the answer must end after whichever comes first
    cut = min(free.index(late), free.index(early)) + 1
    stops = (late, early)
    assert target_generate(target, prompts, max_new_tokens=30, stop_token_ids=stops)[0] == free[:cut]
    recs = speculative_generate(
        target,
        CausalLMDrafter(draft),
        prompts,
        num_speculative_tokens=3,
        max_new_tokens=30,
        stop_token_ids=stops,
    )
    assert recs[0].response_ids == free[:cut] and recs[0].finish_reason == "stop"
    # no stop ids: only the length ends it
    recs = speculative_generate(
        target, CausalLMDrafter(draft), prompts, num_speculative_tokens=3, max_new_tokens=30
    )
    assert recs[0].response_ids == free and recs[0].finish_reason == "length"


def _cfg(target: Path, tmp_path: Path, stages: list[str]) -> Config:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?"}) + "\n" for i in range(6))
    )
    data = PromptSetConfig(source="jsonl", path=str(prompts), max_prompts=6)
    return dataclasses.replace(
        Config(),
        stages=stages,
        target=TargetConfig(path=str(target)),
        data=DataConfig(train=data, eval=dataclasses.replace(data)),
        cache_dir=str(tmp_path / "cache"),
        wandb=WandbConfig(mode="disabled"),
    )


def test_every_stage_gets_every_stop_id_of_the_target(
    qwen_like_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver hands the target's stop ids to the sft stage, the Draft-OPD loop and eval."""
    import draft_opd_ray.eval.evaluate as ev
    import draft_opd_ray.loop.opd as loop
    import draft_opd_ray.sft.stage as stage
    from draft_opd_ray.driver import prepare_inputs, run_stages

    got: dict[str, Any] = {}

    def sft(cfg: Config, **kw: Any) -> Path:
        got["sft"] = kw["stop_token_ids"]
        return tmp_path / "sft_draft"

    def opd(
        cfg: Config, plan: Any, target: str, draft: str, prompts: Any, stop: Any, *a: Any, **kw: Any
    ) -> Path:
        got["opd"] = stop
        return tmp_path / "opd_draft"

    def evaluate(run: Any, *configs: Any) -> dict[str, Any]:
        got["eval"] = run.stop_token_ids
        (tmp_path / "run" / "eval").mkdir(parents=True)
        (tmp_path / "run" / "eval" / "report.md").write_text("report\n")
        return {"datasets": {}}

    monkeypatch.setattr(stage, "run_sft_stage", sft)
    monkeypatch.setattr(loop, "run_opd", opd)
    monkeypatch.setattr(ev, "evaluate", evaluate)
    cfg = _cfg(qwen_like_target, tmp_path, ["sft", "opd", "eval"])
    inputs = prepare_inputs(cfg)
    assert inputs.stop == STOPS
    run_stages(cfg, None, tmp_path / "run", None, inputs)  # type: ignore[arg-type]
    assert got == {"sft": STOPS, "opd": STOPS, "eval": STOPS}


def test_sft_answers_stop_at_the_targets_ids_and_their_caches_are_keyed_by_them(
    qwen_like_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import draft_opd_ray.sft.data as data
    from draft_opd_ray.sft.data import cache_key
    from draft_opd_ray.sft.stage import _key, run_sft_stage

    seen: list[Any] = []

    def generate(target: Any, prompts: Any, cache: Any, **kw: Any) -> Path:
        seen.append(kw["stop_token_ids"])
        raise Stop

    monkeypatch.setattr(data, "generate_trajectories", generate)
    cfg = _cfg(qwen_like_target, tmp_path, ["sft"])
    with pytest.raises(Stop):
        run_sft_stage(cfg, target=str(qwen_like_target), prompts=[[5, 6, 7]], run_dir=tmp_path, metrics=None)
    assert seen == [STOPS]  # from the target itself when the driver names none
    with pytest.raises(Stop):
        run_sft_stage(
            cfg,
            target=str(qwen_like_target),
            prompts=[[5, 6]],
            run_dir=tmp_path,
            metrics=None,
            stop_token_ids=(9,),
        )
    assert seen[-1] == (9,)
    # the answers' cache and the warm start's are keyed by the stop ids
    assert cache_key(qwen_like_target, [[5]], 8, STOPS) != cache_key(qwen_like_target, [[5]], 8, (2,))
    assert _key(cfg, "t", [[5]], STOPS) != _key(cfg, "t", [[5]], (300,))


def test_eval_samples_with_every_stop_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `evaluate` asks of the engine (the engine's own stopping at those ids: vLLM's, tested there)."""
    import draft_opd_ray.eval.evaluate as ev

    class Engine:
        def __init__(self, *a: Any, **kw: Any) -> None:
            pass

        def generate(self, prompts: Any, sampling: Any) -> Any:
            assert sampling.stop_token_ids == STOPS
            raise Stop

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(ev, "SpecDecodeEngine", Engine)
    with pytest.raises(Stop):
        ev.evaluate(
            ev.EvalRun("t", None, {"d": [[1, 2]]}, tmp_path, STOPS),
            EvalConfig(max_new_tokens=4, concurrency=[1], baselines=[]),
            DraftConfig(kind="eagle3", num_speculative_tokens=2),
            TargetConfig(),
            RolloutConfig(),
            ClusterConfig(),
        )
