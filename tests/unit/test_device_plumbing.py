"""Device plumbing without a GPU: the learner's objective terms and denominator, `committed_blocks` and the replay's
scoring run with their inputs and weights on an accelerator, stood in for by `on_accelerator`.

`on_accelerator` makes every tensor created on or moved to the ``meta`` device an `Accel`: a CPU tensor that
reports ``meta`` and computes on the CPU (so values, ``.item()`` and ``.tolist()`` work), and whose ops check
devices as CUDA kernels do: mixing it with a CPU tensor raises "Expected all tensors to be on the same device",
unless the CPU tensor is a 0-dim scalar or an index (``x[idx]``), or the op is a copy between devices. A tensor
the code builds on the CPU where it should build it on the learner's device therefore fails here as on a GPU.
(Neither plain meta tensors, which let a CPU matmul or gather through, nor torch's FakeTensor, which has no
values and whose fake ``cuda`` needs a CUDA build, can run these paths.)"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from draft_opd_ray.config.schema import LossConfig
from draft_opd_ray.opd.batch import committed_blocks
from draft_opd_ray.wire import ReplayItem, TeacherItem

DEVICE = torch.device("meta")  # the accelerator's stand-in
aten = torch.ops.aten
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
MOVES = {aten._to_copy.default, aten.copy_.default}  # what may cross devices


class Accel(torch.Tensor):
    """A CPU tensor (``inner``) that reports DEVICE."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Accel:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=DEVICE,
            requires_grad=inner.requires_grad,
            layout=inner.layout,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Accel({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func`` on the CPU tensors behind the `Accel`s, after CUDA's device check; its tensors wrapped when an
    input was an `Accel` or it was asked for on DEVICE."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    on = any(isinstance(t, Accel) for t in tensors)
    if func not in MOVES:
        checked = tensors
        if func in INDEXING:  # CUDA takes CPU index tensors: check the indexed tensor and the values only
            checked = [t for t in (args[0], *args[2:3]) if isinstance(t, torch.Tensor)]
        devices = {str(t.device) for t in checked if t.dim() > 0 or isinstance(t, Accel)}
        if len(devices) > 1:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{sorted(devices)} ({func})"
            )
    device = kwargs.get("device")
    wrap = on
    if device is not None and torch.device(device) == DEVICE:  # a factory or a move onto the accelerator
        kwargs, wrap = {**kwargs, "device": torch.device("cpu")}, True
    elif func is aten._to_copy.default and device is not None:  # a move off it
        wrap = False
    plain_args, plain_kwargs = pytree.tree_map_only(Accel, lambda t: t.inner, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    if func._schema.is_mutable and isinstance(args[0], torch.Tensor):
        return args[0]  # in place: the tensor itself (its inner was changed)
    return pytree.tree_map_only(torch.Tensor, Accel, out) if wrap else out


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


class _Functions(TorchFunctionMode):
    """What does not reach the dispatcher: ``torch.tensor(data, device=...)`` and ``.tolist()``."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device) == DEVICE:
            return Accel(func(*args, **{**kwargs, "device": "cpu"}))
        if func is torch.Tensor.tolist and isinstance(args[0], Accel):
            return args[0].inner.tolist()
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_accelerator() -> Iterator[None]:
    with _Functions(), _Dispatch():
        yield


def test_the_stand_in_checks_devices_as_cuda_does() -> None:
    with on_accelerator():
        x, cpu = torch.ones(2, 3, device=DEVICE), torch.arange(3)
        assert isinstance(x, Accel) and x.device == DEVICE
        for mixed in (lambda: x + cpu, lambda: x @ torch.ones(3, 2), lambda: torch.cat([x[0], cpu])):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                mixed()
        y = (x + torch.tensor(1.0))[:, cpu.clamp(max=2)]  # a CPU scalar and a CPU index are fine
        y[0, :2] = torch.tensor([5.0, 6.0])  # so is a copy from the CPU
        assert isinstance(y, Accel) and y.sum().item() == 19.0 and y.cpu().tolist()[0] == [5.0, 6.0, 2.0]
        assert isinstance(cpu.to(DEVICE), Accel) and not isinstance(y.cpu(), Accel)


# ---- the learner ---------------------------------------------------------------------------------------------


def _learner(draft: Path, target: Path, kind: str, estimator: str, objective: str) -> Any:
    """A `Learner` without its DeepSpeed engine (a unit test starts none): the student loaded on the CPU as
    `Learner.__init__` loads it; `_to_device` does what the rest of `__init__` and DeepSpeed do on a GPU."""
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.opd.learner import Learner

    learner = Learner.__new__(Learner)
    learner.student = draft_kind(kind).student(str(draft), str(target))
    learner.model = learner.student.model
    learner.spec, learner.objective = LossConfig(estimator=estimator), objective
    return learner


def _to_device(learner: Any) -> None:
    """Inside `on_accelerator`: the learner's device, its vocabulary map made there, the weights moved there."""
    from draft_opd_ray.opd.learner import student_vocabulary

    learner.device = DEVICE
    learner.model.to(DEVICE)
    learner.to_student = student_vocabulary(learner.student.draft_ids, DEVICE)


@pytest.fixture(scope="module")
def scored(replay_case: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, TeacherItem]]:
    """Per draft kind: its folder and the case's sequence replayed for it on the CPU (full payload)."""
    c = replay_case
    out = {}
    for kind in ("eagle3", "dflash", "standalone"):
        draft = c.draft(kind, tmp_path_factory.mktemp(kind))
        (t,) = c.replay(kind, draft).score([c.item])
        out[kind] = (draft, t)
    return out


def _payload(t: TeacherItem, estimator: str) -> TeacherItem:
    if estimator != "topk":
        return t
    assert t.teacher_logprobs is not None
    lp, ids = t.teacher_logprobs.topk(8, dim=-1)
    return dataclasses.replace(t, teacher_logprobs=None, teacher_topk_ids=ids, teacher_topk_logprobs=lp)


@pytest.mark.parametrize(
    "kind,estimator,objective",
    [
        ("eagle3", "full", "opd"),
        ("eagle3", "topk", "opd"),
        ("eagle3", "token", "opd"),
        ("eagle3", "full", "sft_on_rollouts"),
        ("dflash", "token", "opd"),
        ("standalone", "token", "opd"),
        ("standalone", "full", "sft_on_rollouts"),
    ],
)
def test_learner_terms_and_denominator_run_on_the_device(
    replay_case: Any, scored: dict[str, tuple[Path, TeacherItem]], kind: str, estimator: str, objective: str
) -> None:
    """`Learner._denominator` on the items as they arrive (CPU) and on the device, then `_terms` (the student's
    forward, the objective, the backward): the same numbers as on the CPU."""
    draft, t = scored[kind]
    t = _payload(t, estimator)
    from draft_opd_ray.opd.learner import student_vocabulary

    cpu = _learner(draft, replay_case.target, kind, estimator, objective)
    cpu.device = torch.device("cpu")
    cpu.to_student = student_vocabulary(cpu.student.draft_ids, cpu.device)
    want_den, want = cpu._denominator([t]), float(cpu._terms(t).numerator.detach())

    learner = _learner(draft, replay_case.target, kind, estimator, objective)
    with on_accelerator():
        _to_device(learner)
        assert learner._denominator([t]) == learner._denominator([t.to(DEVICE)]) == want_den
        terms = learner._terms(t)
        assert isinstance(terms.numerator, Accel)
        (terms.numerator / want_den).backward()
        assert float(terms.numerator.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
        grads = [p.grad for p in learner.model.parameters() if p.grad is not None]
        assert grads and all(isinstance(g, Accel) for g in grads)


def test_committed_blocks_stay_on_the_items_device(replay_case: Any, scored: Any) -> None:
    _, t = scored["eagle3"]
    with on_accelerator():
        blocks = committed_blocks(t.to(DEVICE))
        assert isinstance(blocks, Accel) and torch.equal(blocks.cpu(), committed_blocks(t))


# ---- the replay ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"payload": "topk", "topk": 8}, {"teacher": False}, {"mode": "redraft"}],
    ids=["full", "topk", "features-only", "redraft"],
)
def test_replay_scores_on_the_device(replay_case: Any, kwargs: dict[str, Any]) -> None:
    """A `ReplayActor` whose `actor_device` is the device (the target, and the draft it redrafts with, moved
    there): it ships the same CPU teacher items as on the CPU."""
    c = replay_case
    if kwargs.get("mode") == "redraft":
        kwargs = {**kwargs, "draft_dir": str(c.eagle3)}
    (want,) = c.replay("eagle3", c.eagle3, **kwargs).score([c.item])
    with on_accelerator(), mock.patch("draft_opd_ray.opd.replay.actor_device", return_value=DEVICE):
        actor = c.replay("eagle3", c.eagle3, **kwargs)
        assert all(isinstance(p, Accel) for p in actor.model.parameters())
        (got,) = actor.score([ReplayItem(**dataclasses.asdict(c.item))])
    for f in dataclasses.fields(TeacherItem):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert type(a) is torch.Tensor and a.device.type == "cpu", f.name  # shipped from the CPU
            assert torch.allclose(a.float(), b.float(), atol=1e-5), f.name
        else:
            assert a == b, f.name
