"""Typed configuration: every default lives here, once. YAML files under `conf/` only override.

Each dataclass checks its own fields in `__post_init__` (raising ConfigError that names the dotted key);
checks that span several nodes, or touch files, models and the cluster, live in `draft_opd_ray.preflight`. Hydra composes `conf/config.yaml`
over these nodes (see `draft_opd_ray.config.store`), so a typo'd key or a wrong type is rejected by
OmegaConf before our code runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from draft_opd_ray.errors import ConfigError

# loss.objective: Draft-OPD, and the two controls that train on the same rollouts without replaying drafted blocks
OBJECTIVES = ("opd", "sft_on_rollouts", "sft_on_rollouts_soft")
REJECTED_SCOPES = ("all", "first")  # loss.rejected_scope
ESTIMATORS = ("full", "topk", "token")  # loss.estimator
DIRECTIONS = ("mixed", "forward", "reverse")  # loss.directions


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _one_of(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


@dataclass
class ClusterConfig:
    """Cluster shape and how many of each actor to start. Picked with `+cluster=NAME`."""

    name: str = "local"
    ray_address: str | None = None  # None: start a local Ray; "auto": join the running cluster
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU-only cluster
    cpus_per_node: float = 2.0
    rollout_engines: int = 2
    rollout_tensor_parallel: int = 1  # GPUs per vLLM engine (must fit in one node)
    replay_actors: int = 1
    learner_ranks: int = 1  # DeepSpeed data-parallel size
    # CPU share of each actor. On a CPU cluster these are all the actors get; on GPU clusters they are
    # the host CPUs reserved beside the GPUs.
    cpus_per_rollout: float = 0.4
    cpus_per_replay: float = 0.4
    cpus_per_learner: float = 0.6
    cpus_for_driver: float = 0.2
    # GPU share of each actor on a GPU cluster: 1 = whole GPUs; a fraction < 1 lets actors share one GPU (a vLLM
    # engine then keeps to rollout.gpu_memory_utilization of it). A tensor-parallel engine takes whole GPUs.
    gpus_per_rollout: float = 1.0
    gpus_per_replay: float = 1.0
    gpus_per_learner: float = 1.0
    connect_timeout_s: float = 60.0  # reaching the Ray cluster
    reserve_timeout_s: float = 60.0  # placing the plan's actors (a plan that cannot fit fails after this)
    actor_timeout_s: float = 1800.0  # any one wait on an actor (a round, a step, a refit): longer is a hang
    max_restarts: int = 3  # per rollout worker / replay actor killed mid-run (its lost work is redone)
    # CPU clusters, torch threads of the replay actors and learner ranks. "auto": a replay actor (it runs while
    # the engines generate the next rounds) the cores of its node no engine is bound to, a learner rank (it runs
    # once they are mostly done) all of them, each split between the actors of its role on the node; "one": one
    # thread each, as earlier versions ran (docs/design.md, "Roles and placement")
    cpu_threads: str = "auto"
    # A directory every node mounts at the same path (NFS, Lustre, ...): the run dir, the cache and the
    # checkpoints live under it. Required when num_nodes > 1; cache_dir then defaults to <storage_dir>/cache.
    storage_dir: str | None = None

    def __post_init__(self) -> None:
        k = "cluster"
        for name in ("gpus_per_rollout", "gpus_per_replay", "gpus_per_learner"):
            v = getattr(self, name)
            _check(0 < v <= 1, f"{k}.{name}", f"must be in (0, 1] (a share of one GPU), got {v}")
        _check(
            self.gpus_per_rollout == 1 or self.rollout_tensor_parallel == 1,
            f"{k}.gpus_per_rollout",
            "a tensor-parallel engine takes whole GPUs (set it to 1 or rollout_tensor_parallel to 1)",
        )
        for name in ("connect_timeout_s", "reserve_timeout_s", "actor_timeout_s"):
            _check(getattr(self, name) > 0, f"{k}.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(
            self.storage_dir is None or self.storage_dir.startswith("/"),
            f"{k}.storage_dir",
            f"must be an absolute path (every node resolves it alike), got {self.storage_dir!r}",
        )
        _one_of(self.cpu_threads, f"{k}.cpu_threads", ("auto", "one"))
        _check(self.num_nodes >= 1, f"{k}.num_nodes", f"must be >= 1, got {self.num_nodes}")
        _check(self.max_restarts >= 0, f"{k}.max_restarts", f"must be >= 0, got {self.max_restarts}")
        _check(self.gpus_per_node >= 0, f"{k}.gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        _check(self.cpus_per_node > 0, f"{k}.cpus_per_node", f"must be > 0, got {self.cpus_per_node}")
        for name in ("rollout_engines", "replay_actors", "learner_ranks", "rollout_tensor_parallel"):
            v = getattr(self, name)
            _check(v >= 1, f"{k}.{name}", f"must be >= 1, got {v}")
        for name in ("cpus_per_rollout", "cpus_per_replay", "cpus_per_learner", "cpus_for_driver"):
            v = getattr(self, name)
            _check(v > 0, f"{k}.{name}", f"must be > 0, got {v}")


@dataclass
class TargetConfig:
    """The target (teacher / verifier) model."""

    path: str = (
        "embedded:smollm2-135m-instruct"  # or a local HF folder (config.json + safetensors + tokenizer)
    )
    dtype: str = "float32"  # float32 on CPU; bfloat16 on GPUs
    # null = what the run's longest sequence needs, within the target's max_position_embeddings (sizing.py)
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _one_of(self.dtype, "target.dtype", ("float32", "bfloat16", "float16"))
        n = self.max_model_len
        _check(n is None or n >= 16, "target.max_model_len", f"must be >= 16, got {n}")

    def model_len(self) -> int:
        """`max_model_len`, set or sized from the target (`preflight.size`, `driver.prepare_target`)."""
        _check(
            self.max_model_len is not None,
            "target.max_model_len",
            "not sized yet: set it, or size the config from its target first (driver.prepare_target)",
        )
        return int(self.max_model_len)  # type: ignore[arg-type]


DEFAULT_DRAFT_VOCAB = 8192
# EAGLE-3's released heads for 128k-152k vocabularies (Llama 3, Qwen 2.5/3) predict over 32,000 tokens
LARGE_DRAFT_VOCAB, LARGE_VOCAB = 32_000, 100_000


@dataclass
class DraftConfig:
    """The draft model. Kind-specific fields are ignored by the other kinds."""

    kind: str = "eagle3"  # eagle3 | standalone | dflash: a kind of drafts/registry.py (checked in validation)
    path: str | None = None  # an existing draft folder to start from (or to evaluate with stages=[eval])
    num_speculative_tokens: int = 4  # K: tokens proposed per verification step
    # eagle3
    aux_layer_ids: list[int] | None = None  # target layers whose inputs feed the head; None = (2, L/2, L-1)
    # the most frequent response tokens; None = LARGE_DRAFT_VOCAB for a target vocabulary of LARGE_VOCAB or more,
    # else DEFAULT_DRAFT_VOCAB or the target's whole vocabulary when that is smaller (docs/design.md, "Why the
    # defaults")
    draft_vocab_size: int | None = None
    ttt_steps: int = 4  # training-time-test unroll depth (= K)
    ttt_decay: float = 0.8
    # train the LM head too, in SFT and in Draft-OPD alike (off: the target's rows of the draft vocabulary)
    train_lm_head: bool = False
    # dflash
    block_size: int = 8  # B; vLLM serves it with num_speculative_tokens = B - 1
    num_layers: int = 1
    mask_token_id: int | None = None  # must not be a special token of the target tokenizer
    dflash_loss_gamma: float = 7.0

    def __post_init__(self) -> None:
        _check(
            1 <= self.num_speculative_tokens <= 64,
            "draft.num_speculative_tokens",
            f"must be in [1, 64], got {self.num_speculative_tokens}",
        )
        _check(self.block_size >= 2, "draft.block_size", f"must be >= 2, got {self.block_size}")
        _check(self.num_layers >= 1, "draft.num_layers", f"must be >= 1, got {self.num_layers}")
        _check(
            self.draft_vocab_size is None or self.draft_vocab_size >= 2,
            "draft.draft_vocab_size",
            "must be >= 2",
        )
        _check(self.ttt_steps >= 1, "draft.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        _check(0 < self.ttt_decay <= 1, "draft.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")
        if self.aux_layer_ids is not None:
            _check(len(self.aux_layer_ids) >= 1, "draft.aux_layer_ids", "must list at least one layer")

    def vocab_for(self, target_vocab: int) -> int:
        """The draft vocabulary an EAGLE-3 head gets for a target of ``target_vocab`` tokens."""
        if self.draft_vocab_size is not None:
            return self.draft_vocab_size
        if target_vocab >= LARGE_VOCAB:
            return LARGE_DRAFT_VOCAB
        return min(DEFAULT_DRAFT_VOCAB, target_vocab)


@dataclass
class PromptSetConfig:
    """One prompt set: a packaged set (sharegpt, mtbench, humaneval) or the user's JSONL/Parquet file."""

    source: str = "sharegpt"  # sharegpt | mtbench | humaneval | jsonl | parquet
    path: str | None = None  # required for jsonl / parquet
    text_field: str = "prompt"
    messages_field: str | None = None  # a list of {"role", "content"}; first user turn is the prompt
    split: str = "all"  # all | train | eval: deterministic hash split of prompt ids
    eval_fraction: float = 0.05
    max_prompts: int = 512
    max_prompt_tokens: int = 512
    seed: int = 0

    def check(self, key: str) -> None:
        _one_of(self.source, f"{key}.source", ("sharegpt", "mtbench", "humaneval", "jsonl", "parquet"))
        _one_of(self.split, f"{key}.split", ("all", "train", "eval"))
        _check(
            0 < self.eval_fraction < 1, f"{key}.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}"
        )
        _check(self.max_prompts >= 1, f"{key}.max_prompts", f"must be >= 1, got {self.max_prompts}")
        _check(
            self.max_prompt_tokens >= 1,
            f"{key}.max_prompt_tokens",
            f"must be >= 1, got {self.max_prompt_tokens}",
        )


