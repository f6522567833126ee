"""The project's cache directory: the converted embedded target, target answers, feature caches, warm starts."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "DRAFT_OPD_RAY_CACHE"


def default_cache_dir() -> Path:
    """Cache directory: ``$DRAFT_OPD_RAY_CACHE`` if set, else ``~/.cache/draft_opd_ray``."""
    env = os.environ.get(ENV_CACHE, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "draft_opd_ray"
