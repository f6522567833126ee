"""The shared-memory transport's file writer: byte-compatible with safetensors, safe to overwrite in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_opd_ray.sync.weight_sync import write_safetensors


def _state(seed: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(rows, 8, generator=g),
        "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).half(),
        "d2t": torch.randint(0, 100, (rows,), generator=g),
        "t2d": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(8, rows, generator=g).t(),  # not contiguous
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_round_trip_and_overwrite_in_place(tmp_path: Path) -> None:
    path = str(tmp_path / "slot.safetensors")
    big, small = _state(0, 64), _state(1, 3)
    size = write_safetensors(path, big)
    assert size == Path(path).stat().st_size
    _same(load_file(path), big)
    write_safetensors(path, small)  # shorter content: the tail of the old file must go
    _same(load_file(path), small)
    write_safetensors(path, big)
    _same(load_file(path), big)
    # and safetensors' own writer gives the same tensors
    save_file({k: v.contiguous() for k, v in big.items()}, str(tmp_path / "ref.safetensors"))
    _same(load_file(str(tmp_path / "ref.safetensors")), load_file(path))


def test_rejects_what_it_cannot_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need a CPU tensor"):
        write_safetensors(str(tmp_path / "x"), {"c": torch.zeros(2, dtype=torch.complex64)})


def test_stale_slot_folders_of_dead_runs_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A run killed before `close` leaves `draft_opd_ray_sync_<pid>_*` behind: the next transport made on the node
    removes it; a live process's folder and unrelated folders stay."""
    import os
    import subprocess
    import sys

    from draft_opd_ray.sync.weight_sync import SLOT_PREFIX, SharedFileWeightSync, remove_stale_slots

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"{SLOT_PREFIX}{int(dead.stdout)}_abc"
    live = tmp_path / f"{SLOT_PREFIX}{os.getpid()}_def"
    other = tmp_path / "something_else"
    for d in (stale, live, other):
        d.mkdir()
        (d / "slot0.safetensors").write_bytes(b"x")
    assert remove_stale_slots(str(tmp_path)) == [stale.name]
    assert live.is_dir() and other.is_dir()
    live.rename(tmp_path / f"{SLOT_PREFIX}{int(dead.stdout)}_def")  # now "dead" too
    sync = SharedFileWeightSync([], directory=str(tmp_path))  # removes it at start
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, os.path.basename(sync.dir)])
    sync.close(wait=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]