def _train_prompts() -> PromptSetConfig:
    # the sft stage takes the first sft.num_prompts, the opd stage the rest
    return PromptSetConfig(source="sharegpt", split="train", max_prompts=2560)


def _eval_prompts() -> PromptSetConfig:
    # all 80 MT-Bench questions (first turns), as the speculative-decoding papers report; 40 left the default run's
    # paired tau difference at the resolution of its CI
    return PromptSetConfig(source="mtbench", split="all", max_prompts=80)


@dataclass
class DataConfig:
    train: PromptSetConfig = field(default_factory=_train_prompts)
    eval: PromptSetConfig = field(default_factory=_eval_prompts)
    chat_template: bool = True
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        self.train.check("data.train")
        self.eval.check("data.eval")


@dataclass
class RolloutConfig:
    """Target-verified speculative decoding that produces the anchor records (docs/design.md, "Records")."""

    temperature: float = 0.0  # greedy rollouts (public code default)
    top_p: float = 1.0
    max_new_tokens: int = 256
    prompts_per_round: int = 16  # per worker, between two weight swaps
    kvcache_gb: float = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU
    gpu_memory_utilization: float = 0.5
    # draft-weight transport to the workers: auto = nccl on a GPU cluster (sync/nccl.py), else shm_file on one
    # node (one file per version, shared by every engine), object_store across nodes (sync/weight_sync.py)
    weight_sync: str = "auto"

    def __post_init__(self) -> None:
        _one_of(self.weight_sync, "rollout.weight_sync", ("auto", "shm_file", "object_store", "nccl"))
        _check(self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.prompts_per_round >= 1, "rollout.prompts_per_round", "must be >= 1")
        _check(
            self.kvcache_gb >= 1 and float(self.kvcache_gb).is_integer(),
            "rollout.kvcache_gb",
            f"vLLM's CPU KV cache is set in whole GiB (VLLM_CPU_KVCACHE_SPACE): 1, 2, ...; got {self.kvcache_gb}",
        )
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )


