"""`measure_drafts` (the study's evaluation: several drafts, one vLLM engine, weights swapped in) proves each
swap on the real vLLM CPU engine: after a draft's weights go in, the engine's fingerprints of what it serves must
be that draft's (`sync.refit.check_ack`), and a draft that lacks a tensor the first draft had is refused before
anything is measured (vLLM would keep the previous draft's values for it, with a log line only). One engine on
the tiny target, EAGLE-3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.errors import RefitError
from tests.helpers import perturbed

pytestmark = pytest.mark.vllm


def _drafts(target: Path, root: Path) -> list[Path]:
    """Three EAGLE-3 heads on the tiny target: a fresh one and two perturbed copies of it."""
    from safetensors.torch import load_file, save_file

    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    torch.manual_seed(0)
    first = save_eagle3(init_eagle3(target, aux_layer_ids=[0, 1, 2]), root / "a", target)
    out = [first]
    for i, name in enumerate(("b", "c")):
        folder = root / name
        folder.mkdir()
        for f in first.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        save_file(
            perturbed(load_file(str(first / "model.safetensors")), 0.5, seed=i),
            str(folder / "model.safetensors"),
        )
        out.append(folder)
    return out


def test_each_swap_is_proven_and_a_swap_that_did_not_take_stops(
    tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draft_opd_ray.eval.tau import measure_drafts
    from draft_opd_ray.rollout.engine import SpecDecodeEngine

    a, b, c = _drafts(tiny_target, tmp_path)
    load = SpecDecodeEngine.load_draft_weights
    swaps: list[int] = []

    def load_stale_at_2(self: Any, weights: dict[str, Any], version: int) -> None:
        """A swap that does not take for the third draft: the engine keeps the second one's values."""
        from safetensors.torch import load_file

        swaps.append(version)
        if version == 2:
            weights = load_file(str(b / "model.safetensors"))
        load(self, weights, version)

    monkeypatch.setattr(SpecDecodeEngine, "load_draft_weights", load_stale_at_2)
    measured: list[str] = []
    prompts = [[1, 17, 42, 99, 7, 250], [1, 5, 301, 12]]
    with pytest.raises(RefitError, match="served values differ") as err:
        measure_drafts(
            tiny_target,
            "eagle3",
            [a, b, c],
            prompts,
            num_speculative_tokens=4,
            max_new_tokens=8,
            on_measured=lambda d, e: measured.append(d),
        )
    assert str(c) in str(err.value) and "version 2" in str(err.value)
    assert measured == [str(a), str(b)] and swaps == [1, 2]  # b's swap was proven; c was never measured


def test_a_draft_without_a_tensor_of_the_first_is_refused(tmp_path: Path) -> None:
    """Before the engine's proof: the names a swap must cover are the first draft's (no engine needed)."""
    from draft_opd_ray.eval.tau import check_swap

    class NoEngine:
        def refit_ack(self, receiver: str) -> Any:
            raise AssertionError("the tensor names are checked first")

    weights = {"fc.weight": torch.zeros(2, 2), "norm.weight": torch.ones(2)}
    with pytest.raises(
        RefitError, match=r"lacks 1 tensors the first draft has \(midlayer.hidden_norm.weight\)"
    ):
        check_swap(NoEngine(), weights, 1, {*weights, "midlayer.hidden_norm.weight"}, "d")
