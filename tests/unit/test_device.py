"""Hardware-dependent defaults (`draft_opd_ray.device`): `auto` dtypes resolve to bfloat16 only where it is fast."""

from __future__ import annotations

import pytest

from draft_opd_ray import device


@pytest.mark.parametrize("fast", [True, False])
def test_auto_dtype_follows_the_hardware(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(device, "fast_bfloat16", lambda: fast)
    assert device.resolve_dtype("auto") == ("bfloat16" if fast else "float32")
    assert device.resolve_dtype("float32") == "float32" and device.resolve_dtype("bfloat16") == "bfloat16"


def test_fast_bfloat16_reads_the_cpu_flags() -> None:
    import torch

    with open("/proc/cpuinfo") as f:
        flags = f.read()
    want = torch.cuda.is_available() or "avx512_bf16" in flags or "amx_bf16" in flags
    assert device.fast_bfloat16() is want