@dataclass
class AnchorConfig:
    """Which block starts are replayed (docs/design.md, "Anchors")."""

    policy: str = "error"  # error | all | random
    # Caps, off by default: the replay pays one forward over each sequence, so an anchor of a replayed sequence
    # costs only its branch tokens (P4 in docs/benchmarks.md); the step cap drops whole sequences, never part of one
    max_per_sequence: int | None = None
    max_per_step: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of(self.policy, "anchor.policy", ("error", "all", "random"))
        for name in ("max_per_sequence", "max_per_step"):
            v = getattr(self, name)
            _check(v is None or v >= 1, f"anchor.{name}", f"must be >= 1 or null, got {v}")


@dataclass
class ReplayConfig:
    """Teacher scoring at the selected anchors (docs/design.md, "Replay")."""

    mode: str = "recorded"  # recorded | redraft

    def __post_init__(self) -> None:
        _one_of(self.mode, "replay.mode", ("recorded", "redraft"))


@dataclass
class TeacherConfig:
    """The teacher distribution both training arms learn from: the SFT feature pass and the Draft-OPD replay run
    the target in the same precision and keep the same truncation, so the arms differ only in data and objective."""

    dtype: str = (
        "auto"  # target forward precision; auto: bfloat16 where it is fast (GPU, AVX512-BF16), else float32
    )
    # the teacher's top-k over the draft vocabulary (SFT's soft labels; Draft-OPD's loss.estimator=topk);
    # null = the whole draft vocabulary (loss.estimator=full or token; SFT then caches Vd values per token)
    topk: int | None = 16
    # Draft-OPD's teacher: verify = the rows the rollouts' verification pass computed (no second target forward
    # for the teacher; applies to the topk estimator on recorded blocks), replay = a target forward over the
    # draft's blocks; `opd.source.teacher_source` resolves it and says why
    source: str = "verify"

    def __post_init__(self) -> None:
        _one_of(self.dtype, "teacher.dtype", ("auto", "float32", "bfloat16", "float16"))
        _one_of(self.source, "teacher.source", ("verify", "replay"))
        _check(self.topk is None or self.topk >= 1, "teacher.topk", f"must be >= 1 or null, got {self.topk}")

    def kept(self, vocab: int) -> int:
        """Teacher probabilities kept per position over a draft vocabulary of ``vocab`` tokens (both arms)."""
        return vocab if self.topk is None else min(self.topk, vocab)


