"""What the local hardware does fast, and how many CPU threads an actor takes, for defaults that depend on it."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def fast_bfloat16() -> bool:
    """Whether bfloat16 matmuls run natively here: a CUDA GPU, or a CPU with AVX512-BF16 or AMX. On a CPU
    without them (AVX2 only) vLLM's bfloat16 decoding is several times slower than float32."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """``auto`` = bfloat16 where it is fast (:func:`fast_bfloat16`), float32 elsewhere; other names as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if fast_bfloat16() else "float32"


def actor_device() -> torch.device:
    """The device of this process's work: its GPU where Ray gave it one (Ray sets CUDA_VISIBLE_DEVICES per
    actor, so that GPU is ``cuda:0``), the CPU elsewhere. The one place the roles ask, instead of ``"cuda"`` and
    ``"cpu"`` literals in every file."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def node_threads(reserved: int = 0, sharers: int = 1) -> int:
    """Torch threads for one of ``sharers`` actors that work at the same time on this node, beside ``reserved``
    cores that are bound to other work (CPU vLLM engines): at least one."""
    return max(1, (usable_cores() - reserved) // max(1, sharers))
