"""config.yaml -> typed, frozen dataclasses, with every problem reported at once.

    cfg = load_config("config.yaml", overrides=["train.lr=1e-4"])

This module imports no torch, so `llmtrain check-config` answers on a login node in well
under a second. Problems are collected (unknown keys with a did-you-mean, wrong types, bad
values, cross-field checks) and raised together as one ConfigError whose lines read
`section.key: problem (got X)`.

Paths: `${VAR}` is expanded from the environment, `~` is the home directory, and a relative
path is relative to the config file's folder. A model or dataset that is not a path
(`HuggingFaceTB/SmolLM2-135M`) is a hub id, looked up where download_data_model.sh puts it:
`$LLMTRAIN_HOME/models/<id>` and `$LLMTRAIN_HOME/datasets/<id>`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .data.sources import (HOME_VAR, file_suffix, fingerprint, given_prepared, is_glob, is_hub_id, is_split_name,
                           local_path, on_disk, source_files, source_record, tokenizer_sha256,
                           tokenizer_source)
from .errors import UserError
from .files import load_yaml, read_json
from .optimizers import OPTIMIZERS
from .parallel.dims import ParallelDims
from .rundir import CHECKPOINTS, META, latest_checkpoint

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_REQUIRED = dataclasses.MISSING


class ConfigError(UserError):
    """A config that cannot be used; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class RunConfig:
    name: str  # the run directory is <dir>/<name>: the same name continues the same run
    dir: str = "${LLMTRAIN_HOME}/runs"  # root folder of all run directories


DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoraSpec:
    """model.lora, parsed (model/lora.py applies it)."""
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse(cls, raw: dict | None) -> "LoraSpec | None":
        """model.lora as written (None: no LoRA); raises UserError naming a bad key."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise UserError(f"model.lora: must be a mapping like {{rank: 16, alpha: 32}} (got {raw!r})")
        known = {"rank", "alpha", "dropout", "target_modules"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"model.lora.{unknown[0]}: unknown key; use {', '.join(sorted(known))}")
        targets = raw.get("target_modules", DEFAULT_TARGETS)
        if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
            raise UserError(f"model.lora.target_modules: a list of module names like [q_proj, v_proj] "
                            f"(got {targets!r})")
        spec = cls(**{**raw, "target_modules": tuple(targets)})
        if not isinstance(spec.rank, int) or spec.rank < 1:
            raise UserError(f"model.lora.rank: must be an integer >= 1 (got {spec.rank!r})")
        if not isinstance(spec.alpha, (int, float)) or spec.alpha <= 0:
            raise UserError(f"model.lora.alpha: must be > 0 (got {spec.alpha!r})")
        if not isinstance(spec.dropout, (int, float)) or not 0 <= spec.dropout < 1:
            raise UserError(f"model.lora.dropout: must be in [0, 1) (got {spec.dropout!r})")
        return spec


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: Optional[str] = None  # local HF folder or downloaded hub id; None: from scratch
    tokenizer: Optional[str] = None  # local folder or hub id; default: name_or_path
    architecture: Optional[dict] = None  # inline HF config (model_type + fields) to train from scratch
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    activation_checkpointing_every: int = 1  # with it: every k-th decoder layer only (1: all)
    lora: Optional[dict] = None  # {rank, alpha, dropout, target_modules}: train adapters only (model/lora.py)

    @property
    def lora_spec(self) -> "LoraSpec | None":
        return LoraSpec.parse(self.lora)


@dataclass(frozen=True)
class DataConfig:
    # a local file, folder (save_to_disk, hub snapshot) or glob of files (parquet, jsonl, json,
    # csv, txt, arrow; jsonl/json/csv/txt also compressed: .gz, .bz2, .xz), or a downloaded hub id
    dataset: str
    # text: documents of plain text, one stream of tokens; chat: a conversation per record (a
    # list of {role, content} in messages_field) rendered with the tokenizer's chat template;
    # prompt_completion: a prompt and its completion per record
    format: Literal["text", "chat", "prompt_completion"] = "text"
    text_field: str = "text"  # column holding the documents
    messages_field: str = "messages"  # chat: column holding the conversations
    prompt_field: str = "prompt"  # prompt_completion: column holding the prompts
    completion_field: str = "completion"  # prompt_completion: column holding the completions
    # chat/prompt_completion: the loss covers the assistant turns or the completion (with their
    # end-of-turn/EOS token), or every token
    train_on: Literal["completion", "all"] = "completion"
    truncation: Literal["truncate", "drop"] = "truncate"  # samples over seq_len + 1 tokens
    packing: bool = True  # chat/prompt_completion: several samples per sequence, never attending across
    document_masking: bool = False  # text: attention stays within each document, positions restart
    text_unit: Literal["line", "file"] = "line"  # .txt sources: a document is a line, or a whole file
    # .txt/.csv/.json(l) files: bytes that are not UTF-8 stop prepare (strict), become U+FFFD
    # (replace) or are dropped (ignore)
    encoding_errors: Literal["strict", "replace", "ignore"] = "strict"
    split: str = "train"  # split of the source dataset to read
    validation: Optional[str] = None  # evaluation documents: a split of the dataset, or a file/glob
    validation_fraction: Optional[float] = None  # share of documents held out; None: 0.01 (0 with validation)
    add_bos: Literal["auto", True, False] = "auto"  # BOS before each document; auto: if bos != eos
    seq_len: int = 1024  # tokens per training sample
    prepared_dir: str = "${LLMTRAIN_HOME}/prepared"  # root of prepared (tokenized) datasets
    # the prepared folder to train from; None: the one data.dataset's files and the data options
    # name under prepared_dir. llmtrain submit writes it into the frozen config: the jobs read
    # this folder and never touch the source (a requeue trains on after the source is deleted).
    prepared: Optional[str] = None
    num_proc: Optional[int] = None  # tokenizer processes; None: one per 8 MiB of text, up to the cores (at most 64)
    # steps of batches read ahead on a background thread; 0: on the training one; None: 2 on GPUs,
    # 0 on CPUs (no copy to hide there, and the thread costs a CPU run ~3%: doc/benchmarks.md)
    prefetch_steps: Optional[int] = None

    @property
    def samples(self) -> bool:
        """Whether the data is a set of samples (chat, prompt_completion), not one text stream."""
        return self.format != "text"

    @property
    def columns(self) -> dict[str, str]:
        """The columns this format reads: {config key: column name}."""
        if self.format == "chat":
            return {"messages_field": self.messages_field}
        if self.format == "prompt_completion":
            return {"prompt_field": self.prompt_field, "completion_field": self.completion_field}
        return {"text_field": self.text_field}

    @property
    def holdout_fraction(self) -> float:
        """The share of the dataset's documents held out for evaluation, defaults applied."""
        if self.validation_fraction is not None:
            return self.validation_fraction
        return 0.0 if self.validation else 0.01


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int  # samples per optimizer step, over all ranks and micro-steps
    micro_batch_size: int  # samples per rank per forward/backward
    max_steps: Optional[int] = None  # optimizer steps; set this or epochs
    epochs: Optional[int] = None  # passes over the prepared samples; max_steps derived at start
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # learning rate at the end of the cosine decay
    warmup_steps: int = 0  # linear warmup from 0 to lr
    optimizer: str = "adamw"  # a name in optimizers.OPTIMIZERS
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on biases and norms)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    chunked_loss: bool = True  # the loss over chunks of tokens, never all logits at once (model/loss.py)
    compile: bool = False  # torch.compile each decoder layer and the loss's chunks (compiled in the first step)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    tf32: bool = True  # fp32 matmuls on Ampere+ GPUs use TF32 tensor cores (about 1e-3 relative error)
    peak_tflops: Optional[float] = None  # one GPU's dense peak for MFU; None: metrics.PEAK_TFLOPS
    seed: int = 1234
    log_every: int = 10  # steps between metrics lines
    eval_every: int = 500  # steps between evaluations; 0 disables evaluation
    eval_samples: int = 256  # validation samples per evaluation, over all ranks
    checkpoint_every: int = 1000  # steps between checkpoints (and one at the end); 0: only on request
    keep_checkpoints: int = 3  # complete checkpoints kept; at least 2
    async_checkpoint: bool = False  # write checkpoints in the background after staging
    resume: str = "auto"  # auto: newest complete checkpoint of the run; none; or a checkpoint path
    log_samples: bool = False  # debugging: each rank writes its sample indices per step to logs/
    max_bad_steps: int = 3  # consecutive steps with a non-finite loss/grad norm skipped before stopping