@dataclass
class LossConfig:
    """The acceptance-aware objective (docs/design.md, "Objective"); `draft_opd_ray.algo.loss` takes it as is."""

    gamma: float = 0.8  # decay of rejected positions, w_k = gamma^(k-1)
    lambda_acc: float = 1.0
    lambda_rej: float = 1.0
    rejected_scope: str = "all"  # all | first
    estimator: str = "topk"  # topk (needs teacher.topk) | full | token (need teacher.topk=null)
    directions: str = "mixed"  # mixed | forward | reverse (ablations: one KL everywhere)
    # opd | sft_on_rollouts (control: hard CE on the rollouts' committed tokens, no replay of drafted blocks) |
    # sft_on_rollouts_soft (control: forward KL to the teacher's top-k on the same committed tokens, no replay)
    objective: str = "opd"
    # the draft's own top-m ids joined to the teacher's top-k in the topk estimator's support (docs/design.md,
    # "Objective"): a confident drafted token outside the teacher's top-k keeps its own reverse-KL term instead of
    # vanishing into the tail; the replay actor holds a copy of the current draft to find them. 0: top-k + tail
    draft_topm: int = 16
    logprob_clamp: float = 10.0
    vocab_chunk: int = 8192  # vocabulary chunk of the `full` estimator
    token_chunk: int = 1024  # token chunk of the `full` estimator

    def __post_init__(self) -> None:
        _check(0 < self.gamma <= 1, "loss.gamma", f"must be in (0, 1], got {self.gamma}")
        _check(self.lambda_acc >= 0, "loss.lambda_acc", f"must be >= 0, got {self.lambda_acc}")
        _check(self.lambda_rej >= 0, "loss.lambda_rej", f"must be >= 0, got {self.lambda_rej}")
        _check(
            self.lambda_acc + self.lambda_rej > 0, "loss.lambda_acc", "lambda_acc + lambda_rej must be > 0"
        )
        _one_of(self.rejected_scope, "loss.rejected_scope", REJECTED_SCOPES)
        _one_of(self.estimator, "loss.estimator", ESTIMATORS)
        _one_of(self.directions, "loss.directions", DIRECTIONS)
        _one_of(self.objective, "loss.objective", OBJECTIVES)
        _check(self.draft_topm >= 0, "loss.draft_topm", f"must be >= 0, got {self.draft_topm}")
        _check(self.logprob_clamp > 0, "loss.logprob_clamp", "must be > 0")
        _check(self.vocab_chunk >= 1, "loss.vocab_chunk", "must be >= 1")
        _check(self.token_chunk >= 1, "loss.token_chunk", "must be >= 1")


