"""Atomic checkpoints (`draft_opd_ray.checkpoint`): a reader sees the previous complete checkpoint or the new one,
never a half-written folder; `latest_checkpoint` finds only complete ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_opd_ray.checkpoint import latest_checkpoint, write_checkpoint


def _fill(text: str):
    def fill(tmp: Path) -> None:
        (tmp / "draft").mkdir()
        (tmp / "draft" / "weights").write_text(text)
        (tmp / "state.pt").write_text(text)

    return fill


def test_write_points_latest_at_the_new_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints" / "opd"
    first = write_checkpoint(root, "step_1", _fill("one"))
    assert first == root / "step_1" and (root / "latest").read_text() == "step_1\n"
    assert latest_checkpoint(root, "state.pt") == first
    second = write_checkpoint(root, "step_2", _fill("two"))
    assert latest_checkpoint(root, "state.pt") == second and (first / "state.pt").read_text() == "one"
    again = write_checkpoint(root, "step_1", _fill("uno"))  # the same name replaces the old folder whole
    assert (again / "draft" / "weights").read_text() == "uno" and latest_checkpoint(root, "state.pt") == again
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]  # no temporaries left


def test_a_failing_fill_leaves_the_previous_checkpoint_and_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    good = write_checkpoint(root, "step_1", _fill("one"))

    def broken(tmp: Path) -> None:
        _fill("half")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(root, "step_2", broken)
    assert not (root / "step_2").exists() and (root / "latest").read_text() == "step_1\n"
    assert latest_checkpoint(root, "state.pt") == good and (good / "draft" / "weights").read_text() == "one"
    with pytest.raises(OSError, match="disk full"):  # overwriting an existing name fails safely too
        write_checkpoint(root, "step_1", broken)
    assert (good / "draft" / "weights").read_text() == "one" and latest_checkpoint(root, "state.pt") == good
    retry = write_checkpoint(root, "step_2", _fill("two"))  # a retry clears what the failed attempt left
    assert latest_checkpoint(root, "state.pt") == retry and not list(root.glob(".tmp-step_2"))


def test_latest_checkpoint_needs_a_pointer_and_the_marker(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root, "state.pt") is None  # no folder at all
    root.mkdir()
    (root / "step_3").mkdir()
    assert latest_checkpoint(root, "state.pt") is None  # a folder, no pointer
    (root / "latest").write_text("step_3\n")
    assert latest_checkpoint(root, "state.pt") is None  # pointer, but the folder lacks the marker
    (root / "step_3" / "state.pt").write_text("x")
    assert latest_checkpoint(root, "state.pt") == root / "step_3"
    (root / "latest").write_text("step_9\n")
    assert latest_checkpoint(root, "state.pt") is None  # pointer to a folder that is gone
