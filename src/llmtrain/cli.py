"""The `llmtrain` command (also `python -m llmtrain`).

    llmtrain check-config FILE [--set section.key=value ...] [--world-size N] [--get KEY]
    llmtrain prepare --config FILE [--set ...]
    llmtrain train --config FILE [--set ...]          # usually under torchrun
    llmtrain export --run-dir DIR [--step N] --out DIR
    llmtrain generate (--model DIR | --run-dir DIR [--step N]) --prompt TEXT
    llmtrain status RUN_DIR|JOB_ID [--follow]
    llmtrain download [--config FILE] [--model ID] [--dataset ID] [--force] ...

User errors (a bad config, unprepared data, a missing model) print one line each on stderr
and exit non-zero; only bugs show a traceback. Torch is imported only by the commands that
need it, so check-config answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, UserError, load_config, local_path, tokenizer_source

EXIT_CONFIG = 2  # a config problem, as for a usage error
EXIT_USER = 1  # anything else the user can fix: data, model, paths


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        error_lines(e.problems)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        error_lines([f"error: {e}"])
        return EXIT_USER


def error_lines(lines: list[str]) -> None:
    """All lines in one write: ranks sharing a terminal never interleave half-lines."""
    os.write(sys.stderr.fileno(), "".join(f"{line}\n" for line in lines).encode())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llmtrain", description="Train Hugging Face causal LMs "
                                 "with DDP, FSDP2 or HSDP, on a laptop or a Slurm cluster.")
    sub = ap.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("check-config", help="validate a config without importing torch")
    p.add_argument("config")
    _overrides(p)
    p.add_argument("--world-size", type=int, help="check the batch split for this many "
                   "processes (default: slurm.nodes x slurm.procs_per_node)")
    p.add_argument("--get", metavar="KEY", action="append", help="print a resolved value "
                   "(run_dir, world_size, prepared_dir, prepared, or section.key) instead of a "
                   "summary; repeatable, one line each")
    p.add_argument("--offline", action="store_true", help="require the model, tokenizer and "
                   "dataset on disk (as a job on an offline compute node will)")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("prepare", help="tokenize and pack the dataset (idempotent)")
    p.add_argument("--config", required=True)
    _overrides(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train (under torchrun for several processes)")
    p.add_argument("--config", required=True)
    _overrides(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="complete a prompt with a trained model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model folder (e.g. from export)")
    src.add_argument("--run-dir", help="a run directory: its newest checkpoint, or --step")
    p.add_argument("--step", type=int)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("status", help="job state, progress, checkpoints and log of a run")
    p.add_argument("target", metavar="RUN_DIR|JOB_ID")
    p.add_argument("--follow", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between refreshes")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("control", help="ask a running job to save now, or to save and stop")
    p.add_argument("run_dir")
    p.add_argument("action", choices=["save", "stop"])
    p.set_defaults(func=cmd_control)

    p = sub.add_parser("download", help="fetch hub models/datasets into $LLMTRAIN_HOME (login node)")
    p.add_argument("--config", help="download the hub ids this config names")
    _overrides(p)
    p.add_argument("--model", help="model repo id (instead of the config's)")
    p.add_argument("--dataset", help="dataset repo id (instead of the config's)")
    p.add_argument("--revision", help="model revision: branch, tag or commit (default: main)")
    p.add_argument("--dataset-revision", help="dataset revision (default: main)")
    p.add_argument("--allow-pattern", action="append", dest="allow_patterns", metavar="GLOB",
                   help="only files matching (repeatable), e.g. '*.safetensors'")
    p.add_argument("--force", action="store_true", help="download again even if complete")
    p.set_defaults(func=cmd_download)
    return ap


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")


def cmd_check_config(args) -> int:
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    missing = [f"{what}: {source} is not downloaded yet (looked in {local_path(source, kind)}); "
               f"run: bash download_data_model.sh --config {args.config}"
               for source, kind, what in ((cfg.model.name_or_path, "models", "model.name_or_path"),
                                          (tokenizer_source(cfg), "models", "model.tokenizer"),
                                          (cfg.data.dataset, "datasets", "data.dataset"))
               if source and not local_path(source, kind).exists()]
    if args.offline and missing:
        raise ConfigError(list(dict.fromkeys(missing)))
    if args.get:
        print("\n".join(str(_get(cfg, key)) for key in args.get))
        return 0
    for line in dict.fromkeys(missing):
        print(f"note: {line}", file=sys.stderr)
    t = cfg.train
    print(f"{args.config}: OK — run {cfg.run.name!r}, {t.max_steps} steps of "
          f"{t.global_batch_size} x {cfg.data.seq_len} tokens, {cfg.parallel.strategy}, "
          f"{t.precision}; run_dir: {cfg.run_dir}")
    return 0


def _get(cfg, key: str):
    if key == "run_dir":
        return cfg.run_dir
    if key == "world_size":
        return cfg.world_size
    if key in ("prepared_dir", "prepared"):
        from .data import prepared_path, read_manifest
        path = prepared_path(cfg)
        return path if key == "prepared_dir" else ("yes" if read_manifest(path) else "no")
    section, _, name = key.partition(".")
    try:
        value = getattr(getattr(cfg, section), name)
    except AttributeError:
        raise ConfigError([f"--get {key}: no such key"]) from None
    if isinstance(value, list):
        return "\n".join(value)
    return "" if value is None else value


def cmd_prepare(args) -> int:
    cfg = load_config(args.config, args.overrides, world_size=1)
    from .prepare import prepare
    prepare(cfg)
    return 0


def cmd_train(args) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(args.config, args.overrides, world_size=world_size)
    from .train import train
    train(cfg)
    return 0


def cmd_export(args) -> int:
    from .export import export
    out = export(args.run_dir, args.out, args.step)
    print(f"exported: {out}")
    return 0


def cmd_generate(args) -> int:
    from .export import generate, load_checkpoint_model, load_folder
    if args.model:
        model, tokenizer = load_folder(args.model)
    else:
        model, tokenizer = load_checkpoint_model(args.run_dir, args.step)
    print(generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    return 0


def cmd_download(args) -> int:
    from .download import download, targets
    cfg = load_config(args.config, args.overrides, world_size=1) if args.config else None
    todo = targets(cfg, args.model, args.dataset)
    if not todo:
        raise UserError("nothing to download: the config names no hub ids (only local paths); "
                        "or pass --model / --dataset")
    for repo_type, repo_id in todo:
        revision = args.dataset_revision if repo_type == "dataset" else args.revision
        download(repo_type, repo_id, revision, args.allow_patterns, args.force)
    return 0


def cmd_control(args) -> int:
    from pathlib import Path
    if not (Path(args.run_dir) / "config.yaml").is_file():
        raise UserError(f"{args.run_dir}: not a run directory (no config.yaml)")
    from .control import request
    path = request(args.run_dir, args.action)
    print(f"{args.action} requested: {path} (acted on within seconds, at a step boundary)")
    return 0


def cmd_status(args) -> int:
    from .status import status
    status(args.target, args.follow, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