@dataclass(frozen=True)
class ParallelConfig:
    # ddp: a full replica per rank; fsdp: parameters, gradients and optimizer state sharded over
    # all ranks; hsdp: sharded within groups of shard_size ranks, replicated across groups
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    shard_size: Optional[int] = None  # hsdp: ranks per shard group; None: the processes of one node
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on GPUs, gloo on CPUs
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (ZeRO-3)
    prefetch_layers: int = 1  # FSDP2: layers whose all-gather starts ahead of time; 0: FSDP2's implicit
    # fsdp/hsdp with accumulation: reduce-scatter gradients after every micro-batch, so a rank
    # only holds its gradient shard. false: once per step, but every rank then keeps all layers'
    # full fp32 gradients until the last micro-batch (+4 bytes per parameter per GPU: 32 GB at 8B)
    reduce_every_micro_batch: bool = True
    socket_ifname: Optional[str] = None  # network interface for NCCL/gloo (e.g. ib0)
    collective_timeout_s: int = 600  # a collective stuck this long ends the job, naming the rank
    startup_timeout_s: int = 1800  # building, loading weights, resuming and the first step


@dataclass(frozen=True)
class SlurmConfig:
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: Optional[int] = None  # default: gpus_per_node; set it on CPU-only nodes
    cpus_per_node: int = 8
    mem: str = "0"  # memory per node as sbatch --mem takes it; "0" is all of it
    time: str = "01:00:00"  # wall-time limit, HH:MM:SS or D-HH:MM:SS
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    extra_args: list = field(default_factory=list)  # further sbatch arguments, verbatim
    signal_lead_s: int = 120  # save and requeue this long before the time limit; 0: never
    max_requeues: int = 5  # requeues of one job after preemption/time limit, against crash loops
    max_restarts: int = 0  # torchrun restarts of failed workers within a job (they resume)
    preflight: bool = True  # a matmul and an all-reduce on every node before training (seconds)
    exclude_slow_nodes: bool = False  # a node the preflight finds slow: come back without it
    slow_node_ratio: float = 0.7  # slow: matmul below this x the other nodes' median
    prepare_cpus: Optional[int] = None  # the prepare job's CPUs; default: cpus_per_node
    prepare_time: Optional[str] = None  # the prepare job's time limit; default: from the corpus size


WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class WandbSpec:
    """metrics.wandb, parsed (tracking.py uses it)."""
    project: str = "llmtrain"
    entity: Optional[str] = None  # a W&B user or team; None: the API key's default entity
    mode: str = "offline"  # compute nodes are usually offline: sync from the login node
    name: Optional[str] = None  # the W&B run's display name; None: run.name
    tags: tuple = ()

    @classmethod
    def parse(cls, raw: dict | None) -> "WandbSpec | None":
        """metrics.wandb as written (None: no W&B; {}: the defaults); raises UserError."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise UserError(f"metrics.wandb: must be a mapping like {{project: my-project, mode: offline}} "
                            f"(got {raw!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"metrics.wandb.{unknown[0]}: unknown key{_did_you_mean(unknown[0], known)}; "
                            f"use {', '.join(sorted(known))}")
        for key in ("project", "entity", "name"):
            value = raw.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UserError(f"metrics.wandb.{key}: must be a non-empty string (got {value!r})")
        if raw.get("mode", "offline") not in WANDB_MODES:
            raise UserError(f"metrics.wandb.mode: must be one of {', '.join(WANDB_MODES)} "
                            f"(got {raw.get('mode')!r})")
        tags = raw.get("tags", ())
        if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
            raise UserError(f"metrics.wandb.tags: a list of strings (got {tags!r})")
        return cls(**{**raw, "tags": tuple(tags)})


@dataclass(frozen=True)
class MetricsConfig:
    """Where metrics go besides <run_dir>/metrics.jsonl (tracking.py)."""
    tensorboard: bool = False  # event files in <run_dir>/tensorboard, continued across resumes
    wandb: Optional[dict] = None  # {project, entity, mode, name, tags}: one W&B run across requeues
    plot_every_eval: bool = True  # redraw <run_dir>/plot.png at each evaluation (llmtrain plot)

    @property
    def wandb_spec(self) -> "WandbSpec | None":
        return WandbSpec.parse(self.wandb)

    @property
    def trackers(self) -> bool:
        """TensorBoard or W&B asked for."""
        return self.tensorboard or self.wandb is not None


@dataclass(frozen=True)
class ProfileConfig:
    """torch.profiler traces of a few steps (training/profiling.py); also on request:
    llmtrain control RUN_DIR profile."""
    start_step: Optional[int] = None  # the first profiled step; None: only on request
    steps: int = 3  # steps per trace
    # The ranks that trace: a list, one rank, or "all" (a trace is hundreds of MB: on 512 ranks,
    # every rank's would flood the shared filesystem). Checked by validate, read through rank_set.
    ranks: Any = (0,)
    memory_history: bool = False  # CUDA: record every allocation's stack, for the out-of-memory snapshot

    @property
    def rank_set(self) -> "tuple[int, ...] | str":
        return parse_ranks(self.ranks)


def parse_ranks(value: Any) -> "tuple[int, ...] | str":
    """profile.ranks or `llmtrain control ... --ranks` as written: "all", one rank, a list of
    ranks or a comma-separated string of them -> "all" or the sorted ranks; ValueError."""
    if isinstance(value, str):
        if value.strip() == "all":
            return "all"
        try:
            value = [int(v) for v in value.split(",")]
        except ValueError:
            value = None
    elif isinstance(value, int):
        value = [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ValueError("must be all or ranks >= 0")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class Config:
    run: RunConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig = ParallelConfig()
    slurm: SlurmConfig = SlurmConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    path: str = ""  # the file this was read from (not a key in it)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def world_size(self) -> int:
        """World size that the slurm section asks for."""
        return self.slurm.nodes * (self.slurm.procs_per_node or self.slurm.gpus_per_node or 1)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("path")
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "path"}
_SECTION_TYPES = typing.get_type_hints(Config)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike, overrides: list[str] = (),
                world_size: int | Literal["local"] | None = None) -> Config:
    """Read, override, type-check and cross-check a config file; raise ConfigError.
    world_size: the processes the run will have; None: what the slurm section asks for (a Slurm
    job); "local": a local run's default, slurm.procs_per_node, else 1."""
    path = Path(path)
    try:
        raw = load_yaml(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such config file"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: must be a mapping of sections (got {type(raw).__name__})"])
    problems: list[str] = []
    for item in overrides:
        _apply_override(raw, item, problems)
    cfg = _build(raw, path.resolve().parent, problems)
    if cfg is not None and not any(p.startswith("--set") or ": unknown section" in p for p in problems):
        cfg = dataclasses.replace(cfg, path=str(path.resolve()))
        written = {f"{section}.{key}": raw[section][key] for section, keys in _PATH_KEYS.items()
                   for key in keys if isinstance(raw.get(section), dict)
                   and isinstance(raw[section].get(key), str)}
        # A key with a wrong value is reported once: checks on the default standing in for it
        # (max_steps: 'ten' leaves max_steps None, "neither max_steps nor epochs") are noise.
        # So is the key a misspelt one meant (max_stepz for max_steps: "set max_steps or epochs").
        wrong = {q.split(":")[0] for q in problems} | {
            f"{q.split('.')[0]}.{m.group(1)}" for q in problems
            for m in [re.search(r"unknown key \(did you mean '(\w+)'\?\)", q)] if m}
        if world_size == "local":
            world_size = cfg.slurm.procs_per_node or 1
        problems += [q for q in validate(cfg, world_size, written) if q.split(":")[0] not in wrong]
    if problems:
        raise ConfigError(problems)
    return cfg


