"""Registers the typed schema with Hydra and turns a composed DictConfig into a typed `Config`.

The schema node is built from the `Config` dataclass, so defaults are written once. Its `async_` field is
exposed as `async` (what users type: `async.max_staleness=4`).
"""

from __future__ import annotations

import re
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from draft_opd_ray.config.schema import Config

SCHEMA_NAME = "draft_opd_ray_schema"
_RENAMES = {"async_": "async"}


def schema_node() -> DictConfig:
    """The root node: every child is typed by its dataclass; the root itself is struct (no unknown keys)."""
    typed = OmegaConf.structured(Config)
    root = OmegaConf.create({_RENAMES.get(k, k): typed._get_node(k) for k in typed})
    OmegaConf.set_struct(root, True)
    return root


SLUG_MAX = 120  # characters of a sweep job's dir name, well under a file system's 255


def job_slug(overrides: str) -> str:
    """A sweep job's dir name from its override string: one path component (a `target.path=/models/x` override
    would otherwise nest the job's dir inside directories named after the path), at most `SLUG_MAX` characters
    (a long sweep keeps a readable head and a hash of the whole)."""
    import hashlib

    slug = re.sub(r"[^A-Za-z0-9=,.+_\-\[\]]", "_", overrides)
    if len(slug) > SLUG_MAX:
        slug = slug[: SLUG_MAX - 9] + "-" + hashlib.sha1(overrides.encode()).hexdigest()[:8]
    return slug


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema_node())
    if not OmegaConf.has_resolver("job_slug"):
        OmegaConf.register_new_resolver("job_slug", job_slug)


def to_config(cfg: DictConfig) -> Config:
    """Convert a composed config to `Config`, running every node's `__post_init__` checks."""
    back = {v: k for k, v in _RENAMES.items()}
    kwargs: dict[str, Any] = {}
    for key in cfg:
        if key == "hydra":
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            value: Any = OmegaConf.to_object(node)
        elif isinstance(node, ListConfig):
            value = OmegaConf.to_container(node)
        else:
            value = cfg[key]
        kwargs[back.get(str(key), str(key))] = value
    return Config(**kwargs)


def compose(overrides: list[str] | None = None) -> Config:
    """Compose the packaged `conf/config.yaml` with overrides outside of `@hydra.main` (tests, notebooks, scripts)."""
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    conf_dir = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides or []))
    return to_config(cfg)
