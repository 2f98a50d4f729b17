"""The schema: one frozen dataclass per section of config.yaml, with each key's type and
default (the documentation of every key is the top-level config.yaml)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from ..data.sources import mixture_name
from ..errors import UserError


_REQUIRED = dataclasses.MISSING
# train.resume's values that are not a path.
NOT_PATHS = ("auto", "none")


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
    # csv, txt, arrow; jsonl/json/csv/txt also compressed: .gz, .bz2, .xz), or a downloaded hub id;
    # None: data.mixture names the sources
    dataset: Optional[str] = None
    # weighted sources instead of dataset: [{dataset, weight, name, and MIXTURE_OPTIONS}], each
    # prepared on its own; weights count tokens (text) or rows (fine-tuning). Parsed by load.py
    # into MixtureSource entries (`sources`), checked by rules.py
    mixture: Any = None
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
    def sources(self) -> "tuple[MixtureSource, ...]":
        """The sources the run reads, each with its own data section: data.mixture's (their
        dataset and options on this one's), or data.dataset as a mixture of one, this very
        section, unnamed (no per-source keys in metrics or checkpoints) and with its keys the
        data section's. Callers loop over them and never ask which kind they have."""
        if not self.mixture:
            return (MixtureSource(None, 1.0, self, None, {}),)
        out = []
        for index, entry in enumerate(self.mixture):
            if "dataset" not in entry or "weight" not in entry:  # reported by load.py
                continue
            options = {k: v for k, v in entry.items() if k in MIXTURE_OPTIONS}
            out.append(MixtureSource(entry.get("name") or mixture_name(entry["dataset"]), entry["weight"],
                                     dataclasses.replace(self, mixture=None, **{"prepared": None, **options}), index, entry))
        return tuple(out)

    def pinned(self, folders: list) -> dict:
        """The keys that name each source's prepared folder (`folders`, in source order), which
        llmtrain submit pins so that no job reads a source's files: data.prepared for data.dataset,
        each data.mixture entry's prepared for a mixture."""
        if not self.mixture:
            return {"prepared": str(folders[0])}
        return {"mixture": [{**s.entry, "prepared": str(folder)} for s, folder in zip(self.sources, folders)]}

    @property
    def holdout_fraction(self) -> float:
        """The share of the dataset's documents held out for evaluation, defaults applied."""
        if self.validation_fraction is not None:
            return self.validation_fraction
        return 0.0 if self.validation else 0.01


# What a data.mixture entry may set besides weight and name: the keys that say where a source's
# documents are and how to read them. The rest (format, seq_len, add_bos, packing, ...) is the
# data section's, alike for every source: a batch mixes them.
MIXTURE_OPTIONS = ("dataset", "split", "text_field", "messages_field", "prompt_field", "completion_field",
                   "text_unit", "encoding_errors", "validation", "validation_fraction", "prepared")


@dataclass(frozen=True)
class MixtureSource:
    """One entry of data.mixture: its name (default: its dataset's file or folder name), its
    weight as written, and the data section it is prepared and read with. data.dataset is one
    such source: no name, weight 1, the data section itself, no entry."""
    name: str | None
    weight: float
    data: DataConfig
    index: int | None  # its place in data.mixture, for messages: data.mixture[1].weight
    entry: dict  # the entry as written (typed, paths expanded)

    def key(self, key: str) -> str:
        """Where a data key of this source is set: data.mixture[i].<key> if the entry sets it,
        else the data section's (which it inherits)."""
        return f"data.mixture[{self.index}].{key}" if key in self.entry else f"data.{key}"


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int  # samples per optimizer step, over all ranks and micro-steps
    micro_batch_size: int  # samples per rank per forward/backward
    max_steps: Optional[int] = None  # optimizer steps; set this or epochs
    epochs: Optional[int] = None  # passes over the prepared samples; max_steps derived at start
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # learning rate at the end of the decay
    warmup_steps: int = 0  # linear warmup from 0 to lr
    # after warmup: cosine to min_lr; wsd: lr until the last decay_fraction of the steps, then
    # linear to min_lr (warmup-stable-decay); constant: lr
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of max_steps that decays
    optimizer: str = "adamw"  # a name in optimizers.OPTIMIZERS
    optimizer_args: dict = field(default_factory=dict)  # the optimizer's own settings, e.g. lion {betas: [0.9, 0.99]}
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on biases and norms)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # Mixture-of-Experts models: the load-balancing loss's weight (model/moe.py); None: the model's
    # config.json router_aux_loss_coef (0.001 Qwen3-MoE and Mixtral, 0.01 OLMoE); 0 turns it off
    router_aux_loss_coef: Optional[float] = None
    chunked_loss: bool = True  # the loss over chunks of tokens, never all logits at once (model/loss.py)
    compile: bool = False  # torch.compile each decoder layer and the loss's chunks (compiled in the first step)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    # the linear layers' matmuls in float8 (torchao): tensorwise or rowwise scales (parallel/float8.py)
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    tf32: bool = True  # fp32 matmuls on Ampere+ GPUs use TF32 tensor cores (about 1e-3 relative error)
    peak_tflops: Optional[float] = None  # one GPU's dense peak for MFU; None: the table (gpus.GPUS)
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