def _apply_override(raw: dict, item: str, problems: list[str]) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        problems.append(f"--set {item}: expected section.key=value")
        return
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    try:
        node[parts[-1]] = load_yaml(value) if value.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = value


def _build(raw: dict, base: Path, problems: list[str]) -> Config | None:
    sections = {}
    for name in raw:
        if name not in SECTIONS:
            problems.append(f"{name}: unknown section{_did_you_mean(name, SECTIONS)}")
    for name, cls in _SECTION_TYPES.items():
        if name == "path":
            continue
        body = raw.get(name, {})
        if body is None:
            body = {}
        if not isinstance(body, dict):
            problems.append(f"{name}: must be a mapping of keys (got {body!r})")
            body = {}
        sections[name] = _build_section(name, cls, body, base, problems)
    if any(s is None for s in sections.values()):
        return None
    return Config(**sections)


def _build_section(section: str, cls: type, body: dict, base: Path, problems: list[str]):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values, ok = {}, True
    for key in body:
        if key not in fields:  # reported; the section is still built, so the checks of the rest run
            hint = _OTHER_NAMES.get(f"{section}.{key}")
            problems.append(f"{section}.{key}: unknown key"
                            + (f" ({hint})" if hint else _did_you_mean(key, fields)))
    for name, f in fields.items():
        where = f"{section}.{name}"
        if name in body:
            try:
                value = _coerce(body[name], hints[name])
            except ValueError as e:
                problems.append(f"{where}: {e} (got {body[name]!r})")
                if f.default is _REQUIRED and f.default_factory is _REQUIRED:
                    ok = False
                # else: the default stands in, so cross-field checks still run on the rest
                continue
        elif f.default is not _REQUIRED:
            value = f.default
        elif f.default_factory is not _REQUIRED:
            value = f.default_factory()
        else:
            problems.append(f"{where}: required, no default")
            ok = False
            continue
        if isinstance(value, str) and name in _PATH_KEYS.get(section, ()) and value not in _NOT_PATHS:
            try:
                value = _expand(value, base, hub=where not in _ONLY_PATHS)
            except ValueError as e:
                problems.append(f"{where}: {e}")
                ok = False
                continue
        values[name] = value
    return cls(**values) if ok else None


def _coerce(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:  # a key of several shapes, checked in validate
        return value
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)))
    if origin is Literal:  # compared with the type too: 1 is not true, and true is not 1
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError("must be one of " + ", ".join(
                str(a).lower() if isinstance(a, bool) else str(a) for a in args))
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise ValueError("must be a number")
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ValueError("must be a number") from None
        if not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError("must be a string")
        return str(value)
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError("must be a mapping")
        return value
    if hint is list or origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of strings")
        return value
    raise TypeError(f"unsupported config type {hint}")  # a bug in this module, not in the file


# Other trainers' names (Hugging Face Trainer's, mostly) for what llmtrain calls otherwise: difflib
# finds no close key for most of them, or a misleading one (batch_size -> micro_batch_size).
_OTHER_NAMES = {
    "train.learning_rate": "did you mean 'lr'?",
    "train.num_train_epochs": "did you mean 'epochs'?",
    "train.max_grad_norm": "did you mean 'grad_clip'?",
    "train.adam_epsilon": "did you mean 'eps'?",
    "train.logging_steps": "did you mean 'log_every'?",
    "train.eval_steps": "did you mean 'eval_every'?",
    "train.save_steps": "did you mean 'checkpoint_every'?",
    "train.batch_size": "llmtrain's are global_batch_size and micro_batch_size",
    "train.gradient_accumulation_steps": "accumulation follows from global_batch_size / "
                                         "(micro_batch_size x world size)",
    "train.warmup_ratio": "llmtrain counts warmup in steps: warmup_steps",
    "train.gradient_checkpointing": "it is model.activation_checkpointing",
    "train.bf16": "set train.precision: bf16",
}


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Keys holding a filesystem path or a hub id; they are expanded at load time.
_PATH_KEYS = {
    "run": ("dir",),
    "model": ("name_or_path", "tokenizer"),
    "data": ("dataset", "validation", "prepared_dir", "prepared"),
    "train": ("resume",),
}
_NOT_PATHS = ("auto", "none")
# Path keys that are never a hub id: `runs` or `ckpt/step-00000100` is a folder next to the config.
_ONLY_PATHS = ("run.dir", "data.prepared_dir", "data.prepared", "train.resume")


def _expand(value: str, base: Path, hub: bool = True) -> str:
    """Expand ${VAR} and ~, and make a relative path absolute against the config folder
    (unless, where `hub`, it reads as a hub id: `org/name` that is not a local path)."""
    missing = [m for m in re.findall(r"\$\{(\w+)\}", value) if m not in os.environ]
    if missing:
        hint = " (source the env.sh that setup.sh wrote)" if HOME_VAR in missing else ""
        raise ValueError(f"environment variable {missing[0]} is not set{hint} (got {value!r})")
    value = os.path.expanduser(re.sub(r"\$\{(\w+)\}", lambda m: os.environ[m.group(1)], value))
    if os.path.isabs(value):
        return value
    local = base / value
    if not hub or value.startswith(("./", "../")) or local.exists() or not _HUB_ID.match(value):
        return str(local.resolve())
    return value  # a hub id


