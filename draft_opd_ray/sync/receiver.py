"""The engine side of weight sync: how a vLLM rollout engine takes a new draft version and proves what it serves.

Two halves, as vLLM splits an engine into its owner's `LLM` and one worker process per tensor-parallel rank:

* `DraftWeightExtension` (`LLM(..., worker_extension_cls=EXTENSION)`, mixed into every worker): methods callable
  from the owner through `llm.collective_rpc`. `load_draft_weights` reloads the running draft with vLLM's
  in-place reloader (the one `Worker.reload_weights` uses for the target): on CPU the linear weights are
  repacked after loading, so a plain `model.load_weights` afterwards does not take. `draft_fingerprints`
  reads the served draft back (the refit proof, `sync/refit.py`). The draft is the model runner's
  `get_draft_model()` (Model Runner V2, which CUDA selects, holds it in `speculator`; V1 and the CPU runner in
  `drafter`).
* the owner's calls on its `LLM` (`SpecDecodeEngine`'s weight methods are these): `weights_file` + `apply_file`
  (the file transports, `sync/weight_sync.py`), `join_nccl` + `apply_nccl` (vLLM's weight-transfer engine, the
  receiving end of `sync/nccl.py`), and `refit_ack` (every rank's read-back combined into one `RefitAck`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from draft_opd_ray.sync.refit import RefitAck, combine_ranks, tensor_fingerprint
from draft_opd_ray.sync.weight_sync import write_safetensors

SHM = "/dev/shm"
SHM_MARGIN = 16 << 20  # bytes left free in /dev/shm beside a weights file (vLLM and NCCL use it too)


class DraftWeightExtension:
    """Worker-side methods; `self` is vLLM's worker. Call with `llm.collective_rpc(name, args=...)`."""

    _draft_version: int = 0

    def _draft_module(self) -> Any:
        """The served draft module: the runner's `get_draft_model()` (V2's `speculator.model`, V1's unwrapped
        `drafter.model`), else, for a runner without that method, V1's `drafter.model`."""
        runner = self.model_runner  # type: ignore[attr-defined]
        get = getattr(runner, "get_draft_model", None)
        model = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
        if model is None:
            raise RuntimeError(
                f"this engine has no draft model to update: its {type(runner).__name__} serves none "
                "(is speculative decoding on, with a draft model rather than ngram?)"
            )
        return model

    def draft_version(self) -> int:
        return self._draft_version

    def set_draft_version(self, version: int) -> int:
        """The version just received by another path (vLLM's weight-transfer engine)."""
        self._draft_version = int(version)
        return self._draft_version

    def draft_param_names(self) -> list[str]:
        return [name for name, _ in self._draft_module().named_parameters()]

    def draft_fingerprints(self) -> dict[str, Any]:
        """This rank's refit proof: the version it serves, the draft's dtype and the fingerprint of every draft
        tensor as the engine computes with it. A linear layer whose weight the CPU backend repacked into a
        kernel handle (its `weight` left empty) is read back through that kernel: identity rows in, W^T out,
        exactly (each output is one weight times 1 plus zeros)."""
        model = self._draft_module()
        dtype = self.vllm_config.speculative_config.draft_model_config.dtype  # type: ignore[attr-defined]
        out: dict[str, list[int]] = {}
        with torch.no_grad():
            for mod_name, mod in model.named_modules():
                for p_name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                    if p_name in mod._non_persistent_buffers_set:
                        continue
                    if t.numel() == 0 and p_name == "weight" and hasattr(mod, "quant_method"):
                        t = _read_back_linear(mod)
                    out[f"{mod_name}.{p_name}" if mod_name else p_name] = list(tensor_fingerprint(t, dtype))
        return {"version": self._draft_version, "dtype": str(dtype).removeprefix("torch."), "tensors": out}

    def load_draft_weights(self, path: str, version: int) -> int:
        """Replace the draft's weights in place from a safetensors file (checkpoint names, as in the
        exported folder). A file, not tensors: collective_rpc's serializer does not carry tensors."""
        import types

        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = load_file(path)
        cfg = self.vllm_config  # type: ignore[attr-defined]
        spec = cfg.speculative_config
        draft_cfg = types.SimpleNamespace(
            model_config=spec.draft_model_config,
            load_config=spec.draft_load_config or cfg.load_config,
            lora_config=None,
        )
        with set_current_vllm_config(cfg):
            reload_weights(
                draft_cfg,  # type: ignore[arg-type]  # only model_config / load_config / lora_config are read
                self._draft_module(),
                weights_iterator=iter(weights.items()),
                weights_path=None,
                is_checkpoint_format=True,
            )
        self._draft_version = int(version)
        return len(weights)


