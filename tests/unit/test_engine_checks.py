"""Start-up checks of the vLLM rollout engine that fail before any engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draft_opd_ray.errors import ConfigError, ModelError
from draft_opd_ray.rollout.engine import Sampling, SpecDecodeEngine, speculative_config
from tests.helpers import spec_engine


def _folder(path: Path, **cfg: object) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_draft_target_vocabulary_mismatch_is_rejected(tmp_path: Path) -> None:
    target = _folder(tmp_path / "t", vocab_size=49152)
    draft = _folder(tmp_path / "d", vocab_size=32000)
    with pytest.raises(ModelError, match="draft vocabulary 32000 differs from the target's 49152"):
        spec_engine(target, "standalone", draft, 4)
    big = _folder(tmp_path / "e", vocab_size=49152, draft_vocab_size=60000)
    with pytest.raises(ModelError, match="draft_vocab_size 60000 exceeds the target's 49152"):
        spec_engine(target, "eagle3", big, 4)


@pytest.mark.parametrize(
    "sampling,msg",
    [
        (Sampling(temperature=-0.5), "sampling.temperature: must be >= 0"),
        (Sampling(top_p=0.0), r"sampling.top_p: must be in \(0, 1\]"),
        (Sampling(max_new_tokens=0), "sampling.max_new_tokens: must be >= 1"),
    ],
)
def test_invalid_sampling_settings(sampling: Sampling, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        sampling.check()


def test_speculative_config_spelling() -> None:
    assert speculative_config("eagle3", "d", 4) == {
        "method": "eagle3",
        "model": "d",
        "num_speculative_tokens": 4,
    }
    assert speculative_config("standalone", "d", 3)["method"] == "draft_model"
    assert speculative_config("dflash", "d", 7)["method"] == "dflash"
    assert speculative_config("ngram", None, 4)["method"] == "ngram"
    assert speculative_config("none", None, 4) is None
    with pytest.raises(ConfigError, match="draft.path: a eagle3 draft needs a folder"):
        speculative_config("eagle3", None, 4)


@pytest.mark.parametrize("free_mb,where", [(64, "tmp"), (4096, "shm")])
def test_draft_file_leaves_a_small_dev_shm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free_mb: int, where: str
) -> None:
    """The weights file the engine's worker reads goes to /dev/shm only when it fits there: Docker's default
    /dev/shm (64 MB) cannot hold a 100 MB draft, so the file goes to the temp dir instead (os.statvfs says how
    much room /dev/shm has)."""
    import os
    import tempfile

    import torch

    from draft_opd_ray.sync import receiver as engine_mod

    real_statvfs = os.statvfs

    def statvfs(path: str) -> os.statvfs_result:
        if path != engine_mod.SHM:
            return real_statvfs(path)
        return os.statvfs_result((4096, 4096, 0, 0, free_mb * 256, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written: list[str] = []
    engine = object.__new__(SpecDecodeEngine)
    engine.load_draft_weights_file = lambda path, version: written.append(path)  # type: ignore[method-assign]
    engine.load_draft_weights({"w": torch.zeros(25 << 20)}, 1)  # 100 MiB of float32
    (path,) = written
    assert os.path.dirname(path) == (str(tmp_path) if where == "tmp" else engine_mod.SHM)
