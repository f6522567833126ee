"""Sizing of the GPU study (`bench/gpu_study.py`, settings in bench/gpu_study.yaml): the eval size from a power
estimate and the GPU-hours of every job, from docs/scaling.md's inputs and the project's own FLOP counts. Pure
arithmetic over the yaml (no GPU, no model); `bash bench/gpu_study.sh --plan` prints it. The formulas are written
out in docs/scaling.md, "The GPU study"."""

from __future__ import annotations

import functools
import math
from statistics import NormalDist
from types import SimpleNamespace
from typing import Any

from draft_opd_ray.flops import (
    dflash_forward_flops,
    eagle3_block_flops,
    eagle3_train_flops,
    target_forward_flops,
)

# what the trainer cuts each SFT sequence at (sft/trainer.py `max_seq_len`, not yet a config key): an answer of
# 2,048 tokens is trained on its first 1,024 - prompt tokens until it is one
SFT_MAX_SEQ = 1024


def target_info(cfg: dict[str, Any]) -> Any:
    """The fields of the target's config.json that `flops.py` reads."""
    t = cfg["targets"][cfg["target"]]["config"]
    return SimpleNamespace(
        hidden_size=t["hidden_size"],
        num_attention_heads=t["num_attention_heads"],
        head_dim=t["head_dim"],
        num_key_value_heads=t["num_key_value_heads"],
        intermediate_size=t["intermediate_size"],
        num_layers=t["num_hidden_layers"],
        vocab_size=t["vocab_size"],
    )


# ------------------------------------------------------------------------------------------------ power


def per_prompt_sd(m: dict[str, Any]) -> float:
    """The per-prompt SD behind a 95% CI of a mean paired difference over n prompts: half-width / 1.96 * sqrt(n)."""
    return float((m["hi"] - m["lo"]) / 2 / 1.96 * math.sqrt(m["n"]))


