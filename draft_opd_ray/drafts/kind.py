"""What a draft kind is: its facts, its pieces, its own config checks. The table of kinds is `drafts/registry.py`.

Each kind is a folder `drafts/<kind>/` whose `__init__.py` builds one `KIND = DraftKind(...)`: its facts
(vLLM method, exported architecture, whether it conditions on target features, whether it can start fresh),
its pieces as real references (`Pieces`: the vLLM-format loader and saver in `model.py`, the Draft-OPD student
in `student.py`, the SFT recipe in `recipe.py`, the reference-engine drafter in `drafter.py`; handed over by a
small function of the kind's own package, so that reading the table loads no torch), and the checks only that
kind makes. Everything outside a kind's folder asks its `DraftKind`; no module compares kind names.

This module reads config.json files and safetensors headers (`models/safetensors_check.py`), never weights, and
imports no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.errors import ConfigError, ModelError
from draft_opd_ray.models.safetensors_check import Layout, check_layout, folder_tensors
from draft_opd_ray.sizing import Derived

if TYPE_CHECKING:
    from draft_opd_ray.drafts.recipe import Recipe, RecipeInputs
    from draft_opd_ray.drafts.student import Student

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Pieces:
    """A kind's torch-side pieces, imported when first used (the kind's `pieces()`)."""

    load: Callable[[PathLike, PathLike], Any]  # (draft folder, target folder) -> the draft, float32
    save: Callable[
        [Any, PathLike, PathLike], Path
    ]  # (draft, out folder, target folder) -> the folder vLLM serves
    student: Callable[[str, str], Student]  # (draft folder, target folder) -> the Draft-OPD student
    recipe: Callable[[PathLike, DraftConfig, RecipeInputs], Recipe]  # the SFT recipe
    drafter: Callable[
        [Any, PathLike, PathLike], Any
    ]  # (target model, draft folder, target folder) -> Drafter
    fresh: Callable[[PathLike, DraftConfig, int], Any] | None = None  # (target, draft, seed): a new draft

    @classmethod
    def of(cls, model: ModuleType, student: ModuleType, recipe: ModuleType, drafter: ModuleType) -> Pieces:
        """A kind folder's pieces by its modules' agreed names: `model.py` ends with ``load, save`` (and
        ``fresh`` where the kind can start fresh), `student.py` with ``student``, `recipe.py` with ``recipe``,
        `drafter.py` with ``drafter``."""
        fresh = model.fresh if hasattr(model, "fresh") else None
        return cls(model.load, model.save, student.student, recipe.recipe, drafter.drafter, fresh)


def _no_check(*_: Any) -> None:
    return None


def _target_vocabulary(_: DraftConfig, target_vocab: int) -> int:
    return target_vocab


def _target_vocabulary_row(_: DraftConfig, target: Any) -> list[Derived]:
    return [Derived("draft vocabulary", target.vocab_size, "the target's own (this kind predicts over it)")]


@dataclass(frozen=True)
class DraftKind:
    """One row of the table (`drafts/registry.py`)."""

    name: str
    vllm_method: str  # speculative_config["method"]
    architecture: str  # config.json "architectures" of the exported folder ("" = the target's own)
    feature_conditioned: (
        bool  # needs target hidden states (replay ships them); its hidden size is the target's
    )
    starts_fresh: bool  # the opd stage may start from a freshly initialised draft (`Pieces.fresh`)
    pieces: Callable[[], Pieces]
    lm_head_option: bool = False  # has an LM head of its own that `draft.train_lm_head` may train
    # vLLM's V1 drafter is handed the target features this kind conditions on, as the replay ships them (the
    # auxiliary layers' rows): the verify-pass capture can take them there (`rollout/verify_capture.FeatureTap`)
    features_from_drafter: bool = False
    # checkpoint-name fragments vLLM's draft module spells differently (beyond `sync/refit.served_key`'s rules)
    vllm_aliases: Mapping[str, str] = field(default_factory=dict)
    # the kind's own checks (no weights read), each raising ConfigError / ModelError:
    config_check: Callable[[DraftConfig], None] = _no_check  # what a DraftConfig refutes on its own
    # (draft, target layers, target vocabulary): layer ids and sizes the target's config.json refutes
    fits_check: Callable[[DraftConfig, int, int], None] = _no_check
    # (folder, its config.json, the target's sizes, the config key naming the folder): what an exported folder of
    # this kind must agree on
    folder_check: Callable[[PathLike, dict[str, Any], dict[str, Any], str], None] = _no_check
    # (its config.json, the target's sizes) -> the tensors an exported folder holds, by name, shape and dtype
    # (`drafts/<kind>/layout.py`); None, or no function: its safetensors files are only checked to be whole
    weights_layout: Callable[[dict[str, Any], dict[str, Any]], Layout | None] | None = None
    # (its config.json, its tensor names) -> what a folder in another trainer's layout of this kind is and what to
    # do with it, for the error line; None: not one it recognises
    foreign_layout: Callable[[dict[str, Any], Collection[str]], str | None] = _no_check
    # (draft, target vocabulary) -> the vocabulary the draft predicts over
    draft_vocabulary: Callable[[DraftConfig, int], int] = _target_vocabulary
    # (draft, the target's `TargetInfo`) -> the sizes the kind takes from the target, set or derived, with the
    # reason (`sizing.Derived`), for the dry run
    sizing: Callable[[DraftConfig, Any], list[Derived]] = _target_vocabulary_row

    # ---- the pieces ----------------------------------------------------------------------------------------------

    def load(self, path: PathLike, target: PathLike) -> Any:
        return self.pieces().load(path, target)

    def save(self, model: Any, out: PathLike, target: PathLike) -> Path:
        return Path(self.pieces().save(model, out, target))

    def student(self, draft_dir: str, target: str) -> Student:
        return self.pieces().student(draft_dir, target)

    def recipe(self, target: PathLike, draft: DraftConfig, src: RecipeInputs) -> Recipe:
        """The draft (fresh, or ``src.start_from`` an exported folder) and its SFT recipe."""
        return self.pieces().recipe(target, draft, src)

    def drafter(self, target_model: Any, path: PathLike, target: PathLike) -> Any:
        """The reference engine's drafter (`drafts/drafter.py`) of an exported folder."""
        return self.pieces().drafter(target_model, path, target)

    def fresh(self, target: PathLike, draft: DraftConfig, seed: int) -> Any:
        """A freshly initialised draft for ``draft``."""
        fresh = self.pieces().fresh if self.starts_fresh else None
        if fresh is None:
            raise ConfigError(f"draft.path: a {self.name} draft needs draft.path or the sft stage")
        return fresh(target, draft, seed)

    def replay_needs(self, draft_dir: str, target: str) -> tuple[list[int], list[int] | None]:
        """What the replay ships for this draft: the HF `hidden_states` indices of its target features and the
        target ids of its vocabulary (None: the target's whole vocabulary). A draft that conditions on no target
        features is an LM with the target's own vocabulary: nothing to load to know that."""
        if not self.feature_conditioned:
            return [], None
        s = self.student(draft_dir, target)
        return list(s.features), s.draft_ids

    # ---- config checks (no weights are read) ---------------------------------------------------------------

    def check_config(self, d: DraftConfig) -> None:
        """What a DraftConfig of this kind can refute on its own."""
        if d.train_lm_head and not self.lm_head_option:
            raise ConfigError(
                f"draft.train_lm_head: a {self.name} draft has no LM head of its own to train or freeze "
                "(only eagle3 has the option)"
            )
        self.config_check(d)

    def check_fits(self, d: DraftConfig, num_layers: int, vocab_size: int) -> None:
        """Layer ids and sizes that the target's config.json can already refute."""
        self.fits_check(d, num_layers, vocab_size)

    def vocabulary(self, d: DraftConfig, target_vocab: int) -> int:
        """The vocabulary the draft predicts over (the target's, unless the kind has its own)."""
        return self.draft_vocabulary(d, target_vocab)

    def check_folder(self, target: Any, draft: PathLike, key: str = "draft.path") -> None:
        """A draft folder made for this target and this kind, before any engine loads it: its config.json (the kind
        it was exported as, the target's hidden size (a feature-conditioned draft) and depth it was made for, what
        the kind's own `folder_check` asks) and its safetensors files, from their headers alone (each file whole, a
        layout of another trainer recognised, every tensor of the kind's `weights_layout` and no other). A folder
        without safetensors files (a config-only stand-in) has its config.json checked only. ``target``: its
        folder, or its `TargetInfo`; ``key``: the config key that names ``draft``, which starts the error line."""
        d, t = _folder_config(draft, key), _target_sizes(target)
        made = d.get("draft_opd", {})
        if made.get("kind") not in (None, self.name):
            raise ModelError(
                f"{key}: {draft} holds a draft of kind {made['kind']!r}, but draft.kind={self.name}"
            )
        tensors = folder_tensors(Path(draft), key)
        foreign = self.foreign_layout(d, tensors or {})
        if foreign:
            raise ModelError(f"{key}: {draft} is {foreign}")
        if self.feature_conditioned:
            th, dh = t.get("hidden_size"), d.get("target_hidden_size", d.get("hidden_size"))
            if th != dh:
                raise ModelError(
                    f"{key}: the draft was made for a target of hidden size {dh}; this target's is {th} "
                    "(a draft of another target)"
                )
        if made.get("target_num_layers") not in (None, t.get("num_hidden_layers")):
            raise ModelError(
                f"{key}: the draft was made for a target of {made['target_num_layers']} layers; this "
                f"target has {t.get('num_hidden_layers')} (a draft of another target)"
            )
        self.folder_check(draft, d, t, key)
        if tensors is not None and (layout := self._layout(d, t, draft, key)) is not None:
            check_layout(tensors, layout, Path(draft), key)

    def _layout(self, d: dict[str, Any], t: dict[str, Any], draft: PathLike, key: str) -> Layout | None:
        """The kind's `weights_layout` of a folder's config.json; a config.json without the sizes it reads is one
        ModelError line."""
        if self.weights_layout is None:
            return None
        try:
            return self.weights_layout(d, t)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(
                f"{key}: {Path(draft) / 'config.json'} lacks a size the {self.name} weights check reads ({e!r})"
            ) from None


def _folder_config(draft: PathLike, key: str) -> dict[str, Any]:
    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{key}: {draft} has no config.json (not an exported draft folder)")
    try:
        return json.loads(cfg_path.read_text())  # type: ignore[no-any-return]
    except ValueError as e:
        raise ModelError(f"{key}: {cfg_path} is not valid JSON ({e})") from None


def _target_sizes(target: Any) -> dict[str, Any]:
    """hidden_size, num_hidden_layers, vocab_size of a target folder's config.json (or of its `TargetInfo`)."""
    from draft_opd_ray.models.target import TargetInfo

    if isinstance(target, TargetInfo):
        return {
            "hidden_size": target.hidden_size,
            "num_hidden_layers": target.num_layers,
            "vocab_size": target.vocab_size,
        }
    t = json.loads((Path(target) / "config.json").read_text())
    return t.get("text_config", t)  # type: ignore[no-any-return]