def _read_back_linear(layer: Any, rows: int = 2048) -> Any:
    """W^T of a linear layer (this rank's shard) from its forward kernel, ``rows`` identity rows at a time."""
    k = int(getattr(layer, "input_size_per_partition", getattr(layer, "input_size", 0)))
    dtype, dev = layer.params_dtype, next(iter(layer.parameters())).device
    eye = torch.eye(k, dtype=dtype, device=dev)
    parts = [layer.quant_method.apply(layer, eye[i : i + rows]) for i in range(0, k, rows)]
    return torch.cat(parts)  # (K, N)


# the qualified name vLLM imports the extension by, in each worker process
EXTENSION = f"{DraftWeightExtension.__module__}.{DraftWeightExtension.__qualname__}"

# ------------------------------------------------------------------------------------ the engine owner's calls


def scratch_dir(nbytes: int) -> str | None:
    """Where to write a ``nbytes`` file the engine's worker reads: /dev/shm when it has room for it (memory, no
    disk), else None (the temp dir). Docker's default /dev/shm is 64 MB, less than a draft's weights."""
    try:
        st = os.statvfs(SHM)
    except OSError:  # no /dev/shm (not Linux)
        return None
    return SHM if st.f_bavail * st.f_frsize >= nbytes + SHM_MARGIN else None


@contextlib.contextmanager
def weights_file(weights: Mapping[str, torch.Tensor]) -> Iterator[str]:
    """The full draft state (checkpoint names) written once to a file the engine's workers read, in shared
    memory (the temp dir when /dev/shm lacks room: `scratch_dir`); removed on exit."""
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    with tempfile.NamedTemporaryFile(
        dir=scratch_dir(nbytes), prefix="draft_opd_ray_", suffix=".safetensors"
    ) as f:
        write_safetensors(f.name, weights)
        yield f.name


def apply_file(llm: Any, path: str, version: int) -> None:
    """Every rank reloads the draft from the safetensors file at ``path`` (the full state: vLLM's reloader needs
    every weight, not a subset), then the prefix cache goes: its blocks hold KV computed by the old draft."""
    llm.collective_rpc("load_draft_weights", args=(path, version))
    llm.reset_prefix_cache()


def join_nccl(llm: Any, address: str, port: int, rank_offset: int, world_size: int) -> None:
    """Join the sender's NCCL group (vLLM's weight-transfer engine, backend "nccl"), the engine's ranks at
    ``rank_offset`` + tensor-parallel rank. A group joined before is dropped first (it is re-formed when an
    engine restarted, `NcclWeightSync.restarted`)."""
    llm.shutdown_weight_transfer_engine()
    llm.init_weight_transfer_engine(
        {
            "init_info": {
                "master_address": address,
                "master_port": port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "packed": True,
            }
        }
    )


def apply_nccl(llm: Any, plan: dict[str, list[Any]], version: int) -> None:
    """Receive a version by NCCL broadcast: every rank loads the checkpoint-named tensors of ``plan`` (names,
    dtype names, shapes) in vLLM's layerwise reload, started and finished around it."""
    llm.start_draft_weight_update()
    llm.update_weights({"update_info": plan})
    llm.finish_weight_update()
    llm.collective_rpc("set_draft_version", args=(version,))
    llm.reset_prefix_cache()


def refit_ack(llm: Any, receiver: str, aliases: Mapping[str, str]) -> RefitAck:
    """The refit proof (`sync/refit.py`): every rank's draft read back from the engine, fingerprinted, and the
    ranks combined into one report of what the engine serves. ``aliases``: the checkpoint-name fragments vLLM's
    module for the draft's kind spells differently (`DraftKind.vllm_aliases`)."""
    return ack_from_ranks(
        llm.collective_rpc("draft_fingerprints"), llm.llm_engine.vllm_config, receiver, aliases
    )


def ack_from_ranks(
    ranks: list[dict[str, Any]], vllm_config: Any, receiver: str, aliases: Mapping[str, str]
) -> RefitAck:
    """`refit_ack` from the ranks' `draft_fingerprints` replies, however they were fetched (an `LLM`'s
    `collective_rpc`, or a server's `AsyncLLM.collective_rpc`), and the engine's config."""
    versions = {int(r["version"]) for r in ranks}
    spec = vllm_config.speculative_config
    assert spec is not None  # an engine without a draft has nothing to refit
    return RefitAck(
        receiver=receiver,
        version=versions.pop() if len(versions) == 1 else -1,  # ranks that disagree serve no one version
        dtype=str(ranks[0]["dtype"]),
        tensors=combine_ranks([{n: (int(a), int(b)) for n, (a, b) in r["tensors"].items()} for r in ranks]),
        aliases=dict(aliases),
        # KV heads fewer than the ranks are replicated: the check counts them (`refit.kv_replicas`)
        tensor_parallel=int(spec.draft_parallel_config.tensor_parallel_size),
        kv_heads=int(spec.draft_model_config.get_total_num_kv_heads()),
    )