# ---------------------------------------------------------------------------------------------
# Cross-field checks


def validate(cfg: Config, world_size: int | None = None, written: dict | None = None) -> list[str]:
    """Problems that span keys or touch the filesystem; [] when the config is usable.
    world_size: the run's processes; None: the slurm section's (and its Slurm-only keys checked).
    written: path keys as the file (or --set) wrote them, for messages that show both forms."""
    p: list[str] = []
    t, d, m, s = cfg.train, cfg.data, cfg.model, cfg.slurm
    world = world_size or cfg.world_size

    _positive(p, "run", cfg.run, ["name"], text=True)
    if "/" in cfg.run.name or cfg.run.name in (".", ".."):
        p.append(f"run.name: must be a plain folder name, no '/' (got {cfg.run.name!r})")
    if (t.max_steps is None) == (t.epochs is None):
        got = "neither" if t.max_steps is None else f"max_steps {t.max_steps} and epochs {t.epochs}"
        p.append(f"train.max_steps: set exactly one of train.max_steps and train.epochs (got {got})")
    _positive(p, "train", t, [k for k in ("epochs", "global_batch_size", "micro_batch_size",
                                          "log_every", "eval_samples", "peak_tflops")
                              if getattr(t, k) is not None])
    if t.max_steps is not None and t.max_steps < 0:  # 0: start up, report memory, train nothing
        p.append(f"train.max_steps: must be >= 0 (got {t.max_steps})")
    _positive(p, "data", d, ["seq_len"])
    _positive(p, "model", m, ["activation_checkpointing_every"])
    _positive(p, "slurm", s, ["nodes", "cpus_per_node"])
    for key in ("lr", "eps"):
        if getattr(t, key) <= 0:
            p.append(f"train.{key}: must be > 0 (got {getattr(t, key)})")
    for key in ("min_lr", "weight_decay", "grad_clip"):
        if getattr(t, key) < 0:
            p.append(f"train.{key}: must be >= 0 (got {getattr(t, key)})")
    for key in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, key) < 0:
            p.append(f"train.{key}: must be >= 0 (got {getattr(t, key)})")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            p.append(f"train.{key}: must be in [0, 1) (got {getattr(t, key)})")
    if t.min_lr > t.lr > 0:
        p.append(f"train.min_lr: must be <= train.lr (got {t.min_lr} > {t.lr})")
    if t.max_steps is not None and t.max_steps > 0 and t.warmup_steps >= t.max_steps:
        p.append(f"train.warmup_steps: must be < train.max_steps (got {t.warmup_steps} >= {t.max_steps})")
    for key in ("collective_timeout_s", "startup_timeout_s"):
        if getattr(cfg.parallel, key) < 10:
            p.append(f"parallel.{key}: must be >= 10 (got {getattr(cfg.parallel, key)})")
    p += _check_parallel(cfg, world)
    if 0 < t.eval_samples < world and t.eval_every > 0:
        p.append(f"train.eval_samples: must be >= the world size {world}, so every rank evaluates "
                 f"at least one sample (got {t.eval_samples})")
    if t.max_bad_steps < 0:
        p.append(f"train.max_bad_steps: must be >= 0 (got {t.max_bad_steps})")
    for key in ("signal_lead_s", "max_requeues", "max_restarts"):
        if getattr(s, key) < 0:
            p.append(f"slurm.{key}: must be >= 0 (got {getattr(s, key)})")
    if not 0 < s.slow_node_ratio < 1:
        p.append(f"slurm.slow_node_ratio: must be in (0, 1) (got {s.slow_node_ratio})")
    if s.exclude_slow_nodes and not s.preflight:
        p.append("slurm.exclude_slow_nodes: needs slurm.preflight: true, which finds the slow nodes")
    if s.exclude_slow_nodes and s.max_requeues < 1:
        p.append("slurm.exclude_slow_nodes: the job comes back without a slow node as a requeue, and "
                 "slurm.max_requeues is 0; allow at least 1, or turn exclude_slow_nodes off")
    if t.optimizer not in OPTIMIZERS:
        p.append(f"train.optimizer: unknown {t.optimizer!r}; one of: {', '.join(OPTIMIZERS)}")
    if t.keep_checkpoints < 2:
        p.append(f"train.keep_checkpoints: must be >= 2, so a damaged newest checkpoint has a "
                 f"fallback (got {t.keep_checkpoints})")
    if t.resume not in _NOT_PATHS and not Path(t.resume).is_dir():
        p.append(f"train.resume: must be auto, none, or a checkpoint folder "
                 f"({_got('train.resume', t.resume, written)})")
    if not 0 <= d.holdout_fraction < 0.5:
        p.append(f"data.validation_fraction: must be in [0, 0.5) (got {d.validation_fraction})")
    if d.validation and d.validation_fraction:
        p.append(f"data.validation_fraction: set only one of data.validation and "
                 f"data.validation_fraction (got {d.validation!r} and {d.validation_fraction})")
    if t.eval_every > 0 and d.holdout_fraction == 0 and not d.validation:
        p.append("train.eval_every: evaluation needs data.validation or data.validation_fraction > 0, "
                 "or set eval_every: 0")
    if d.num_proc is not None and d.num_proc < 1:
        p.append(f"data.num_proc: must be >= 1 (got {d.num_proc})")
    if cfg.parallel.prefetch_layers < 0:
        p.append(f"parallel.prefetch_layers: must be >= 0 (got {cfg.parallel.prefetch_layers})")
    if d.document_masking and d.samples:
        p.append(f"data.document_masking: for data.format text (got format {d.format}, whose "
                 f"samples are always masked from each other)")
    if d.samples and d.text_unit != "line":
        p.append(f"data.text_unit: for data.format text only (got {d.text_unit} with format {d.format})")
    if d.prefetch_steps is not None and d.prefetch_steps < 0:
        p.append(f"data.prefetch_steps: must be >= 0 (got {d.prefetch_steps})")
    if s.gpus_per_node < 0:
        p.append(f"slurm.gpus_per_node: must be >= 0 (got {s.gpus_per_node})")
    if s.procs_per_node is not None and s.procs_per_node < 1:
        p.append(f"slurm.procs_per_node: must be >= 1 (got {s.procs_per_node})")
    # Slurm's tasks per node; a caller that gives the world size (a local run, the trainer under
    # its launcher, bench --nprocs, estimate/check-config --world-size) asks Slurm for nothing.
    if world_size is None and s.procs_per_node is None and s.gpus_per_node == 0:
        p.append("slurm.procs_per_node: set it on CPU-only nodes (slurm.gpus_per_node is 0)")
    if s.prepare_time is not None and not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", s.prepare_time):
        p.append(f"slurm.prepare_time: must be HH:MM:SS or D-HH:MM:SS, or null to estimate it from "
                 f"the corpus size (got {s.prepare_time!r})")
    if s.prepare_cpus is not None and s.prepare_cpus < 1:
        p.append(f"slurm.prepare_cpus: must be > 0, or null for slurm.cpus_per_node (got {s.prepare_cpus})")
    if not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", s.time):
        p.append(f"slurm.time: must be HH:MM:SS or D-HH:MM:SS (got {s.time!r})")
    elif 0 < s.signal_lead_s and slurm_seconds(s.time) <= 2 * s.signal_lead_s:
        p.append(f"slurm.time: each launch saves and stops at least slurm.signal_lead_s = "
                 f"{s.signal_lead_s} s before its end, which leaves too little of {s.time} to train; "
                 f"ask for more than {2 * s.signal_lead_s} s, or lower slurm.signal_lead_s")

    micro = t.micro_batch_size * world
    if micro > 0 and t.global_batch_size > 0 and t.global_batch_size % micro:
        p.append(
            f"train.global_batch_size: must be divisible by micro_batch_size x world size "
            f"= {t.micro_batch_size} x {world} = {micro} (got {t.global_batch_size})"
        )

    p += _check_tracking(cfg)
    p += _check_model(cfg, written)
    p += _check_attention(cfg)
    p += _check_resume(cfg)
    manifest = given_prepared(cfg)
    p += _check_prepared(cfg, manifest) if manifest else _check_data(d, Path(cfg.path).parent, written)
    return p


