"""Atomic checkpoints (`draft_opd_ray.checkpoint`): a reader sees the previous complete checkpoint or the new one,
never a half-written folder nor a missing `latest`; `latest` is a symlink a path goes through; `latest_checkpoint`
finds only complete ones, in new run dirs and in old ones whose `latest` is a text file."""

from __future__ import annotations

import os
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
    assert first == root / "step_1" and (root / "latest").is_symlink()
    assert os.readlink(root / "latest") == "step_1"  # relative: the run dir can move
    assert (root / "latest" / "draft" / "weights").read_text() == "one"  # a path goes through it
    assert latest_checkpoint(root, "state.pt") == first
    second = write_checkpoint(root, "step_2", _fill("two"))
    assert latest_checkpoint(root, "state.pt") == second and (first / "state.pt").read_text() == "one"
    assert os.readlink(root / "latest") == "step_2" and (root / "latest" / "state.pt").read_text() == "two"
    assert not (root / ".latest.tmp").exists() and not (root / ".latest.tmp").is_symlink()
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
    assert not (root / "step_2").exists() and os.readlink(root / "latest") == "step_1"
    assert latest_checkpoint(root, "state.pt") == good and (good / "draft" / "weights").read_text() == "one"
    with pytest.raises(OSError, match="disk full"):  # overwriting an existing name fails safely too
        write_checkpoint(root, "step_1", broken)
    assert (good / "draft" / "weights").read_text() == "one" and latest_checkpoint(root, "state.pt") == good
    retry = write_checkpoint(root, "step_2", _fill("two"))  # a retry clears what the failed attempt left
    assert latest_checkpoint(root, "state.pt") == retry and not list(root.glob(".tmp-step_2"))


def test_latest_checkpoint_needs_a_pointer_and_the_marker(tmp_path: Path) -> None:
    """Also the text-file `latest` that run dirs written before it became a symlink hold."""
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


def test_an_old_run_dirs_text_latest_is_read_and_the_next_checkpoint_makes_it_a_symlink(
    tmp_path: Path,
) -> None:
    """A run dir written before `latest` became a symlink resumes: its text `latest` names the checkpoint, a path
    through it is followed, and the resumed run's next checkpoint replaces the text file with a symlink."""
    from draft_opd_ray.checkpoint import real_path

    root = tmp_path / "old_run" / "checkpoints" / "opd"
    (root / "step_1" / "draft").mkdir(parents=True)
    (root / "step_1" / "state.pt").write_text("one")
    (root / "latest").write_text("step_1\n")
    assert latest_checkpoint(root, "state.pt") == root / "step_1"
    assert real_path(str(root / "latest" / "draft")) == str((root / "step_1" / "draft").resolve())
    write_checkpoint(root, "step_2", _fill("two"))
    assert os.readlink(root / "latest") == "step_2" and latest_checkpoint(root, "state.pt") == root / "step_2"


def test_real_path_follows_latest_to_the_step_it_names_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `draft.path=.../checkpoints/opd/latest/draft` becomes before any check or actor sees it."""
    from draft_opd_ray.checkpoint import real_path

    run = tmp_path / "run"
    root = run / "checkpoints" / "opd"
    write_checkpoint(root, "step_1", _fill("one"))
    write_checkpoint(root, "step_2", _fill("two"))
    step_2 = str((root / "step_2" / "draft").resolve())
    assert real_path(str(root / "latest" / "draft")) == step_2
    monkeypatch.chdir(tmp_path)  # relative, as typed from the dir above the run dir: made absolute
    assert real_path("run/checkpoints/opd/latest/draft") == step_2
    assert (
        real_path("run/checkpoints/opd/latest/nothing") == "run/checkpoints/opd/latest/nothing"
    )  # for validation
    (tmp_path / "models" / "latest").mkdir(parents=True)  # a folder that happens to be called latest: kept
    assert real_path("models/latest") == str((tmp_path / "models" / "latest").resolve())


def test_a_reader_never_sees_a_missing_or_half_written_latest(tmp_path: Path) -> None:
    """A writer process saves checkpoint after checkpoint while this process reads through `latest`: every read
    finds a complete checkpoint (the new link is renamed over the old one, never removed first)."""
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    write_checkpoint(root, "step_0", _fill("step_0"))
    p = subprocess.Popen([sys.executable, "-c", _BUSY_WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    reads, seen, missing = 0, set(), []
    while p.poll() is None:
        try:
            seen.add((root / "latest" / "draft" / "weights").read_text())
            reads += 1
        except OSError as e:
            missing.append(repr(e))
    assert p.returncode == 0 and not missing, missing[:3]
    assert reads >= 20 and len(seen) >= 3, (reads, len(seen))  # the reads overlapped many writes
    assert not (root / ".latest.tmp").is_symlink() and os.readlink(root / "latest") == "step_400"


_BUSY_WRITER = """
import sys
from pathlib import Path
from draft_opd_ray.checkpoint import write_checkpoint

def fill(name):
    def f(tmp):
        (tmp / "draft").mkdir()
        (tmp / "draft" / "weights").write_text(name)
    return f

root = Path(sys.argv[1])
print("writing", flush=True)
for i in range(1, 401):
    write_checkpoint(root, f"step_{i}", fill(f"step_{i}"))
"""


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
    os.symlink("step_1", root / ".latest.tmp")  # killed between making the new link and renaming it
    assert clean_leftovers(root) == [".latest.tmp"] and (root / "step_1" / "state.pt").read_text() == "one"


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