@dataclass
class OptimConfig:
    """The Draft-OPD learner's AdamW and schedule (draft_opd_ray/optim.py). The default peak lr is where the SFT
    schedule ends (sft.lr 1e-3 x the cosine floor 0.1), so Draft-OPD continues its warm start without a jump."""

    lr: float = 1e-4
    warmup_ratio: float = 0.05
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(
            0 <= self.warmup_ratio < 1, "optim.warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"
        )
        _one_of(self.schedule, "optim.schedule", ("cosine", "constant"))
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim.betas",
            "two values in [0, 1)",
        )
        _check(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")


@dataclass
class LearnerConfig:
    """DeepSpeed engine of the learner. Data-parallel size = cluster.learner_ranks."""

    zero_stage: int = 0
    # optimizer updates per Draft-OPD step (the step's sequences split in groups of about equal anchor counts).
    # 32 = one rollout per update on the default plan (2 workers x 16 prompts): about the tokens per update of the
    # SFT warm start's 512-token batches; the replay's cost is paid once per step whatever this is
    mini_batches: int = 32
    # passes over each step's batch (verl's ppo_epochs): epochs x mini_batches updates a step. Controls without the
    # replay forward use it to train at the FLOPs of the Draft-OPD arm they are compared with
    epochs: int = 1
    dtype: str = "auto"  # auto: bfloat16 where the hardware has it (GPU, AVX512-BF16), float32 elsewhere
    backend: str = "auto"  # torch.distributed backend; auto: nccl where CUDA is available, gloo otherwise

    def __post_init__(self) -> None:
        _check(
            self.zero_stage in (0, 1, 2, 3),
            "learner.zero_stage",
            f"must be 0, 1, 2 or 3, got {self.zero_stage}",
        )
        _check(self.mini_batches >= 1, "learner.mini_batches", f"must be >= 1, got {self.mini_batches}")
        _check(self.epochs >= 1, "learner.epochs", f"must be >= 1, got {self.epochs}")
        _one_of(self.dtype, "learner.dtype", ("auto", "float32", "bfloat16", "float16"))
        _one_of(self.backend, "learner.backend", ("auto", "nccl", "gloo"))


@dataclass
class AsyncConfig:
    """Asynchronous weight broadcast (`async.*` in YAML and on the command line)."""

    max_staleness: int = 2  # batches proposed by a draft more than this many versions old are dropped

    def __post_init__(self) -> None:
        _check(self.max_staleness >= 0, "async.max_staleness", f"must be >= 0, got {self.max_staleness}")


@dataclass
class SFTStudyConfig:
    """SFT settings only studies set (`bench/study.py`: the matched-FLOPs SFT arm, tau-vs-compute curves); a
    product run leaves them unset. `sft/trainer.py`'s `Budget` reads them."""

    start_from: str | None = None  # continue from an exported draft (fresh optimizer) instead of a new one
    max_flops: float | None = None  # stop once training FLOPs (draft + target) reach this
    time_budget_min: float | None = None  # wall-clock cap on features + training (None: no cap)
    curve_tokens: list[int] = field(default_factory=list)  # extra draft exports at these trained-token counts

    def __post_init__(self) -> None:
        _check(all(t > 0 for t in self.curve_tokens), "sft.study.curve_tokens", "values must be > 0")
        _check(
            self.time_budget_min is None or self.time_budget_min > 0,
            "sft.study.time_budget_min",
            "must be > 0",
        )
        _check(self.max_flops is None or self.max_flops > 0, "sft.study.max_flops", "must be > 0")


@dataclass
class SFTConfig:
    """The SFT warm start / baseline recipe (EAGLE-3 TTT, DFlash block loss, standalone distillation).

    The budget is counted in trained tokens (``train_tokens``: response tokens whose loss is counted), so the
    same command trains the same draft on any machine; ``epochs`` can end it earlier, and so can the studies'
    ``study.max_flops`` and ``study.time_budget_min`` (off by default)."""

    # The EAGLE-3 warm start of the default run (other kinds override in their draft group): a short SFT, ~640
    # steps of 512 padded tokens over 768 target answers (generated in bfloat16 where the hardware has it, 1.5x
    # faster on a CPU with AVX512-BF16; they are only contexts, the soft labels come from the teacher-forced
    # forward). Users with a GPU train longer: sft.train_tokens=1250000 (docs/design.md, "Why the defaults").
    num_prompts: int = 768  # target answers generated with vLLM (cached)
    max_new_tokens: int = 256
    trajectory_dtype: str = (
        "auto"  # auto (bfloat16 where the hardware has it, else float32) | float32 | bfloat16
    )
    # more train prompts whose data-set answers (not the target's) are scored by the target and added to the SFT
    # data: ~4x cheaper per token than generating (teacher forcing); taken after data.train's prompts
    dataset_answers: int = 0
    train_tokens: int | None = 160_000  # the budget: trained (loss) tokens; None = epochs only
    epochs: int = 20  # passes over the answers (a cap: train_tokens usually ends training first)
    batch_tokens: int = 512  # padded tokens per step (smaller batches, more steps: better on a CPU budget)
    lr: float = 1e-3
    reuse: bool = True  # reuse a finished warm start with the same settings from the cache
    study: SFTStudyConfig = field(default_factory=SFTStudyConfig)

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "sft.num_prompts", "must be >= 1")
        _check(self.dataset_answers >= 0, "sft.dataset_answers", "must be >= 0")
        _check(
            self.trajectory_dtype in ("auto", "float32", "bfloat16"),
            "sft.trajectory_dtype",
            f"must be auto, float32 or bfloat16, got {self.trajectory_dtype!r}",
        )
        _check(self.max_new_tokens >= 1, "sft.max_new_tokens", "must be >= 1")
        _check(self.train_tokens is None or self.train_tokens >= 1, "sft.train_tokens", "must be >= 1")
        _check(self.epochs >= 1, "sft.epochs", "must be >= 1")
        _check(self.batch_tokens >= 16, "sft.batch_tokens", "must be >= 16")
        _check(self.lr > 0, "sft.lr", f"must be > 0, got {self.lr}")


