"""The draft kinds in one table: what each is, how vLLM serves it, and where its pieces live.

    kind        vLLM method   conditions on target features   can start without SFT or draft.path
    eagle3      eagle3        yes (aux layer inputs)          yes (a fresh head)
    standalone  draft_model   no (a causal LM of its own)     no
    dflash      dflash        yes (target layer outputs)      no

Each entry finds, by name and imported when first used (so this module stays free of torch and of the packages
above `models/`), its loader and saver (the vLLM-served folder format), the Draft-OPD student
(`opd/students.py`), the SFT recipe (`sft/recipes.py`) and the reference-engine drafter (`rollout/drafters.py`).
Everything that depends on the kind asks this table; no other module compares kind names. The kind-specific
config checks live here too, for the same reason.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import ConfigError, ModelError


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DraftKind:
    """One row of the table. Its pieces are found by convention from the name (e.g. "eagle3"):
    models/<name>.py: load_<name>, save_<name>, fresh_<name>; sft/recipes.py: <name>_recipe;
    rollout/drafters.py: <name>_drafter; opd/students.py: <student_class>Student."""

    name: str
    vllm_method: str  # speculative_config["method"]
    architecture: str  # config.json "architectures" of the exported folder ("" = the target's own)
    feature_conditioned: bool  # needs target hidden states (replay ships them)
    starts_fresh: bool  # the opd stage may start from a freshly initialised draft
    student_class: str
    lm_head_option: bool = False  # has an LM head of its own that `draft.train_lm_head` may train

    def load(self, path: str | os.PathLike[str], target: str | os.PathLike[str]) -> Any:
        return _resolve(f"draft_opd_ray.models.{self.name}:load_{self.name}")(path, target)

    def save(self, model: Any, out: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
        return Path(_resolve(f"draft_opd_ray.models.{self.name}:save_{self.name}")(model, out, target))

    def student(self) -> Callable[..., Any]:
        return _resolve(f"draft_opd_ray.opd.students:{self.student_class}Student")  # type: ignore[no-any-return]

    def recipe(self) -> Callable[..., Any]:
        return _resolve(f"draft_opd_ray.sft.recipes:{self.name}_recipe")  # type: ignore[no-any-return]

    def drafter(self, target_model: Any, path: str | os.PathLike[str], target: str | os.PathLike[str]) -> Any:
        return _resolve(f"draft_opd_ray.rollout.drafters:{self.name}_drafter")(target_model, path, target)

    def fresh(self, target: str | os.PathLike[str], draft: Any, seed: int) -> Any:
        """A freshly initialised draft for ``draft`` (a DraftConfig)."""
        if not self.starts_fresh:
            raise ConfigError(f"draft.path: a {self.name} draft needs draft.path or the sft stage")
        return _resolve(f"draft_opd_ray.models.{self.name}:fresh_{self.name}")(target, draft, seed)


KINDS: dict[str, DraftKind] = {
    k.name: k
    for k in (
        DraftKind("eagle3", "eagle3", "LlamaForCausalLMEagle3", True, True, "Eagle3", lm_head_option=True),
        DraftKind("standalone", "draft_model", "", False, False, "Standalone"),
        DraftKind("dflash", "dflash", "DFlashDraftModel", True, False, "DFlash"),
    )
}


def draft_kind(name: str) -> DraftKind:
    if name not in KINDS:
        raise ConfigError(f"draft.kind: must be one of {list(KINDS)}, got {name!r}")
    return KINDS[name]


# --------------------------------------------------------------------------------------------------
# Kind-specific checks (config only: no weights are read)
# --------------------------------------------------------------------------------------------------


def check_draft_config(d: Any) -> None:
    """What a DraftConfig can refute on its own."""
    if d.train_lm_head and not draft_kind(d.kind).lm_head_option:
        raise ConfigError(
            f"draft.train_lm_head: a {d.kind} draft has no LM head of its own to train or freeze "
            "(only eagle3 has the option)"
        )
    if d.kind == "dflash" and d.num_speculative_tokens != d.block_size - 1:
        raise ConfigError(
            f"draft.num_speculative_tokens: DFlash proposes block_size - 1 = {d.block_size - 1} tokens per step, "
            f"got {d.num_speculative_tokens} (set both, e.g. draft.block_size=8 draft.num_speculative_tokens=7)"
        )


def check_draft_fits_target(d: Any, num_layers: int, vocab_size: int) -> None:
    """Layer ids and sizes that the target's config.json can already refute."""
    if d.kind == "eagle3" and d.aux_layer_ids is not None:
        bad = [i for i in d.aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(
                f"draft.aux_layer_ids: {bad} out of range for a target with {num_layers} layers"
            )
    if d.kind == "eagle3" and d.draft_vocab_size is not None and d.draft_vocab_size > vocab_size:
        raise ConfigError(
            f"draft.draft_vocab_size: {d.draft_vocab_size} exceeds the target vocabulary {vocab_size}"
        )
    if d.kind == "standalone" and d.path is None and not 1 <= d.num_layers < num_layers:
        raise ConfigError(
            f"draft.num_layers: a standalone draft made of target layers needs 1..{num_layers - 1} layers "
            f"(the target has {num_layers}), got {d.num_layers}"
        )
    if d.kind == "dflash" and d.mask_token_id is not None and not 0 <= d.mask_token_id < vocab_size:
        raise ConfigError(
            f"draft.mask_token_id: {d.mask_token_id} is outside the target vocabulary [0, {vocab_size})"
        )


def draft_vocabulary(d: Any, target_vocab: int) -> int:
    """The vocabulary the draft predicts over: an EAGLE-3 head its own (`draft.draft_vocab_size`, by default the
    most frequent 8,192 tokens or the whole vocabulary when smaller), the other kinds the target's."""
    return int(d.vocab_for(target_vocab)) if d.kind == "eagle3" else target_vocab


def check_draft_matches_target(target: Any, draft: str | Path, kind: str) -> None:
    """A draft folder made for this target and this kind (config.json only, no weights): the kind it was exported
    as, the target's hidden size and depth it conditions on, and a vocabulary it can share (EAGLE-3 maps its own
    via d2t). ``target``: its folder, or its `TargetInfo`."""
    from draft_opd_ray.models.target import TargetInfo

    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"draft.path: {draft} has no config.json (not an exported draft folder)")
    if isinstance(target, TargetInfo):
        t = {"hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers}
        t["vocab_size"] = target.vocab_size
    else:
        t = json.loads((Path(target) / "config.json").read_text())
        t = t.get("text_config", t)
    try:
        d = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ModelError(f"draft.path: {cfg_path} is not valid JSON ({e})") from None
    made = d.get("draft_opd", {})
    if made.get("kind") not in (None, kind):
        raise ModelError(f"draft.path: {draft} holds a draft of kind {made['kind']!r}, but draft.kind={kind}")
    if kind != "standalone":
        th, dh = t.get("hidden_size"), d.get("target_hidden_size", d.get("hidden_size"))
        if th != dh:
            raise ModelError(
                f"draft.path: the draft was made for a target of hidden size {dh}; this target's is {th} "
                "(a draft of another target)"
            )
    if made.get("target_num_layers") not in (None, t.get("num_hidden_layers")):
        raise ModelError(
            f"draft.path: the draft was made for a target of {made['target_num_layers']} layers; this target has "
            f"{t.get('num_hidden_layers')} (a draft of another target)"
        )
    tv = t.get("vocab_size")
    dv = d.get("vocab_size")
    if kind == "standalone" and tv != dv:
        raise ModelError(
            f"draft.path: draft vocabulary {dv} differs from the target's {tv}; a standalone draft "
            "must use the target's tokenizer"
        )
    if kind == "eagle3" and d.get("draft_vocab_size", dv) > tv:
        raise ModelError(
            f"draft.path: draft_vocab_size {d.get('draft_vocab_size')} exceeds the target's {tv}"
        )