def _check_prepared(cfg: Config, manifest: dict) -> list[str]:
    """A prepared folder to train from (data.prepared) instead of the source: its tokenizer and
    its kind of data."""
    d, made, source = cfg.data, manifest.get("samples"), tokenizer_source(cfg)
    tok_dir = local_path(source, "models") if source else None
    made_with = manifest["tokenizer"].get("sha256")  # None: a folder from before it was recorded
    if made_with and tok_dir and (tok_dir / "tokenizer.json").exists() and tokenizer_sha256(tok_dir) != made_with:
        return [f"data.prepared: {d.prepared} was tokenized by {manifest['tokenizer']['path']}, another "
                f"tokenizer than this model's ({tok_dir}); set data.prepared: null to prepare the "
                f"data with this one"]
    if made is None and d.samples:
        return [f"data.prepared: {d.prepared} holds a text stream, not {d.format} samples; prepare "
                f"the samples (set data.prepared: null) or set data.format: text"]
    if made is not None and not d.samples:
        return [f"data.prepared: {d.prepared} holds fine-tuning samples, not a text stream "
                f"(got data.format text); set data.format to the samples' format"]
    if made is not None and made["seq_len"] != d.seq_len:
        return [f"data.seq_len: {d.prepared} holds samples in rows of {made['seq_len']} tokens "
                f"(got {d.seq_len}); set data.seq_len: {made['seq_len']}, or data.prepared: null "
                f"to prepare them again"]
    recorded, now = manifest.get("source", {}), source_record(cfg)
    differ = [f"{key} {recorded[key]!r} -> {now[key]!r}" for key in recorded if key in now and recorded[key] != now[key]]
    if differ:  # an option (a --set, a sweep's grid) the given folder was not made with
        return [f"data.prepared: {d.prepared} was prepared with other data options ({', '.join(differ)}); "
                f"set them as the folder has them, or data.prepared: null to prepare the data anew"]
    return []