@functools.lru_cache
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p >= 0.5) by bisection on its CDF, Simpson's rule on the density (no SciPy needed)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def cdf(x: float, n: int = 2000) -> float:
        f = [c * (1 + (x * i / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + x / n / 3 * (f[0] + f[-1] + sum((4 if i % 2 else 2) * f[i] for i in range(1, n)))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return lo


def prompts_needed(cfg: dict[str, Any], sd: float, seeds: int) -> dict[str, int | None]:
    """Prompts per set and seed for the primary endpoint's decision rule (docs/results.md: supported when both
    95% intervals lie above zero), one n per interval, None where no n suffices.

    d[p, s] = mu + a[p] + b[s] + e[p, s]: a prompt's difference repeats across seeds with correlation rho, each
    seed shifts the whole arm by b[s] (SD seed_sd: training noise), sd^2 = Var(a + e) per seed.
    prompt-clustered (prompts resampled, each with its seed mean): Var = seed_sd^2 / S + sd^2 DE / (n S), DE = 1 +
    (S - 1) rho, z-based:  n = ceil( sd^2 DE / (S (effect^2 / (z_{1-alpha/2} + z_power)^2 - seed_sd^2 / S)) ).
    seed-level (t over the S per-seed means, S - 1 degrees of freedom): Var(seed mean) = seed_sd^2 + sd^2 / n:
        n = ceil( sd^2 / (S effect^2 / (t_{1-alpha/2, S-1} + t_{power, S-1})^2 - seed_sd^2) )."""
    p = cfg["power"]
    z = NormalDist().inv_cdf(1 - p["alpha"] / 2) + NormalDist().inv_cdf(p["power"])
    t = t_quantile(1 - p["alpha"] / 2, seeds - 1) + t_quantile(p["power"], seeds - 1)
    de = 1 + (seeds - 1) * p["rho"]
    room_c = p["effect"] ** 2 / z**2 - p["seed_sd"] ** 2 / seeds
    room_s = seeds * p["effect"] ** 2 / t**2 - p["seed_sd"] ** 2
    n_c = math.ceil(sd**2 * de / (seeds * room_c)) if room_c > 0 else None
    n_s = math.ceil(sd**2 / room_s) if room_s > 0 else None
    return {"clustered": n_c, "seed_level": n_s, "n": None if n_c is None or n_s is None else max(n_c, n_s)}


def power_estimate(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """The eval size of a kind: the per-prompt SD measured here (RMS over the validation comparisons), scaled by
    the kind's expected tau over the tau it was measured at (an assumption: the spread grows with tau)."""
    p, seeds = cfg["power"], len(cfg["seeds"])
    val = [m for m in p["measured"] if m["set"] == "validation"]
    sd_abs = math.sqrt(sum(per_prompt_sd(m) ** 2 for m in val) / len(val))
    rel = math.sqrt(sum((per_prompt_sd(m) / m["tau"]) ** 2 for m in val) / len(val))
    tau = cfg["drafts"][kind]["tau"]
    return {
        "seeds": seeds,
        "design_effect": 1 + (seeds - 1) * p["rho"],
        "sd_measured": sd_abs,
        "sd_relative": rel,
        "sd_scaled": rel * tau,
        "tau": tau,
        "at_measured_sd": prompts_needed(cfg, sd_abs, seeds),
        "five_seeds": prompts_needed(cfg, rel * tau, 5),
        **prompts_needed(cfg, rel * tau, seeds),
    }


def power_lines(cfg: dict[str, Any]) -> list[str]:
    p = cfg["power"]
    out = [
        f"power: +{p['effect']} tau at {p['power']:.0%} power, alpha {p['alpha']} two-sided, "
        f"{len(cfg['seeds'])} seeds, rho {p['rho']} (worst case), seed SD {p['seed_sd']}",
        "  measured per-prompt SD of paired differences (n = 80, SD = CI half-width / 1.96 * sqrt(80)):",
    ]
    for m in p["measured"]:
        out.append(
            f"    {m['set']:<10} {m['what']:<26} CI [{m['lo']:+.3f}, {m['hi']:+.3f}]: SD {per_prompt_sd(m):.3f}"
            f" ({per_prompt_sd(m) / m['tau']:.3f} of tau {m['tau']})"
        )
    out += [
        "  the decision needs both intervals above zero, so n is the larger of",
        "    prompt-clustered: n = ceil(sd^2 DE / (S (effect^2 / (z_{1-a/2} + z_power)^2 - seed_sd^2 / S))), "
        "DE = 1 + (S-1) rho",
        "    seed-level t:     n = ceil(sd^2 / (S effect^2 / (t_{1-a/2,S-1} + t_{power,S-1})^2 - seed_sd^2))",
    ]
    for kind in cfg["kinds"]:
        e = power_estimate(cfg, kind)
        m, five = e["at_measured_sd"], e["five_seeds"]
        out.append(
            f"  {kind}: at the measured SD {e['sd_measured']:.3f}: n = {m['clustered']} / {m['seed_level']}; scaled to "
            f"tau {e['tau']} (SD {e['sd_relative']:.3f} x tau = {e['sd_scaled']:.3f}): n = {e['clustered']} / "
            f"{e['seed_level']} -> n = {e['n']} prompts of validation per seed and arm (used; with 5 seeds "
            f"{five['n']})"
        )
    return out


def eval_prompts(cfg: dict[str, Any], kind: str) -> int:
    """Validation prompts per arm and seed: the power estimate's n, at least MT-Bench's 80."""
    n = power_estimate(cfg, kind)["n"]
    if n is None:
        raise SystemExit(f"gpu_study: {kind}: the seed SD alone exceeds the effect's budget; add seeds")
    return max(80, int(n))


# ------------------------------------------------------------------------------------------------ GPU-hours


def chain_alpha(tau: float, num_speculative_tokens: int) -> float:
    """Per-position acceptance of a chain with tau = sum_{j=0..K} alpha^j, K = ``num_speculative_tokens``
    (docs/scaling.md), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in range(num_speculative_tokens + 1)) < tau else (lo, mid)
    return lo


def anchors_and_branch(r: float, tau: float, num_speculative_tokens: int) -> tuple[float, float]:
    """Error anchors of a response of r tokens and the branch tokens the replay scores (docs/scaling.md)."""
    a = chain_alpha(tau, num_speculative_tokens)
    anchors = r / tau * (1 - a**num_speculative_tokens)
    rest = sum(
        (num_speculative_tokens - 1 - j) * a**j * (1 - a) for j in range(num_speculative_tokens)
    ) / max(1 - a**num_speculative_tokens, 1e-9)
    return anchors, anchors * rest


def draft_shape(cfg: dict[str, Any], kind: str) -> Any:
    t = target_info(cfg)
    d = cfg["drafts"][kind]
    layers = d.get("layers", 1)
    ids = [round(i * (t.num_layers - 2) / max(layers - 1, 1)) + 1 for i in range(layers)]
    return SimpleNamespace(
        **vars(t),
        target_hidden_size=t.hidden_size,
        draft_vocab_size=32000,
        aux_layer_ids=(2, t.num_layers // 2, t.num_layers - 1),
        block_size=d["k"] + 1,
        target_layer_ids=ids,
    )


def student_flops(cfg: dict[str, Any], kind: str, seq: float, anchors: float) -> float:
    """Draft forward + backward for one Draft-OPD sequence (the project's own counts, flops.py)."""
    c, num_speculative_tokens = draft_shape(cfg, kind), cfg["drafts"][kind]["k"]
    if kind == "eagle3":
        return eagle3_block_flops(c, int(seq), int(anchors), num_speculative_tokens).total
    c.num_layers = cfg["drafts"][kind]["layers"]
    return 3.0 * dflash_forward_flops(c, int(seq), int(anchors), num_speculative_tokens)


def sft_student_flops(cfg: dict[str, Any], kind: str, seq: int) -> float:
    """Draft forward + backward of one SFT sequence of ``seq`` tokens (the recipes' counts)."""
    c = draft_shape(cfg, kind)
    if kind == "eagle3":
        return eagle3_train_flops(c, 1, seq, cfg["drafts"][kind]["k"]).total
    c.num_layers = cfg["drafts"][kind]["layers"]
    return 3.0 * dflash_forward_flops(c, seq, min(64, seq), c.block_size - 1)  # 64 anchors a sequence


def opd_costs(cfg: dict[str, Any], kind: str) -> dict[str, float]:
    """Per rollout sequence: FLOPs of each role, and seconds on one GPU at docs/scaling.md's efficiencies."""
    g, s, d = cfg["gpu"], cfg["sft"], cfg["drafts"][kind]
    info = target_info(cfg)
    p, r = g["prompt_tokens"], s["mean_answer_tokens"]
    anchors, branch = anchors_and_branch(r, d["tau"], d["k"])
    per_token = target_forward_flops(info, 1, 1)
    f = {
        "rollout": per_token * (p + r / d["tau"] * (d["k"] + 1)),
        "replay": target_forward_flops(info, 1, int(p + r + branch)),
        "student": student_flops(cfg, kind, p + r, anchors),
        "features": target_forward_flops(info, 1, int(p + r)),
    }
    t = {
        "t_rollout": f["rollout"] / (g["eta_decode"] * g["peak_flops"]),
        "t_replay": f["replay"] / (g["eta_replay"] * g["peak_flops"]),
        "t_student": f["student"] / (g["eta_learner"] * g["peak_flops"]),
        "t_features": f["features"] / (g["eta_replay"] * g["peak_flops"]),
    }
    return {**f, **t, "anchors": anchors, "branch": branch}


def split(cfg: dict[str, Any], role: str, plan: str = "opd") -> int:
    """GPUs of a role in the cluster overrides of a plan (`cluster.opd` or `cluster.sft` in the yaml)."""
    keys = {
        "rollout": "cluster.rollout_engines",
        "replay": "cluster.replay_actors",
        "learner": "cluster.learner_ranks",
    }
    return int(next(o.split("=")[1] for o in cfg["cluster"][plan] if o.startswith(keys[role] + "=")))


def rollouts_per_arm(cfg: dict[str, Any]) -> int:
    per_round = int(next(o.split("=")[1] for o in cfg["cluster"]["opd"] if "prompts_per_round" in o))
    return int(cfg["opd"]["steps"] * split(cfg, "rollout") * per_round)


def control_epochs(cfg: dict[str, Any], kind: str) -> int:
    """learner.epochs that brings a no-replay control (features over the sequence + epochs x the student) to the
    Draft-OPD arm's training FLOPs (replay over sequence and branches + the student once)."""
    c = opd_costs(cfg, kind)
    return max(1, round((c["replay"] + c["student"] - c["features"]) / c["student"]))


def arm_estimate(cfg: dict[str, Any], kind: str, match: str) -> dict[str, float]:
    """Training FLOPs and hours of one arm on the node (docs/scaling.md's X: the rollout overlaps the serial replay
    + learner chain)."""
    c, n = opd_costs(cfg, kind), rollouts_per_arm(cfg)
    nr, np_, nl = split(cfg, "rollout"), split(cfg, "replay"), split(cfg, "learner")
    opd_flops = n * (c["replay"] + c["student"])
    if match == "epochs":
        e = control_epochs(cfg, kind)
        chain, flops = c["t_features"] / np_ + e * c["t_student"] / nl, n * (c["features"] + e * c["student"])
    elif match == "flops":  # SFT continued: the student on the learner ranks of the SFT plan, features cached
        seq = min(cfg["gpu"]["prompt_tokens"] + cfg["sft"]["mean_answer_tokens"], SFT_MAX_SEQ)
        per_seq = sft_student_flops(cfg, kind, seq)
        target = target_forward_flops(target_info(cfg), 1, seq)
        seqs = opd_flops / (per_seq + target)
        ranks = split(cfg, "learner", "sft")
        hours = seqs * per_seq / (ranks * cfg["gpu"]["eta_learner"] * cfg["gpu"]["peak_flops"]) / 3600
        return {"flops": opd_flops, "hours": hours, "sft_tokens": seqs * (seq - cfg["gpu"]["prompt_tokens"])}
    else:
        chain, flops = c["t_replay"] / np_ + c["t_student"] / nl, opd_flops
    seconds = n * max(c["t_rollout"] / nr, chain)
    return {"flops": flops, "hours": seconds / 3600, "step_minutes": seconds / 60 / cfg["opd"]["steps"]}


def plateau_estimate(cfg: dict[str, Any], kind: str) -> dict[str, float]:
    """The SFT plateau run: answers (one engine), the feature pass and training (the SFT plan's learner ranks)."""
    g, s = cfg["gpu"], cfg["sft"]
    info = target_info(cfg)
    p, r = g["prompt_tokens"], s["mean_answer_tokens"]
    seq, ranks = min(p + r, SFT_MAX_SEQ), split(cfg, "learner", "sft")
    answers_s = (
        s["answers"] * (p + r) * target_forward_flops(info, 1, 1) / (g["eta_decode"] * g["peak_flops"])
    )
    features_s = (
        s["answers"] * target_forward_flops(info, 1, seq) / (ranks * g["eta_prefill"] * g["peak_flops"])
    )
    budget = sft_budget(cfg)
    train_s = (
        budget / (seq - p) * sft_student_flops(cfg, kind, seq) / (ranks * g["eta_learner"] * g["peak_flops"])
    )
    width = 3 if kind == "eagle3" else cfg["drafts"][kind]["layers"]
    return {
        "answers_h": answers_s / 3600,
        "features_h": features_s / 3600,
        "train_h": train_s / 3600,
        "hours": (answers_s + features_s + train_s) / 3600,
        "tokens_per_hour": budget / (train_s / 3600),
        "feature_tb": s["answers"] * seq * width * info.hidden_size * 2 / 1e12,
    }


def eval_hours(cfg: dict[str, Any], kind: str) -> float:
    """One evaluation (validation n + MT-Bench 80 + HumanEval 164 prompts) on one engine, compute-bound, plus
    ~10 minutes for loading the target and the batch-1 speed runs (an assumption)."""
    g, d = cfg["gpu"], cfg["drafts"][kind]
    prompts = eval_prompts(cfg, kind) + 80 + 164
    per_token = target_forward_flops(target_info(cfg), 1, 1) * (d["k"] + 1) / d["tau"]
    return (
        prompts * cfg["sft"]["mean_answer_tokens"] * per_token / (g["eta_decode"] * g["peak_flops"]) + 600
    ) / 3600


def sft_budget(cfg: dict[str, Any]) -> int:
    """Trained tokens of the plateau run: `epochs` passes over the answers' trained tokens (each cut at
    SFT_MAX_SEQ), rounded up to a multiple of 2^doublings so that every export mark is whole."""
    s = cfg["sft"]
    per = min(s["mean_answer_tokens"], SFT_MAX_SEQ - cfg["gpu"]["prompt_tokens"])
    unit = 2 ** s["doublings"]
    return int(math.ceil(s["epochs"] * s["answers"] * per / unit) * unit)


def hours_lines(cfg: dict[str, Any]) -> list[str]:
    g = cfg["gpu"]
    out = [
        f"GPU-hours ({cfg['gpus']} GPUs held; docs/scaling.md: A100 bf16 {g['peak_flops']:.3g} FLOP/s, eta decode "
        f"{g['eta_decode']}, prefill {g['eta_prefill']}, replay {g['eta_replay']}, learner {g['eta_learner']}; "
        f"P {g['prompt_tokens']}, mean answer {cfg['sft']['mean_answer_tokens']} tokens; an H100 node ~1/3 of it):"
    ]
    total = 0.0
    for kind in cfg["kinds"]:
        pl, ev = plateau_estimate(cfg, kind), eval_hours(cfg, kind)
        c = opd_costs(cfg, kind)
        curve = cfg["sft"]["curve_evals"] * ev
        out.append(
            f"  {kind}: plateau {pl['hours']:.1f} h (answers {pl['answers_h']:.1f} on one engine, features "
            f"{pl['features_h']:.1f}, training {pl['train_h']:.1f}; feature cache {pl['feature_tb']:.2f} TB) + curve "
            f"evals {curve:.1f} h = {cfg['gpus'] * (pl['hours'] + curve):.0f} GPU-h; per sequence: "
            f"{c['anchors']:.0f} error anchors, {c['branch']:.0f} branch tokens"
        )
        total += pl["hours"] + curve
        for arm, a in cfg["arms"].items():
            e = arm_estimate(cfg, kind, a["match"])
            hours = e["hours"] + ev
            total += hours * len(cfg["seeds"])
            out.append(
                f"    {arm:<18} {e['flops']:.2e} training FLOPs, {hours:.1f} h a seed (eval {ev:.1f}) = "
                f"{cfg['gpus'] * hours * len(cfg['seeds']):.0f} GPU-h for {len(cfg['seeds'])} seeds"
            )
    out.append(f"  all: {total:.0f} h of the node = {cfg['gpus'] * total:.0f} GPU-h (A100)")
    return out
