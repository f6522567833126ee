"""P6 (targets in docs/benchmarks.md): draft-weight publication to all rollout workers vs a local memcpy, and the share of rollout
time stalled by weight sync. Local Ray, 2 `RolloutWorker` actors (vLLM CPU engines, one core each), embedded
SmolLM2-135M target, standalone draft (the target's first 29 of 30 layers: ~0.5 GB of float32 weights).

    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_weight_sync.py
    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_weight_sync.py --transport object_store [--zero-copy-torch]

Writes results/bench/P6.json (`--out`; format: results/README.md).

Transports (draft_opd_ray/sync/weight_sync.py): `shm_file` (default on one node) -- the publisher writes the state
dict once per version to a shared-memory safetensors file and sends each worker its path; `object_store` -- one
`ray.put`, then every worker writes its own file for its engine (with --zero-copy-torch: Ray's zero-copy tensor
pickling).

Part 1, publication ratio: `sync.publish(v, state_dict)` then `.wait()` (both workers
have applied version v), timed on the driver with the workers idle, divided by a local memcpy of the same bytes
(`{k: v.clone()}` of every tensor, in the driver). The two are interleaved (memcpy, publish, memcpy, publish, ...)
after one untimed warm-up publication; reported: the median per-pair ratio (the headline: the clone's page faults
make the denominator jumpy on a loaded box), mean / sd / min / max, and the ratios of the means and of the medians. A second
denominator, `copy_` into preallocated tensors (bandwidth only, no page faults), is printed beside it.
Breakdown of one publication (wall clocks of the driver and the actors, same machine):
  put       driver: `publish` itself = shm_file: writing the version's file; object_store: `ray.put` of the state
            dict (pickling + copy into the object store); + the submits
  transfer  publish returned -> the actor's `load_draft_weights` starts (dispatch, object fetch, unpickling)
  apply     inside the actor: `SpecDecodeEngine.load_draft_weights`, split into
              file   object_store only: safetensors `save_file` of the state dict to the worker's own file
              rpc    `collective_rpc("load_draft_weights")`: the engine's worker process opens the file
                     (safetensors `load_file`, memory-mapped) and runs vLLM's in-place reloader over it
              reset  `reset_prefix_cache`
  return    last actor finished -> `wait()` returned on the driver
The per-step timers wrap the engine's own `llm.collective_rpc` / `llm.reset_prefix_cache` on the actor's engine
instance; the code that runs is the production `RolloutWorker.load_draft_weights`.

Part 2, stall share: blocks of `--rounds` generation rounds on both workers (each worker: the same prompts,
greedy, `--max-new-tokens`), with ("sync") or without ("nosync") a new version published right after each round
is submitted (so each worker applies it between that round and the next, as in training), blocks interleaved
(sync, nosync, nosync, sync, ...). Reported:
  stall share = per worker, time from the end of a round to the end of the weight load that follows it
                (transfer + apply, the actor is busy with it), summed, / wall time of the sync block; mean over
                workers and blocks;
  wall share  = (wall of a sync block - wall of the nosync block paired with it) / wall of the sync block (includes the
                driver's ray.put competing with generation for the two cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from _results import add_result_args, write_result

from draft_opd_ray.rollout.worker import RolloutWorker


def _stats(xs: list[float], fmt: str = ".3f") -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return (
        f"median {statistics.median(xs):{fmt}} mean {statistics.fmean(xs):{fmt}} sd {sd:{fmt}} "
        f"min {min(xs):{fmt}} max {max(xs):{fmt}} (n={len(xs)})"
    )


class TimedRolloutWorker(RolloutWorker):
    """RolloutWorker that records when its generation rounds and weight loads start and end."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[dict] = []
        self._cur: dict = {}
        llm = self.engine.llm
        rpc, reset = llm.collective_rpc, llm.reset_prefix_cache

        def timed_rpc(method, *a, **kw):
            if method != "load_draft_weights":
                return rpc(method, *a, **kw)
            path = kw["args"][0]
            self._cur["file_mb"] = os.path.getsize(path) / 1e6
            self._cur["file_s"] = time.perf_counter() - self._cur["t_apply0"]
            t = time.perf_counter()
            out = rpc(method, *a, **kw)
            self._cur["rpc_s"] = time.perf_counter() - t
            return out

        def timed_reset(*a, **kw):
            t = time.perf_counter()
            out = reset(*a, **kw)
            self._cur["reset_s"] = time.perf_counter() - t
            return out

        llm.collective_rpc = timed_rpc
        llm.reset_prefix_cache = timed_reset

    def generate(self, prompts, sampling):
        t0 = time.time()
        out = super().generate(prompts, sampling)
        self.events.append({"kind": "gen", "start": t0, "end": time.time()})
        return out

    def load_draft_weights(self, weights, version):
        entered = time.time()
        nbytes = sum(v.numel() * v.element_size() for v in weights.values())
        self._cur = {"kind": "load", "version": version, "start": entered, "mb": nbytes / 1e6}
        self._cur["t_apply0"] = time.perf_counter()
        super().load_draft_weights(weights, version)
        self._cur["apply_s"] = time.perf_counter() - self._cur["t_apply0"]
        self._cur["end"] = time.time()
        self.events.append(self._cur)
        return version

    def load_draft_weights_file(self, path, version):
        entered = time.time()
        self._cur = {"kind": "load", "version": version, "start": entered, "mb": os.path.getsize(path) / 1e6}
        self._cur["t_apply0"] = time.perf_counter()
        super().load_draft_weights_file(path, version)
        self._cur["apply_s"] = time.perf_counter() - self._cur["t_apply0"]
        self._cur["end"] = time.time()
        self.events.append(self._cur)
        return version

    def take_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out