def slurm_seconds(text: str) -> float:
    """Slurm's time: infinite/UNLIMITED, D-HH:MM:SS, D-HH, HH:MM:SS, MM:SS or MM."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return float("inf")
    days, _, rest = text.rpartition("-")
    fields = [int(x) for x in rest.split(":")]
    if days:
        fields += [0] * (3 - len(fields))  # D-HH, D-HH:MM
        h, m, s = fields
    else:
        h, m, s = ([0] * (3 - len(fields)) + fields) if len(fields) > 1 else (0, fields[0], 0)
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def _got(key: str, value: str, written: dict | None) -> str:
    """`got '/abs/x.txt'`, or for a path written otherwise (relative to the config's folder,
    ~, ${VAR}) both forms: `got './x.txt', resolved to /abs/x.txt`."""
    raw = (written or {}).get(key)
    if raw is None or raw == value:
        return f"got {value!r}"
    return f"got {raw!r}, resolved to {value}"


def _check_data(d: DataConfig, base: Path, written: dict | None = None) -> list[str]:
    """The dataset and validation sources, as far as their names and files tell."""
    p, files = [], {}
    for key in ("dataset", "validation"):
        value = getattr(d, key)
        if value is None or (key == "validation" and is_split_name(value)):
            continue
        if is_glob(value):
            files[key] = source_files(value)
            if not files[key]:
                p.append(f"data.{key}: no file matches the pattern "
                         f"({_got(f'data.{key}', value, written)})")
        elif key == "dataset" and is_hub_id(value):
            continue  # a hub id: download_data_model.sh fetches it, check-config notes it
        elif not Path(base, value).exists():  # relative: a missing path read as a hub id
            p.append(f"data.{key}: no such file or folder "
                     f"({_got(f'data.{key}', str(Path(base, value)), written)})")
        else:
            files[key] = source_files(value)
        other = [f.name for f in files.get(key) or [] if file_suffix(f) != ".txt"]
        if d.text_unit != "line" and other:
            p.append(f"data.text_unit: only for .txt files (got {d.text_unit} for {other[0]})")
        if files.get(key):
            p += _check_columns(files[key][0], d)
    if d.validation and is_split_name(d.validation):
        if files.get("dataset"):
            p.append(f"data.validation: a split name, but data.dataset is a file with no splits; "
                     f"give the validation file's path instead (got {d.validation!r})")
        elif d.validation == d.split:
            p.append(f"data.validation: must differ from data.split, or evaluation reads training "
                     f"documents (got {d.validation!r})")
    return p


def _check_columns(path: Path, d: DataConfig) -> list[str]:
    """The format's columns in the first record of a jsonl or csv file (plain or compressed): a
    wrong data.text_field (messages_field, ...) fails here, before any job is queued, not in the
    prepare job."""
    import bz2
    import csv
    import gzip
    import lzma
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    kind = file_suffix(path)
    if kind not in (".jsonl", ".csv"):
        return []  # txt has no columns; json, parquet and folders are checked by prepare
    try:
        # Bytes that are not UTF-8 are prepare's to name (file and line) or replace
        # (data.encoding_errors): here, only the first record's columns count.
        with opener(path, "rt", encoding="utf-8", errors="replace", newline="") as f:
            if kind == ".csv":
                columns = next(csv.reader(f), [])
                first = None
            else:
                line = next((x for x in f if x.strip()), "")
                first = json.loads(line) if line else None
                columns = list(first) if isinstance(first, dict) else []
    except (OSError, ValueError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
        return [f"data.dataset: cannot read {path} as {kind[1:]} ({type(e).__name__})"]
    for key, column in d.columns.items():
        if columns and column not in columns:
            return [f"data.{key}: no column {column!r} in {path} (columns: "
                    f"{', '.join(map(str, columns[:10]))})"]
        want = list if key == "messages_field" else str
        if isinstance(first, dict) and column in first and not isinstance(first[column], want):
            return [f"data.{key}: column {column!r} of {path} holds {type(first[column]).__name__}, "
                    f"not {'a list of messages' if want is list else 'text'}; choose a column of "
                    f"{'{role, content} lists' if want is list else 'strings'}"]
    return []


def _check_parallel(cfg: Config, world: int) -> list[str]:
    par = cfg.parallel
    if par.shard_size is not None and par.strategy != "hsdp":
        return [f"parallel.shard_size: only used with parallel.strategy: hsdp (got strategy "
                f"{par.strategy})"]
    if par.shard_size is None:  # the processes of one node, which always divide the world
        return []
    return ParallelDims.from_config(cfg, world).problems()


def _positive(p: list[str], section: str, obj, keys: list[str], text: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        if text and not str(value).strip():
            p.append(f"{section}.{key}: must not be empty")
        elif not text and value <= 0:
            p.append(f"{section}.{key}: must be > 0 (got {value})")


def _check_attention(cfg: Config) -> list[str]:
    """flash_attention_2 needs the flash-attn package: a job would fail on its first forward.
    And it keeps the samples (documents) of a packed row apart only in a batch of one row:
    transformers finds them from the position ids where the batch size is 1 (the varlen kernel;
    _is_packed_sequence in modeling_flash_attention_utils.py is False for any other), and
    otherwise attends causally over the whole row, across them."""
    import importlib.util
    d, t, p = cfg.data, cfg.train, []
    if cfg.model.attn_implementation != "flash_attention_2":
        return p
    if importlib.util.find_spec("flash_attn") is None:
        p.append("model.attn_implementation: flash_attention_2 needs the flash-attn package, which is "
                 "not installed in this environment; install it (pip install flash-attn) or use sdpa")
    packed = ("the samples packed in a row (data.packing)" if d.samples and d.packing else
              "the documents of a row (data.document_masking)" if not d.samples and d.document_masking
              else None)
    if packed and t.micro_batch_size > 1:
        p.append(f"model.attn_implementation: flash_attention_2 lets {packed} attend to each other "
                 f"when train.micro_batch_size > 1 (got {t.micro_batch_size}; it separates them only "
                 f"in batches of one row); set train.micro_batch_size: 1, or use sdpa")
    return p


def _check_tracking(cfg: Config) -> list[str]:
    """Tracking packages are optional extras: a config that asks for one must find it installed
    (here, on the login node, rather than an hour into the queue)."""
    import importlib.util

    p, mc, pc = [], cfg.metrics, cfg.profile
    try:
        wandb = mc.wandb_spec
    except UserError as e:
        p.append(str(e))
        wandb = None
    for key, wanted, package in (("tensorboard", mc.tensorboard, "tensorboard"),
                                 ("wandb", wandb is not None, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            p.append(f"metrics.{key}: the {package} package is not installed in this environment; "
                     f"install it with: pip install 'llmtrain[{package}]' (or bash setup.sh --extras "
                     f"{package}), or turn metrics.{key} off")
    if pc.start_step is not None and pc.start_step < 1:
        p.append(f"profile.start_step: must be >= 1 (got {pc.start_step})")
    if pc.steps < 1:
        p.append(f"profile.steps: must be >= 1 (got {pc.steps})")
    try:
        pc.rank_set
    except ValueError as e:
        p.append(f"profile.ranks: {e}, like [0, 8] (got {pc.ranks!r})")
    return p


def _check_resume(cfg: Config) -> list[str]:
    """The run's newest checkpoint must fit the config, or the job would be refused at start."""
    if cfg.train.resume != "auto":
        return []
    folder = cfg.run_dir / CHECKPOINTS
    pointer = latest_checkpoint(folder)
    try:
        meta = json.loads((folder / pointer / META).read_text()) if pointer else {}
    except (OSError, ValueError):
        return []  # no checkpoint yet (or a damaged one: the trainer falls back and says so)
    saved = meta.get("compat", {})
    now = {"seq_len": cfg.data.seq_len, "global_batch_size": cfg.train.global_batch_size,
           "lora": cfg.model.lora}
    fix = "use a new run.name, or set train.resume: none to start over"
    p = [f"train.resume: checkpoint {folder / pointer} does not match this config: {key} differs "
         f"({saved[key]!r} -> {value!r}); {fix}" for key, value in now.items()
         if key in saved and saved[key] != value]
    if "data_fingerprint" in saved:
        if manifest := given_prepared(cfg):
            now = manifest["fingerprint"]
        else:
            now = fingerprint(cfg) if on_disk(cfg.data.dataset, "datasets") else None
        if now not in (None, saved["data_fingerprint"]):
            p.append(f"train.resume: checkpoint {folder / pointer} was trained on other data (the "
                     f"dataset's files, the tokenizer or the data options changed); {fix}")
    return p


