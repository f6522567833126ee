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


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from draft_opd_ray.checkpoint import write_checkpoint

root = Path(sys.argv[1])
write_checkpoint(root, "step_1", lambda tmp: (tmp / "state.pt").write_text("one"))

def slow(tmp):
    (tmp / "half").write_text("x" * 1000)
    print("filling", flush=True)
    time.sleep(60)

write_checkpoint(root, "step_2", slow)
"""


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_and_the_next_start_cleans_up(
    tmp_path: Path,
) -> None:
    """SIGKILL while step_2 is being filled: step_1 and `latest` are intact; `clean_leftovers` removes the rest."""
    import signal
    import subprocess
    import sys

    from draft_opd_ray.checkpoint import clean_leftovers

    root = tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "filling"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert latest_checkpoint(root, "state.pt") == root / "step_1"
    assert (root / "step_1" / "state.pt").read_text() == "one"
    assert clean_leftovers(root) == [".tmp-step_2"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]


class _Payload:
    """What a tampered training_state.pt could hold: unpickling it would run ``touch``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.marker}",))


def test_training_state_is_never_unpickled(tmp_path: Path) -> None:
    """`load_state` reads tensors and plain data; a file holding any other object is refused, its code unrun."""
    import torch

    from draft_opd_ray.checkpoint import load_state
    from draft_opd_ray.errors import CheckpointError

    good = tmp_path / "good.pt"
    torch.save({"step": 3, "ranks": [{"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}}]}, good)
    assert load_state(good)["step"] == 3
    bad, marker = tmp_path / "bad.pt", tmp_path / "pwned"
    torch.save({"step": 3, "x": _Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match="not loaded, it holds something other than tensors"):
        load_state(bad)
    assert not marker.exists()
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="torn.pt: not loaded"):
        load_state(torn)


def test_an_interrupted_run_names_its_last_checkpoint_and_how_to_resume(tmp_path: Path) -> None:
    from draft_opd_ray.main import interrupted

    run_dir = tmp_path / "run"
    assert interrupted(run_dir) == "no checkpoint was written yet; run the same command again to start over"
    write_checkpoint(run_dir / "checkpoints" / "sft", "step_40", _fill("sft"))
    assert interrupted(run_dir) == "no checkpoint was written yet; run the same command again to start over"
    (run_dir / "checkpoints" / "sft" / "step_40" / "training_state.pt").write_text("")  # its marker
    assert interrupted(run_dir).startswith("the last complete checkpoint (checkpoints/sft/step_40) is kept")
    root = run_dir / "checkpoints" / "opd"
    write_checkpoint(root, "step_2", lambda t: (t / "training_state.pt").write_text(""))
    (root / ".tmp-step_4").mkdir()  # a write the interrupt cut short is not a checkpoint
    assert interrupted(run_dir) == (
        f"the last complete checkpoint (checkpoints/opd/step_2) is kept: resume={run_dir} continues from it"
    )


def test_plain_keeps_tensors_and_data_and_names_any_object(tmp_path: Path) -> None:
    """`plain`: what a checkpoint may hold (read back by `load_state`, weights_only); an object is refused where
    the state is made, naming its path (as DeepSpeed's ZeRO state_dict holds fragment addresses)."""
    import torch

    from draft_opd_ray.checkpoint import load_state, plain
    from draft_opd_ray.errors import CheckpointError

    state = {"a": [torch.ones(2, requires_grad=True), (1, 2.5, "x", None, True)], "dtype": torch.bfloat16}
    out = plain(state)
    assert not out["a"][0].requires_grad and out["a"][1] == (1, 2.5, "x", None, True)
    path = tmp_path / "s.pt"
    torch.save(out, path)
    assert torch.equal(load_state(path)["a"][0], torch.ones(2))

    class Scaler:
        cur_scale = 1.0

    with pytest.raises(CheckpointError, match=r"state\['a'\]\[1\]: a .*Scaler is not plain data"):
        plain({"a": [0, Scaler()]})