def write_p6(args: argparse.Namespace, raw: dict) -> None:
    """results/bench/P6.json: the median per-pair publication ratio and (with part 2) the mean stall share."""
    value = {"publication_over_memcpy": round(statistics.median(raw["ratios"]), 1)}
    met = None  # both targets or nothing: without part 2 the stall target is not measured
    if "stall_shares" in raw:
        value["stall_percent"] = round(100 * statistics.fmean(raw["stall_shares"]), 1)
        met = value["publication_over_memcpy"] <= 5 and value["stall_percent"] <= 5
    write_result(args, "P6", value=value, target="publication <= 5x memcpy; stall <= 5%", met=met, raw=raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=29, help="standalone draft = first N target layers")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10, help="timed publications (each paired with a memcpy)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="generation rounds per block in part 2")
    ap.add_argument(
        "--blocks", type=int, default=2, help="sync/nosync block pairs in part 2 (0 = skip part 2)"
    )
    ap.add_argument("--zero-copy-torch", action="store_true", help="RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1")
    ap.add_argument(
        "--transport",
        default="shm_file",
        choices=("shm_file", "object_store"),
        help="shm_file (default on one node): the publisher writes one file per version for all workers",
    )
    add_result_args(ap)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.zero_copy_torch:
        os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"

    import ray
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from draft_opd_ray.config.schema import DraftConfig, PromptSetConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.data.prompts import load_prompt_set
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.models.target import read_target_info, stop_token_ids
    from draft_opd_ray.rollout.engine import EngineRun, Sampling
    from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync

    t_all = time.perf_counter()
    target = ensure_embedded_target()
    tmp = tempfile.mkdtemp(prefix="bench_weight_sync_")
    ray_env = {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}
    if args.zero_copy_torch:
        ray_env["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
    ray.init(
        num_cpus=args.workers,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=int(4e9),
        runtime_env={"env_vars": ray_env},
    )
    workers = []
    try:
        draft = build_standalone_from_target(target, tmp, layer_ids=list(range(args.draft_layers)))
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [
            list(p.token_ids)
            for p in load_prompt_set(PromptSetConfig(source="mtbench", max_prompts=args.prompts), tok).prompts
        ]
        weights = [{k: v.clone() for k, v in load_file(str(draft / "model.safetensors")).items()}]
        g = torch.Generator().manual_seed(0)  # a second, slightly different state dict to alternate with
        weights.append(
            {k: v + 1e-3 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights[0].items()}
        )
        nbytes = sum(v.numel() * v.element_size() for v in weights[0].values())
        print(
            f"setup: {args.workers} workers, standalone draft of {args.draft_layers} layers: {len(weights[0])} "
            f"tensors, {nbytes / 1e6:.0f} MB; transport {args.transport}; zero-copy torch {args.zero_copy_torch}",
            flush=True,
        )

        t0 = time.perf_counter()
        actor = ray.remote(num_cpus=1)(TimedRolloutWorker)
        workers = [
            actor.remote(
                rank,
                EngineRun(str(target), "standalone", str(draft), cpu_bind=str(rank % (os.cpu_count() or 1))),
                DraftConfig(kind="standalone", num_speculative_tokens=args.num_speculative_tokens),
                TargetConfig(max_model_len=args.max_model_len),
                RolloutConfig(),
            )
            for rank in range(args.workers)
        ]
        ray.get([w.version.remote() for w in workers])
        print(f"workers ready in {time.perf_counter() - t0:.1f} s", flush=True)
        sync = (
            SharedFileWeightSync(workers) if args.transport == "shm_file" else ObjectStoreWeightSync(workers)
        )
        version = 0

        def publish_once() -> dict:
            nonlocal version
            version += 1
            ray.get([w.take_events.remote() for w in workers])
            sd = weights[version % 2]
            p0 = time.time()
            sync.publish(version, sd)
            p1 = time.time()
            sync.wait()
            p2 = time.time()
            loads = [e for w in workers for e in ray.get(w.take_events.remote()) if e["kind"] == "load"]
            assert len(loads) == len(workers) and all(e["version"] == version for e in loads)
            return {
                "total": p2 - p0,
                "put": p1 - p0,
                "transfer": statistics.fmean(e["start"] - p1 for e in loads),
                "apply": statistics.fmean(e["apply_s"] for e in loads),
                "file": statistics.fmean(e["file_s"] for e in loads),
                "rpc": statistics.fmean(e["rpc_s"] for e in loads),
                "reset": statistics.fmean(e["reset_s"] for e in loads),
                "return": p2 - max(e["end"] for e in loads),
                "file_mb": loads[0]["file_mb"],
            }

        def memcpy(sd: dict) -> float:
            t = time.perf_counter()
            out = {k: v.clone() for k, v in sd.items()}
            dt = time.perf_counter() - t
            del out
            return dt

        def copy_into(sd: dict, dst: dict) -> float:
            t = time.perf_counter()
            for k, v in sd.items():
                dst[k].copy_(v)
            return time.perf_counter() - t

        # ---------------------------------------------------------------- part 1: publication vs memcpy
        w = publish_once()
        print(f"warm-up publication: {w['total']:.2f} s", flush=True)
        dst = {k: torch.empty_like(v) for k, v in weights[0].items()}
        copy_into(weights[0], dst)
        pubs, copies, copies2, ratios = [], [], [], []
        for rep in range(args.reps):
            c = memcpy(weights[(version + 1) % 2])
            c2 = copy_into(weights[(version + 1) % 2], dst)
            p = publish_once()
            pubs.append(p)
            copies.append(c)
            copies2.append(c2)
            ratios.append(p["total"] / c)
            print(
                f"rep {rep}: memcpy {c * 1e3:.0f} ms (copy_ {c2 * 1e3:.0f} ms), publish->applied {p['total']:.2f} s "
                f"= put {p['put']:.2f} + transfer {p['transfer']:.2f} + apply {p['apply']:.2f} (file "
                f"{p['file']:.2f}, rpc {p['rpc']:.2f}, reset {p['reset']:.3f}) + return {p['return']:.3f}; "
                f"ratio {ratios[-1]:.1f}",
                flush=True,
            )
        del dst
        mean = {k: statistics.fmean(p[k] for p in pubs) for k in pubs[0]}
        m_copy, m_copy2 = statistics.fmean(copies), statistics.fmean(copies2)
        print(
            f"P6 publication {statistics.median(ratios):.1f}x memcpy (median per-pair ratio; {_stats(ratios, '.1f')}; "
            f"ratio of means {mean['total'] / m_copy:.1f}, of medians "
            f"{statistics.median(p['total'] for p in pubs) / statistics.median(copies):.1f}; publish->applied {mean['total']:.2f} s (median "
            f"{statistics.median(p['total'] for p in pubs):.2f}) vs clone {m_copy * 1e3:.0f} ms (median "
            f"{statistics.median(copies) * 1e3:.0f}); vs copy_ into preallocated tensors {m_copy2 * 1e3:.0f} ms: "
            f"{mean['total'] / m_copy2:.0f}x; {nbytes / 1e6:.0f} MB to {args.workers} workers; target <= 5)",
            flush=True,
        )
        print(
            f"P6 breakdown (mean of {len(pubs)}, seconds): put {mean['put']:.2f}, transfer {mean['transfer']:.2f}, "
            f"apply {mean['apply']:.2f} = shm file write {mean['file']:.2f} ({mean['file_mb']:.0f} MB) + "
            f"vLLM rpc {mean['rpc']:.2f} (file read + in-place reload in the engine's worker process) + "
            f"prefix-cache reset {mean['reset']:.3f}; return {mean['return']:.3f}",
            flush=True,
        )

        raw: dict = {"mb": round(nbytes / 1e6), "workers": args.workers, "transport": args.transport}
        raw |= {"zero_copy_torch": args.zero_copy_torch, "ratios": ratios, "publications": pubs}
        raw |= {"clone_s": copies, "copy_into_s": copies2}

        # ---------------------------------------------------------------- part 2: stall share
        if args.blocks > 0:
            sampling = Sampling(
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop_token_ids(read_target_info(target), tok),
            )
            ray.get([w.generate.remote(prompts, sampling) for w in workers])  # warm-up
            ray.get([w.take_events.remote() for w in workers])

            def block(with_sync: bool) -> dict:
                nonlocal version
                t0 = time.time()
                tokens = 0
                for r in range(args.rounds):
                    refs = [w.generate.remote(prompts, sampling) for w in workers]
                    if with_sync and r < args.rounds - 1:  # applied between this round and the next
                        version += 1
                        sync.publish(version, weights[version % 2])
                    tokens += sum(len(rec.response_ids) for recs in ray.get(refs) for rec in recs)
                if with_sync:
                    sync.wait()
                wall = time.time() - t0
                per_worker = []
                for w in workers:
                    ev = sorted(ray.get(w.take_events.remote()), key=lambda e: e["start"])
                    stalled = 0.0
                    for prev, cur in zip(ev, ev[1:]):
                        if cur["kind"] == "load" and prev["kind"] == "gen":
                            stalled += cur["end"] - prev["end"]
                    per_worker.append(stalled)
                return {"wall": wall, "stalled": per_worker, "tokens": tokens}

            shares, wall_shares, walls = [], [], {"sync": [], "nosync": []}
            for b in range(args.blocks):
                order = (True, False) if b % 2 == 0 else (False, True)
                res = {s: block(s) for s in order}
                sync_res, plain = res[True], res[False]
                walls["sync"].append(sync_res["wall"])
                walls["nosync"].append(plain["wall"])
                shares += [s / sync_res["wall"] for s in sync_res["stalled"]]
                wall_shares.append((sync_res["wall"] - plain["wall"]) / sync_res["wall"])
                print(
                    f"block {b} ({'/'.join('sync' if s else 'nosync' for s in order)}): sync wall "
                    f"{sync_res['wall']:.1f} s ({sync_res['tokens']} tokens), stalled per worker "
                    f"{', '.join(f'{s:.2f}' for s in sync_res['stalled'])} s; nosync wall {plain['wall']:.1f} s "
                    f"({plain['tokens']} tokens)",
                    flush=True,
                )
            round_s = statistics.fmean(walls["nosync"]) / args.rounds
            print(
                f"P6 stall share {100 * statistics.fmean(shares):.1f}% (per worker-block {_stats([100 * s for s in shares], '.1f')} %); "
                f"wall share {100 * statistics.fmean(wall_shares):.1f}% ({_stats([100 * s for s in wall_shares], '.1f')} %); "
                f"{args.rounds} rounds/block, {args.rounds - 1} publications/block, round {round_s:.1f} s "
                f"({args.prompts} prompts x {args.max_new_tokens} tokens per worker); target <= 5%",
                flush=True,
            )
            raw |= {"stall_shares": shares, "wall_shares": wall_shares, "block_walls_s": walls}
            raw |= {"rounds": args.rounds, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
        write_p6(args, raw)
    finally:
        for w in workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except Exception as exc:  # best effort on teardown
                print(f"worker shutdown: {exc}")
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
