"""Loading: YAML, --set overrides, types coerced and checked, paths expanded; then the rules
(rules.py) and the checks against the disk and the environment (environment.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ..data.sources import HOME_VAR
from ..files import load_yaml
from .environment import check_environment
from .rules import validate
from .schema import (_REQUIRED, _SECTION_TYPES, MIXTURE_OPTIONS, NOT_PATHS, SECTIONS, ZERO_STAGES, Config,
                     ConfigError, DataConfig, ParallelConfig, _did_you_mean)


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
        found = validate(cfg, world_size)
        found += [q for q in check_environment(cfg, written) if q.split(":")[0] not in {f.split(":")[0] for f in found}]
        problems += [q for q in found if q.split(":")[0] not in wrong]
    if problems:
        raise ConfigError(problems)
    return cfg


def overridden(path: str | os.PathLike, overrides: list[str]) -> dict:
    """A config file's YAML as a mapping with `overrides` (section.key=value) applied: what
    `llmtrain plan --apply` writes; load_config checks it."""
    raw = load_yaml(Path(path).read_text()) or {}
    problems: list[str] = []
    for item in overrides:
        _apply_override(raw, item, problems)
    if problems:
        raise ConfigError(problems)
    return raw


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
    body = raw.get("parallel")
    sections["parallel"] = _zero_stage(sections["parallel"], body if isinstance(body, dict) else {}, problems)
    return Config(**sections)


def _zero_stage(par: ParallelConfig, given: dict, problems: list[str]) -> ParallelConfig:
    """parallel.zero N sets the strategy (fsdp; hsdp stays) and stage N's FSDP2 keys. A key the
    config sets otherwise is refused rather than silently overridden: which of the two was meant?"""
    if par.zero is None:
        return par
    if par.zero not in ZERO_STAGES:
        problems.append(f"parallel.zero: must be 1, 2 or 3 (got {par.zero}); 3 shards the weights, gradients and "
                        f"optimizer state, 2 keeps the weights gathered through a layer's backward, 1 also reduces "
                        f"the gradients once a step")
        return par
    implied = {"strategy": "hsdp" if par.strategy == "hsdp" else "fsdp", **ZERO_STAGES[par.zero]}
    yaml_text = {True: "true", False: "false"}
    for key, value in implied.items():
        if key in given and getattr(par, key) != value:
            got = getattr(par, key)
            also = " (or hsdp)" if key == "strategy" else ""
            problems.append(f"parallel.{key}: parallel.zero {par.zero} sets it to {yaml_text.get(value, value)}{also} "
                            f"(got {yaml_text.get(got, got)}); remove one of the two")
    return dataclasses.replace(par, **implied)


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
        if where == "data.mixture":
            value = _build_mixture(value, base, problems)
        if isinstance(value, str) and name in _PATH_KEYS.get(section, ()) and value not in NOT_PATHS:
            try:
                value = _expand(value, base, hub=where not in _ONLY_PATHS)
            except ValueError as e:
                problems.append(f"{where}: {e}")
                ok = False
                continue
        values[name] = value
    return cls(**values) if ok else None


def _build_mixture(value: Any, base: Path, problems: list[str]) -> list[dict] | None:
    """data.mixture as written -> its entries, each option typed as its data.<key> and its paths
    expanded. An entry without dataset or weight is reported and kept (the indices in later
    lines stay the file's); DataConfig.sources leaves it out."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        problems.append(f"data.mixture: must be a list of sources like [{{dataset: a.jsonl, weight: 3}}, "
                        f"{{dataset: b.jsonl, weight: 1}}] (got {value!r})")
        return None
    hints, known = typing.get_type_hints(DataConfig), ("name", "weight", *MIXTURE_OPTIONS)
    entries = []
    for i, entry in enumerate(value):
        where, item = f"data.mixture[{i}]", {}
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be a mapping like {{dataset: a.jsonl, weight: 3}} (got {entry!r})")
            entry = {}
        for key, raw in entry.items():
            if key not in known:
                problems.append(f"{where}.{key}: unknown key{_did_you_mean(key, known)}; a source takes "
                                f"{', '.join(known)} (the other data keys are the data section's)")
                continue
            try:
                item[key] = _coerce(raw, {"name": str, "weight": float}.get(key) or hints[key])
                if isinstance(item[key], str) and key in _PATH_KEYS["data"]:
                    item[key] = _expand(item[key], base, hub=f"data.{key}" not in _ONLY_PATHS)
            except ValueError as e:
                problems.append(f"{where}.{key}: {e} (got {raw!r})")
                item.pop(key, None)
        problems += [f"{where}.{key}: required, no default" for key in ("dataset", "weight") if key not in entry]
        entries.append(item)
    return entries


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


# Keys holding a filesystem path or a hub id; they are expanded at load time.
_PATH_KEYS = {
    "run": ("dir",),
    "model": ("name_or_path", "tokenizer"),
    "data": ("dataset", "validation", "prepared_dir", "prepared"),
    "train": ("resume",),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
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
