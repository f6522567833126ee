"""Registers the typed schema with Hydra and turns a composed DictConfig into a typed `Config`.

The schema node is built from the `Config` dataclass, so defaults are written once. Its `async_` field is
exposed as `async` (what users type: `async.max_staleness=4`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


def resume_or(resume: Any, default: str) -> str:
    """Hydra's run dir: the run dir `resume=` names (when it is one), else ``default``. A value that is not a
    directory leaves the default, and validation names it."""
    from pathlib import Path

    return str(resume) if resume not in (None, "") and Path(str(resume)).is_dir() else default


def under(storage: Any, rel: str) -> str:
    """``rel`` under the cluster's storage dir, or as it is when there is none (validation then says the
    multi-node cluster needs one; the run dir is not made under a folder named "None")."""
    return rel if storage in (None, "") else f"{str(storage).rstrip('/')}/{rel}"


def resume_subdir(resume: Any, stamp: str) -> str:
    """Where Hydra writes its config in the run dir: `.hydra`, or `.hydra/resume-<time>` for a resume (the run's
    own `.hydra/config.yaml` is what the resume continues with, so it is never overwritten)."""
    return ".hydra" if resume_or(resume, "") == "" else f".hydra/resume-{stamp}"


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema_node())
    resolvers: dict[str, Callable[..., Any]] = {
        "job_slug": job_slug,
        "resume_or": resume_or,
        "resume_subdir": resume_subdir,
        "under": under,
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


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


def resumed_config(run_dir: str | Any, overrides: list[str]) -> DictConfig:
    """The config a resume continues with: the run dir's own `.hydra/config.yaml` (what it was started with), then
    this command's ``key=value`` overrides (e.g. `opd.steps=40`), then `resume` set to the run dir. A run dir
    without that file, or a group override (`draft=dflash`, `+cluster=...`: a resume cannot recompose), is a
    `ConfigError`."""
    from pathlib import Path

    from draft_opd_ray.errors import ConfigError

    run_dir = Path(str(run_dir))
    if not run_dir.is_dir():
        raise ConfigError(
            f"resume: {run_dir} is not a directory; give the run dir to continue: resume=<run dir>"
        )
    saved_path = run_dir / ".hydra" / "config.yaml"
    if not saved_path.is_file():
        raise ConfigError(f"resume: {run_dir} is not a run dir of draft_opd_ray (no .hydra/config.yaml)")
    saved = OmegaConf.load(saved_path)
    if not isinstance(saved, DictConfig):
        raise ConfigError(f"resume: {saved_path} does not hold a config")
    schema = schema_node()
    dotlist = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if key == "resume" or key.startswith("hydra."):
            continue
        if (
            o.startswith(("+", "~"))
            or "=" not in o
            or ("." not in key and OmegaConf.is_dict(schema.get(key)))
        ):
            raise ConfigError(
                f"resume: {o!r} changes a config group; a resume continues with the run's own config and takes "
                "key=value overrides only (e.g. opd.steps=40)"
            )
        dotlist.append(o)
    merged = OmegaConf.merge(schema, saved, OmegaConf.from_dotlist(dotlist))
    assert isinstance(merged, DictConfig)
    merged.resume = str(run_dir)
    return merged


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


CONFIG_GROUPS = ("algorithm", "cluster", "data", "draft", "eval", "target")  # draft_opd_ray/conf/<group>/


def _schema_keys(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema, each with its node (a leaf value or a child config)."""
    out: dict[str, Any] = {}
    for k in node:
        child = node._get_node(k)
        key = f"{prefix}{k}"
        out[key] = child
        if isinstance(child, DictConfig):
            out.update(_schema_keys(child, key + "."))
    return out


def override_key_error(args: list[str]) -> str | None:
    """The first command-line override whose key is not in the schema, as one line naming the nearest real key, or
    None. Hydra refuses `loss.gama=0.5` itself but adds `+loss.gama=0.5` (and `++x.y=1`) to a config without
    complaint, so every prefix is checked here, before Hydra makes a run dir. Flags (`-m`, `--cfg job`), Hydra's
    own keys (`hydra.*`) and config groups (`draft=standalone`, `+cluster=8xA100`) pass; an element of a list
    (`eval.concurrency.0`) is its list's key."""
    import difflib

    keys = _schema_keys(schema_node())
    for arg in args:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):  # `~key` deletes a key
            continue
        key = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if key == "hydra" or key.startswith("hydra.") or key in CONFIG_GROUPS or "/" in key:
            continue  # `hydra/launcher=...`, `group/sub=...`: Hydra's groups, checked by Hydra
        parts = key.split(".")
        while parts and parts[-1].isdigit() and ".".join(parts[:-1]) in keys:
            parts.pop()
        if ".".join(parts) in keys:
            continue
        near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else " (every key: --cfg job)"
        return f"{key}: not a config key{hint}"
    return None