# parallel.zero N: the FSDP2 settings of ZeRO stage N (config/load.py sets them; one the user sets
# otherwise is refused, not overridden).
ZERO_STAGES = {3: {"reshard_after_forward": True, "reduce_every_micro_batch": True},
               2: {"reshard_after_forward": False, "reduce_every_micro_batch": True},
               1: {"reshard_after_forward": False, "reduce_every_micro_batch": False}}


@dataclass(frozen=True)
class ParallelConfig:
    # ddp: a full replica per rank; fsdp: parameters, gradients and optimizer state sharded over
    # all ranks; hsdp: sharded within groups of shard_size ranks, replicated across groups
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    # ZeRO's stages by name, as FSDP2 runs them (ZERO_STAGES): 3 = fsdp; 2 = weights kept gathered
    # from a layer's forward to its backward (reshard_after_forward: false); 1 = that, and the
    # gradients reduced once a step (reduce_every_micro_batch: false). The optimizer state is
    # sharded in all three, the weights between steps too. Sets those keys and strategy fsdp
    # (hsdp stays hsdp: the stage inside each shard group); None: the keys as given
    zero: Optional[int] = None
    shard_size: Optional[int] = None  # hsdp: ranks per shard group; None: one node's data-parallel ranks (>= 2)
    # tensor parallel: ranks (inside a node) that split each layer's matmuls by heads and features,
    # and hold a slice of the sequence between layers (sequence parallel); the data-parallel
    # degree is then world size / tp. Llama, Mistral, Qwen2, Qwen3; with fsdp or hsdp
    tp: int = 1
    # context parallel: ranks that each take 2 of 2 x cp chunks of every sequence (a head and a
    # tail chunk, so the causal work is even) and attend over the whole sequence's keys and values
    # (gathered); the data-parallel degree is world size / (tp x cp)
    cp: int = 1
    # pipeline parallel: stages of consecutive decoder layers (the embedding and the head count as
    # one layer each), one a rank, outermost in the layout (the data-parallel degree is then world
    # size / (pp x tp x cp)); a step's micro-batches (train.micro_batch_size each) flow through
    # them under pp_schedule: 1f1b (one forward, one backward: at most pp micro-batches' activations
    # in flight), gpipe (every forward, then every backward) or interleaved_1f1b (several stages a
    # rank). Llama, Mistral, Qwen2, Qwen3
    pp: int = 1
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b"
    # interleaved_1f1b: stages a rank holds (rank r: stages r, r + pp, ...; a smaller bubble for more
    # point-to-point sends); None: 2 for interleaved_1f1b, 1 for the others
    pp_stages_per_rank: Optional[int] = None
    # expert parallel: a Mixture-of-Experts layer's experts split over ep ranks of the shard group
    # (each holds num_experts / ep of them; tokens travel to their experts by all-to-all), sharded
    # by FSDP2 over the rest; fsdp or hsdp, with tp, cp and pp. Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE
    ep: int = 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on GPUs, gloo on CPUs
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (ZeRO-3)
    prefetch_layers: int = 1  # FSDP2: layers whose all-gather starts ahead of time; 0: FSDP2's implicit
    # fsdp/hsdp with accumulation: reduce-scatter gradients after every micro-batch, so a rank
    # only holds its gradient shard. false: once per step, but every rank then keeps all layers'
    # full fp32 gradients until the last micro-batch (+4 bytes per parameter per GPU: 32 GB at 8B)
    reduce_every_micro_batch: bool = True
    # ddp over slow links: gradients all-reduced in bf16 (half the bytes, rounded) or compressed by
    # PowerSGD at powersgd_rank (a few percent of the bytes, approximated, the error fed back);
    # neither is exact (parallel/compression.py)
    grad_compression: Literal["none", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 4
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

    def for_source(self, source: MixtureSource) -> "Config":
        """This config with one mixture source as its data: what prepares, fingerprints and reads it."""
        return dataclasses.replace(self, data=source.data)

    def source_configs(self) -> "list[Config]":
        """A config for each dataset the run reads (one per source: data.sources)."""
        return [self.for_source(s) for s in self.data.sources]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("path")
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "path"}
_SECTION_TYPES = typing.get_type_hints(Config)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
