"""Adding a draft kind is one folder and one table line: a toy kind that lives in the test suite
(`tests/kinds/toykind/`) goes, once its `KIND` is in the table, through every path that reads the table, with no
other edit: config validation and placement, vLLM's speculative_config, the SFT recipe and its optimizer step,
the exported folder's check, the replay and the Draft-OPD student, a fresh start, the reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.config.store import compose
from draft_opd_ray.drafts import registry
from draft_opd_ray.drafts.recipe import RecipeInputs
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.optim import trainable_parameters
from draft_opd_ray.preflight import validate
from draft_opd_ray.rollout.engine import speculative_config
from draft_opd_ray.sft.features import SeqFeatures
from draft_opd_ray.sft.trainer import collate
from tests.kinds import toykind


def _cached(seq: list[int], prompt_len: int, vocab: int, g: torch.Generator) -> SeqFeatures:
    """One trajectory as the SFT feature pass caches it for a draft without target features."""
    n = len(seq)
    top = torch.randint(0, vocab, (n, 4), generator=g)
    p = torch.softmax(torch.randn(n, 4, generator=g), -1)
    return SeqFeatures(torch.tensor(seq), prompt_len, torch.zeros(n, 0), top, p, top[:, 0])


def test_a_new_kind_is_one_folder_and_one_table_line(
    monkeypatch: pytest.MonkeyPatch, replay_case, tmp_path: Path
) -> None:
    from draft_opd_ray.driver import initial_draft
    from draft_opd_ray.rollout.reference import speculative_generate, target_generate

    monkeypatch.setitem(registry.KINDS, toykind.KIND.name, toykind.KIND)  # the table line
    target, kind = replay_case.target, registry.draft_kind("toy")

    # config: validation accepts the kind, runs its own check, and places it
    plan = validate(compose(["draft.kind=toy"]))
    assert [s.holds for s in plan.slots if s.role == "learner"] == [
        "toy draft (trainable) + AdamW state (full replica)"
    ]
    with pytest.raises(ConfigError, match="draft.num_layers: a toy draft has one layer, got 2"):
        validate(compose(["draft.kind=toy", "draft.num_layers=2"]))
    # vLLM serves it with its method
    spec = speculative_config("toy", "d", 4)
    assert spec == {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}

    # SFT: the recipe builds, and one optimizer step moves its weights and lowers its loss on that batch
    draft = DraftConfig(kind="toy")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (16, 11)]
    recipe = kind.recipe(target, draft, RecipeInputs(seqs, [5, 4]))
    assert recipe.kind == "toy" and recipe.model.config.num_hidden_layers == 1
    batch = collate([_cached(s, p, 300, g) for s, p in zip(seqs, (5, 4))], torch.float32)
    opt = torch.optim.SGD(trainable_parameters(recipe.model, "toy", draft.train_lm_head), lr=0.5)
    before, _ = recipe.loss(recipe.model, batch)
    before.backward()
    opt.step()
    after, _ = recipe.loss(recipe.model, batch)
    assert torch.isfinite(before) and float(after.detach()) < float(before.detach())
    folder = recipe.save(recipe.model, tmp_path / "toy", target)
    kind.check_folder(target, folder)

    # Draft-OPD: the replay ships what it needs, and its student scores the replayed blocks: the same states as
    # the standalone kind's packed forward over the same folder (here, one plain forward per block position)
    (t,) = replay_case.replay("toy", folder).score([replay_case.item])
    student = kind.student(str(folder), str(target))
    with torch.no_grad():
        got = student.block_hidden(t)
        want = registry.draft_kind("standalone").student(str(folder), str(target)).block_hidden(t)
    valid = torch.arange(t.drafted.shape[1])[None] < t.valid_len[:, None]  # (N, K)
    assert torch.allclose(got[valid], want[valid], atol=1e-4)
    assert student.rollout_state().keys() <= recipe.model.state_dict().keys()

    # a fresh start (the opd stage without SFT or draft.path), and the reference engine drafts losslessly
    fresh = initial_draft(compose(["draft.kind=toy"]), str(target), tmp_path / "run")
    kind.check_folder(target, fresh)
    prompts = [[1, 45, 900, 12], [7, 300]]
    drafter = kind.drafter(replay_case.model, folder, target)
    recs = speculative_generate(
        replay_case.model, drafter, prompts, num_speculative_tokens=3, max_new_tokens=8
    )
    assert [r.response_ids for r in recs] == target_generate(replay_case.model, prompts, max_new_tokens=8)


def test_the_table_knows_the_toy_kind_only_through_its_line() -> None:
    """Without the line the kind is unknown, as any other name."""
    assert "toy" not in registry.KINDS
    with pytest.raises(
        ConfigError, match=r"^draft\.kind: must be one of \['eagle3', 'standalone', 'dflash'\]"
    ):
        validate(compose(["draft.kind=toy"]))
