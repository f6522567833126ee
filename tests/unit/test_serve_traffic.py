"""The server's traffic (`serve/traffic.py`): chunks of captured steps joined by request id across takes, a request
closed at the first take without its steps, τ by the version that drafted each step; and the server's start-up
checks that need no engine (the port, the `serve.*` keys)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from draft_opd_ray.errors import ConfigError
from draft_opd_ray.serve.traffic import Traffic
from draft_opd_ray.wire import CapturedSteps, consistency_error

K = 3


def _chunk(prompt: list[int] | None, start: int, accepted: list[int]) -> CapturedSteps:
    """Steps of one request from anchor ``start`` on: drafted ids 100 + position, the committed token at each anchor
    500 + position (so that the record's response is checkable by position)."""
    anchors, pos = [], start
    for a in accepted:
        anchors.append(pos)
        pos += a + 1
    n = len(accepted)
    return CapturedSteps(
        anchors,
        [[100 + p + j for j in range(1, K + 1)] for p in anchors],
        list(accepted),
        np.zeros((n, K + 1, 2), np.int32),
        np.zeros((n, K + 1, 2), np.float32),
        np.zeros((n, K + 1), np.float32),
        prompt_ids=prompt,
        anchor_ids=[500 + p for p in anchors],
    )


def test_chunks_join_and_close_when_a_take_has_no_steps_of_them() -> None:
    t = Traffic()
    prompt = [1, 2, 3]
    assert t.add({"r-1": _chunk(prompt, 3, [1, 0])}, version=0) == []
    assert t.add({"r-1": _chunk(None, 3 + 2 + 1, [3]), "r-2": _chunk([9], 1, [2])}, version=1) == []
    (rec,) = t.add({"r-2": _chunk(None, 4, [0])}, version=1)  # r-1 has no new steps: it finished
    assert rec.request_id == "r-1" and rec.prompt_ids == prompt and consistency_error(rec) is None
    assert rec.anchor_pos == [3, 5, 6] and rec.accepted == [1, 0, 3] and rec.policy_version == [0, 0, 1]
    # response: the committed token at each anchor, then the accepted drafted ids after it
    assert rec.response_ids == [503, 104, 505, 506, 107, 108, 109]
    (r2,) = t.add({}, version=2)
    assert r2.request_id == "r-2" and r2.policy_version == [1, 1] and t.open == {}
    # tau by version: committed tokens per step; v0: steps of 2 and 1 tokens; v1: 4, then r-2's 3 and 1
    assert t.tau_by_version() == {0: 1.5, 1: round((4 + 3 + 1) / 3, 4)} and t.requests == 2


def test_a_chunk_without_its_first_steps_is_an_orphan_not_a_record() -> None:
    t = Traffic()
    t.add({"late-1": _chunk(None, 7, [1])}, version=0)
    assert t.orphans == 1 and t.open == {} and t.add({}, version=0) == []


def test_steps_that_do_not_chain_are_dropped_and_counted() -> None:
    t = Traffic()
    broken = _chunk([1, 2], 2, [1, 1])
    broken.anchor_pos[1] += 1  # a step without drafts in between: the next anchor is not where the chain says
    t.add({"r-1": broken}, version=0)
    assert t.add({}, version=0) == [] and t.inconsistent == 1 and t.requests == 0


def test_a_port_in_use_is_a_config_error() -> None:
    from draft_opd_ray.serve.server import check_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"serve.port: cannot listen on 127.0.0.1:{port}"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", port)  # free again


def test_serve_keys_are_checked() -> None:
    from draft_opd_ray.config.schema import ServeConfig

    for bad in ({"port": 0}, {"requests_per_update": 0}, {"max_versions": 0}, {"poll_s": 0.0}):
        with pytest.raises(ConfigError, match="serve."):
            ServeConfig(**bad)  # type: ignore[arg-type]