def _check_model(cfg: Config, written: dict | None = None) -> list[str]:
    m, p = cfg.model, []
    if m.lora is not None:
        try:
            LoraSpec.parse(m.lora)
        except UserError as e:
            p.append(str(e))
        if m.name_or_path is None:
            p.append("model.lora: adapters train on a pretrained model: set model.name_or_path "
                     "(got model.architecture, a model from scratch)")
    if (m.name_or_path is None) == (m.architecture is None):
        p.append("model.name_or_path: set exactly one of model.name_or_path (pretrained) "
                 "and model.architecture (from scratch)")
        return p
    if m.architecture is not None:
        if not isinstance(m.architecture.get("model_type"), str):
            p.append("model.architecture.model_type: required, e.g. llama (got "
                     f"{m.architecture.get('model_type')!r})")
        if m.tokenizer is None:
            p.append("model.tokenizer: required when training from model.architecture")
        model_cfg = m.architecture
    else:
        model_cfg = read_json(local_path(m.name_or_path, "models") / "config.json")
        if model_cfg is None and not is_hub_id(m.name_or_path):
            p.append(f"model.name_or_path: no Hugging Face model folder with a config.json "
                     f"({_got('model.name_or_path', m.name_or_path, written)})")

    tok_src = tokenizer_source(cfg)
    tok_file = local_path(tok_src, "models") / "tokenizer.json" if tok_src else None
    tok = read_json(tok_file) if tok_file else None
    if tok_src and tok is None and not is_hub_id(tok_src):
        key = "model.tokenizer" if m.tokenizer else "model.name_or_path"
        p.append(f"model.tokenizer: no fast tokenizer (tokenizer.json) in the folder "
                 f"({_got(key, tok_src, written)})")

    if model_cfg:
        max_pos = model_cfg.get("max_position_embeddings")
        if isinstance(max_pos, int) and cfg.data.seq_len > max_pos:
            p.append(f"data.seq_len: must be <= the model's max_position_embeddings "
                     f"(got {cfg.data.seq_len} > {max_pos})")
        vocab = model_cfg.get("vocab_size")
        if tok and isinstance(vocab, int) and tokenizer_vocab_size(tok) > vocab:
            p.append(f"model.tokenizer: vocabulary of {tokenizer_vocab_size(tok)} tokens does not fit "
                     f"the model's vocab_size {vocab}")
    return p


def tokenizer_vocab_size(tokenizer_json: dict) -> int:
    """len(tokenizer) computed from tokenizer.json: the model vocab plus added tokens."""
    vocab = tokenizer_json.get("model", {}).get("vocab", {})
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    return max(ids) + 1 if ids else 0


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
