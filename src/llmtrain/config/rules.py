"""Cross-field rules: what a config must satisfy whatever the disk holds (no file is read)."""

from __future__ import annotations

import re

from ..data.sources import mixture_name
from ..optimizers import OPTIMIZERS
from ..parallel.dims import ParallelDims
from .schema import Config


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# train.optimizer_args' keys: (what a value must be, its check); which optimizer takes which: OPTIMIZERS
OPTIMIZER_ARGS = {
    "betas": ("two numbers in [0, 1)",
              lambda v: isinstance(v, list) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v)),
    "momentum": ("a number in [0, 1)", lambda v: _number(v) and 0 <= v < 1),
    "ns_steps": ("a whole number >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "adamw_lr_scale": ("a number > 0", lambda v: _number(v) and v > 0),
}


def validate(cfg: Config, world_size: int | None = None) -> list[str]:
    """Problems of values and of keys together; [] when the config's values are usable.
    world_size: the run's processes; None: the slurm section's (and its Slurm-only keys checked)."""
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
    if t.router_aux_loss_coef is not None and t.router_aux_loss_coef < 0:
        p.append(f"train.router_aux_loss_coef: must be >= 0 or null, the model's (got {t.router_aux_loss_coef})")
    for key in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, key) < 0:
            p.append(f"train.{key}: must be >= 0 (got {getattr(t, key)})")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            p.append(f"train.{key}: must be in [0, 1) (got {getattr(t, key)})")
    if not 0 < t.decay_fraction <= 1:
        p.append(f"train.decay_fraction: must be in (0, 1] (got {t.decay_fraction})")
    elif t.lr_schedule == "wsd" and t.max_steps and t.warmup_steps > t.max_steps - round(t.decay_fraction * t.max_steps):
        p.append(f"train.decay_fraction: wsd's decay ({round(t.decay_fraction * t.max_steps)} of {t.max_steps} steps) "
                 f"would start inside the warmup ({t.warmup_steps} steps); lower one of them")
    if t.min_lr > t.lr > 0:
        p.append(f"train.min_lr: must be <= train.lr (got {t.min_lr} > {t.lr})")
    if t.max_steps is not None and t.max_steps > 0 and t.warmup_steps >= t.max_steps:
        p.append(f"train.warmup_steps: must be < train.max_steps (got {t.warmup_steps} >= {t.max_steps})")
    for key in ("collective_timeout_s", "startup_timeout_s"):
        if getattr(cfg.parallel, key) < 10:
            p.append(f"parallel.{key}: must be >= 10 (got {getattr(cfg.parallel, key)})")
    # a Slurm job's processes per node (a local run's are all on one machine)
    per_node = None if world_size else (s.procs_per_node or s.gpus_per_node or 1)
    dims = ParallelDims.from_config(cfg, world, per_node)  # the layout: its degrees and rules
    p += dims.problems()
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
    elif unknown := sorted(set(t.optimizer_args) - set(OPTIMIZERS[t.optimizer].args)):
        takes = ", ".join(OPTIMIZERS[t.optimizer].args)
        # AdamW's own settings are train keys (every optimizer's AdamW part reads them)
        p.append(f"train.optimizer_args: {t.optimizer} takes no {unknown[0]!r} " + (
            f"(takes: {takes})" if takes else "(it takes no optimizer_args: its settings are the train keys beta1 "
                                              "(the momentum), beta2, eps and weight_decay)"))
    else:
        p += [f"train.optimizer_args: {key} must be {what} (got {t.optimizer_args[key]!r})"
              for key, (what, ok) in OPTIMIZER_ARGS.items() if key in t.optimizer_args and not ok(t.optimizer_args[key])]
    if t.lr_schedule != "wsd" and t.decay_fraction != type(t).decay_fraction:  # the dataclass's default
        p.append(f"train.decay_fraction: only used with train.lr_schedule: wsd (got {t.decay_fraction} with "
                 f"{t.lr_schedule}); remove it, or set train.lr_schedule: wsd")
    if t.optimizer in OPTIMIZERS and (why := OPTIMIZERS[t.optimizer].constant_lr) and t.lr_schedule != "constant":
        p.append(f"train.lr_schedule: {t.optimizer} needs no decay ({why}): set constant, the warmup stays "
                 f"(got {t.lr_schedule})")
    if t.keep_checkpoints < 2:
        p.append(f"train.keep_checkpoints: must be >= 2, so a damaged newest checkpoint has a "
                 f"fallback (got {t.keep_checkpoints})")
    p += _check_mixture(d, t)
    for key, source in [(s.key, s.data) for s in d.sources]:  # data.dataset is a source of its own
        if not 0 <= source.holdout_fraction < 0.5:
            p.append(f"{key('validation_fraction')}: must be in [0, 0.5) (got {source.validation_fraction})")
        if source.validation and source.validation_fraction:
            p.append(f"{key('validation_fraction')}: set only one of {key('validation')} and "
                     f"{key('validation_fraction')} (got {source.validation!r} and {source.validation_fraction})")
    if t.eval_every > 0 and all(s.holdout_fraction == 0 and not s.validation for s in [d, *(s.data for s in d.sources)]):
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

    if t.fp8 != "none" and m.lora is not None:
        p.append(f"train.fp8: not with model.lora yet (FP8 trains whole models; an adapter's matmuls are too "
                 f"small to gain); set train.fp8: none (got {t.fp8})")
    return p + dims.config_problems(cfg)  # the batch's, the sequence's and the attention's shares


def _check_mixture(d, t) -> list[str]:
    """data.dataset or data.mixture, and a mixture's weights and names."""
    if (d.dataset is None) == (d.mixture is None):
        got = "neither" if d.dataset is None else "both"
        return [f"data.dataset: set exactly one of data.dataset and data.mixture (got {got})"]
    if d.mixture is None:
        return []
    p, names = [], {}
    for i, entry in enumerate(d.mixture):
        weight = entry.get("weight")
        if weight is not None and not 0 < weight < float("inf"):
            p.append(f"data.mixture[{i}].weight: must be > 0 (got {weight:g})")
        if "dataset" in entry:
            name = entry.get("name") or mixture_name(entry["dataset"])
            if name in names:
                p.append(f"data.mixture[{i}].name: {name!r} is data.mixture[{names[name]}]'s name too; names "
                         f"must be unique (a source without name: is named after its dataset; set one)")
            names.setdefault(name, i)
    if d.prepared:
        p.append("data.prepared: with data.mixture each source has its own; set data.mixture[i].prepared")
    if t.epochs is not None:
        p.append(f"train.epochs: not with data.mixture, whose sources each have their own epochs; set "
                 f"train.max_steps (got epochs {t.epochs})")
    return p


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



def _positive(p: list[str], section: str, obj, keys: list[str], text: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        if text and not str(value).strip():
            p.append(f"{section}.{key}: must not be empty")
        elif not text and value <= 0:
            p.append(f"{section}.{key}: must be > 0 (got {value})")
