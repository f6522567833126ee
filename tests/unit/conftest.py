"""Keeps the fast tier honest: a unit test (its module, its fixtures or its body) fails when it starts what belongs
in tests/integration, naming what it started:

- vLLM or Ray: imported for the first time (`vllm`, `ray` newly in ``sys.modules``);
- a DeepSpeed engine: a torch.distributed process group set up (`init_process_group` called, or a group that
  was not there before). Every DeepSpeed engine needs one (`deepspeed.initialize` creates it when none exists;
  `run_sft` and `Learner` create it first through `draft_opd_ray.distributed`). The import of `deepspeed` itself
  is no signal: transformers imports it whenever it loads or saves a model and DeepSpeed and accelerate are
  installed.

Only what was not there before counts, so a session that ran integration tests first cannot fail here falsely.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

HEAVY_MODULES = ("vllm", "ray")
PROCESS_GROUP = "a torch.distributed process group (a DeepSpeed engine)"
_reported: set[str] = set()  # what a test already failed for (its module's check does not repeat it)


def _started() -> set[str]:
    """The heavy things present now."""
    out = {m for m in HEAVY_MODULES if m in sys.modules}
    if dist.is_available() and dist.is_initialized():
        out.add(PROCESS_GROUP)
    return out


def _watch(mp: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """Start watching: records calls of ``torch.distributed.init_process_group`` (patched through ``mp``) and
    returns what has started since, as a function."""
    before, calls = _started(), []
    real = dist.init_process_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(PROCESS_GROUP)
        return real(*args, **kwargs)

    mp.setattr(dist, "init_process_group", recording)
    return lambda: sorted((_started() - before) | set(calls))


def _fail(where: str, new: list[str]) -> None:
    pytest.fail(
        f"{where} started {new}: a unit test builds no vLLM engine, Ray cluster or DeepSpeed engine "
        "(move it to tests/integration and mark it)",
        pytrace=False,
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """Importing a test module (collection) counts too."""
    before = _started()
    report = yield
    new = sorted(_started() - before)
    if isinstance(collector, pytest.Module) and report.passed and new:
        report.outcome = "failed"
        report.longrepr = f"collecting {collector.nodeid} started {new}: move it to tests/integration"
    return report


@pytest.fixture(autouse=True, scope="module")
def nothing_heavy_in_module_fixtures(request: pytest.FixtureRequest) -> Iterator[None]:
    _reported.clear()
    with pytest.MonkeyPatch.context() as mp:
        started = _watch(mp)
        yield
    new = [x for x in started() if x not in _reported]
    if new:
        _fail(f"module {request.node.nodeid} (a module-scoped fixture)", new)


@pytest.fixture(autouse=True)
def nothing_heavy(request: pytest.FixtureRequest) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        started = _watch(mp)
        yield
    new = started()
    if new:
        _reported.update(new)
        _fail(request.node.nodeid, new)