@dataclass
class OPDConfig:
    """The Draft-OPD loop (rollout → anchors → replay → learner → broadcast)."""

    # 15 steps of 32 rollouts (2 workers x 16 prompts) on the default plan: ~480 rollouts
    steps: int = 15
    # rollout rounds (rollout.prompts_per_round prompts each) a step trains on, in the order they were handed
    # out, so a step's batch does not depend on which worker finished first; None = one per rollout worker
    rounds_per_step: int | None = None
    checkpoint_every: int = 10
    # steps in a row that apply nothing because of a non-finite loss or gradient before the run stops
    max_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "opd.steps", f"must be >= 1, got {self.steps}")
        _check(self.checkpoint_every >= 1, "opd.checkpoint_every", "must be >= 1")
        _check(
            self.rounds_per_step is None or self.rounds_per_step >= 1, "opd.rounds_per_step", "must be >= 1"
        )
        _check(self.max_nonfinite_steps >= 1, "opd.max_nonfinite_steps", "must be >= 1")


EXTRA_EVAL_SETS = ("humaneval", "validation")


@dataclass
class EvalConfig:
    """Held-out evaluation: τ with 95% CIs and paired differences, speed-up beside vLLM's baselines."""

    max_new_tokens: int = 256
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # served speed-up at each
    baselines: list[str] = field(default_factory=lambda: ["ngram"])
    # prompt sets measured beside data.eval, data.eval.max_prompts of each: humaneval (code, packaged) and
    # validation (data.train's source, its held-out hash split: prompts no training stage sees)
    extra_sets: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for e in self.extra_sets:
            _one_of(e, "eval.extra_sets", EXTRA_EVAL_SETS)
        _check(self.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1")
        _check(
            len(self.concurrency) >= 1 and all(c >= 1 for c in self.concurrency),
            "eval.concurrency",
            "values >= 1",
        )
        for b in self.baselines:
            _one_of(b, "eval.baselines", ("ngram",))


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "draft_opd_ray"
    entity: str | None = None

    def __post_init__(self) -> None:
        _one_of(self.mode, "wandb.mode", ("offline", "online", "disabled"))


@dataclass
class ServeConfig:
    """`python -m draft_opd_ray.serve`: vLLM's OpenAI-compatible server on the target and the draft, whose draft
    learns Draft-OPD from the traffic it verifies (the teacher captured in the verification pass)."""

    host: str = "127.0.0.1"
    port: int = 8000
    learn: bool = True  # false: serve the draft as it is (the static baseline)
    # completed requests of traffic per learner step (one new draft version, refit into the running server)
    requests_per_update: int = 32
    max_versions: int = 20  # the learner's budget (its lr schedule's length); the server serves on after it
    poll_s: float = 2.0  # how often the server's captured traffic is taken from the engine
    # the guard (serve/guard.py): every holdout_every-th finished request is held back from training, the last
    # guard_requests of them score each candidate against the serving draft; published when the lower end of the
    # paired τ difference's 95% interval is >= -guard_margin (a negative margin asks for an improvement)
    guard: bool = True
    guard_margin: float = 0.02
    guard_requests: int = 16
    holdout_every: int = 4

    def __post_init__(self) -> None:
        _check(1 <= self.port <= 65535, "serve.port", f"must be in [1, 65535], got {self.port}")
        _check(self.guard_requests >= 1, "serve.guard_requests", "must be >= 1")
        _check(
            self.holdout_every >= 2, "serve.holdout_every", "must be >= 2 (1 would hold back every request)"
        )
        _check(self.requests_per_update >= 1, "serve.requests_per_update", "must be >= 1")
        _check(self.max_versions >= 1, "serve.max_versions", "must be >= 1")
        _check(self.poll_s > 0, "serve.poll_s", f"must be > 0, got {self.poll_s}")


STAGES = ("sft", "opd", "eval")


@dataclass
class Config:
    """The whole run. `async_` is `async` in YAML (a Python keyword cannot be a field name)."""

    stages: list[str] = field(default_factory=lambda: list(STAGES))
    dry_run: bool = False
    # the libraries' (vLLM, Ray, DeepSpeed) INFO lines and warnings on the console too; else in <run dir>/logs
    verbose: bool = False
    resume: str | None = None  # a run dir to continue from its last complete checkpoint, with its own config
    seed: int = 0
    cache_dir: str | None = None  # converted target, warm starts; None = $DRAFT_OPD_RAY_CACHE or ~/.cache
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        _check(len(self.stages) >= 1, "stages", f"must name at least one of {list(STAGES)}")
        for s in self.stages:
            _one_of(s, "stages", STAGES)
        _check(len(set(self.stages)) == len(self.stages), "stages", f"lists a stage twice: {self.stages}")
        order = [s for s in STAGES if s in self.stages]
        _check(order == list(self.stages), "stages", f"must keep the order {list(STAGES)}, got {self.stages}")
        if self.cache_dir is None and self.cluster.storage_dir is not None:
            self.cache_dir = f"{self.cluster.storage_dir.rstrip('/')}/cache"  # every node sees the same cache


def extra_eval_set(cfg: Config, name: str) -> PromptSetConfig:
    """`eval.extra_sets` entries: humaneval, or validation = data.train's source on its held-out split."""
    n = cfg.data.eval.max_prompts
    if name == "humaneval":
        return PromptSetConfig(source="humaneval", split="all", max_prompts=n)
    return replace(cfg.data.train, split="eval", max_prompts=n)


def eval_sets(cfg: Config) -> dict[str, PromptSetConfig]:
    """The evaluation's prompt sets by report name: data.eval, then `eval.extra_sets`."""
    sets = {cfg.data.eval.source: cfg.data.eval}
    for name in cfg.eval.extra_sets:
        sets.setdefault(name, extra_eval_set(cfg, name))
    return sets
