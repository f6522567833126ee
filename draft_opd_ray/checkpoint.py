"""Atomic checkpoints: `checkpoints/<stage>/step_<n>/` plus the `latest` pointer, for every stage.

A checkpoint folder is filled under a temporary name and renamed into place, then `latest` (a relative symlink to
`step_<n>`, so that a path can go through it: `checkpoints/opd/latest/draft`) is replaced by a rename too; a reader
therefore sees either the previous complete checkpoint or the new one, never a half-written folder nor a missing
`latest`. `marker` names the file whose presence makes a folder complete.

Nothing in a run dir is unpickled: `load_state` reads training state with `torch.load(weights_only=True)`
(tensors, numbers, strings, lists, dicts), and `SafeCheckpointEngine` makes DeepSpeed read its own checkpoint
files the same way, so a tampered run dir cannot run code.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import CheckpointError

LATEST = "latest"


def load_state(path: str | os.PathLike[str]) -> Any:
    """A `torch.save`d training state, tensors and plain data only (no unpickling of arbitrary objects)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: not loaded, it holds something other than tensors and plain data, or is truncated ({first})"
        ) from None


def plain(x: Any, where: str = "state") -> Any:
    """``x`` with every tensor detached onto the CPU; dicts, lists, tuples, numbers, strings, dtypes and None kept
    (what `load_state` reads). Anything else raises here, where the state is made, instead of at the resume that
    `load_state` refuses (``where``: its path in the state)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: plain(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    if x is None or type(x) in (bool, int, float, str) or isinstance(x, torch.dtype):
        return x
    raise CheckpointError(f"{where}: a {type(x).__module__}.{type(x).__qualname__} is not plain data")


def to_device(x: Any, device: Any) -> Any:
    """``x`` (`plain` data) with every tensor on ``device``."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


# DeepSpeed's ZeRO-1/2 state holds objects: its fragment addresses (rebuilt when the engine starts; only universal
# checkpoints read them), the stage as an int enum, and a loss scaler (numbers in an object). SafeCheckpointEngine
# and the learner's optimizer state (`optim.optimizer_state`) write those as plain data, and the loss scaler is
# rebuilt here from its class name, one of two, and its attributes.
SLICE_MAPPINGS, SCALER_CLASS = "param_slice_mappings", "__deepspeed_loss_scaler__"


def deepspeed_plain(x: Any) -> Any:
    """DeepSpeed's checkpoint state with its objects as plain data (comment above); the rest as it is."""
    import enum

    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

    if isinstance(x, dict):
        return {k: deepspeed_plain(v) for k, v in x.items() if k != SLICE_MAPPINGS}
    if isinstance(x, list):
        return [deepspeed_plain(v) for v in x]
    if isinstance(x, enum.Enum) and isinstance(x, int):  # ZeroStageEnum(int, Enum)
        return int(x)
    if isinstance(x, LossScalerBase):
        return {SCALER_CLASS: type(x).__name__, **plain(vars(x), type(x).__name__)}
    return x


def deepspeed_objects(x: Any) -> Any:
    """`deepspeed_plain`'s loss scalers built again (the other objects are not needed back)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    if isinstance(x, dict) and SCALER_CLASS in x:
        cls = {c.__name__: c for c in (LossScaler, DynamicLossScaler)}[x[SCALER_CLASS]]
        scaler = cls.__new__(cls)
        scaler.__dict__.update({k: v for k, v in x.items() if k != SCALER_CLASS})
        return scaler
    if isinstance(x, dict):
        return {k: deepspeed_objects(v) for k, v in x.items()}
    if isinstance(x, list):
        return [deepspeed_objects(v) for v in x]
    return x


def safe_checkpoint_engine() -> Any:
    """A DeepSpeed checkpoint engine (set as ``engine.checkpoint_engine``) that writes plain data and loads with
    `load_state`, so that `engine.load_checkpoint` unpickles nothing, under ZeRO-1/2 and bf16/fp16 too."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            super().save(deepspeed_plain(state_dict), path)

        def load(self, path: str, map_location: Any = None) -> Any:
            return deepspeed_objects(load_state(path))

    return SafeCheckpointEngine()


def write_checkpoint(root: Path, name: str, fill: Callable[[Path], None]) -> Path:
    """``root/name`` written atomically: ``fill(tmp)`` writes the contents into a temporary folder, which is
    renamed to ``root/name`` (replacing an older one of that name); then ``root/latest`` names it."""
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    point_latest(root, name)
    return final


def point_latest(root: Path, name: str) -> None:
    """``root/latest`` made a symlink to ``name`` (relative: the run dir can move) in one step: the new link is made
    beside it and renamed over it, and a rename replaces a link (or an older run's text file) whole."""
    link = root / f".{LATEST}.tmp"
    link.unlink(missing_ok=True)
    os.symlink(name, link)
    os.replace(link, root / LATEST)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """``path`` replaced whole by ``text`` (a temporary file beside it, flushed, renamed): a reader never sees half
    a report."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def clean_leftovers(root: Path) -> list[str]:
    """Remove what a write killed half-way left in ``root`` (temporary folders and pointer); run at a stage's
    start, before anything new is written. Returns the names removed."""
    if not root.is_dir():
        return []
    gone = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-") or p.name == f".{LATEST}.tmp")
    for name in gone:
        p = root / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return gone


def latest_folder(root: Path) -> Path | None:
    """The folder ``root/latest`` points to (whether or not it still exists); None when there is no pointer."""
    pointer = root / LATEST
    if pointer.is_symlink():
        return root / os.readlink(pointer)
    if pointer.is_file():  # a run dir from before `latest` became a symlink: a text file naming the step
        return root / pointer.read_text().strip()
    return None


def latest_checkpoint(root: Path, marker: str) -> Path | None:
    """The folder ``root/latest`` points to, if it holds ``marker``; None when there is none."""
    folder = latest_folder(root)
    return folder if folder is not None and (folder / marker).is_file() else None


def real_path(path: str) -> str:
    """``path`` absolute with every symlink resolved, a `latest` in it followed to the step it names (an old run
    dir's text-file `latest` too): what vLLM and the actors are given, so the folder cannot change under a run when
    a later checkpoint moves `latest`, and vLLM never takes a path it cannot find for a model-hub repo id. A path
    that does not exist is returned as it is, for validation to name."""
    here = Path()
    for part in Path(path).expanduser().parts:
        here = here / part
        if part == LATEST and (folder := latest_folder(here.parent)) is not None:
            here = folder
    return str(here.resolve()) if here.exists() else path
