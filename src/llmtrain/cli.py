"""The `llmtrain` command (also `python -m llmtrain`).

    llmtrain check-config --config FILE [--set section.key=value ...] [--world-size N] [--get KEY]
    llmtrain prepare --config FILE [--set ...]
    llmtrain train --config FILE [--set ...]          # usually under torchrun
    llmtrain estimate --config FILE [--set ...] [--world-size N] [--gpu-mem GIB]   # memory per GPU
    llmtrain plan --config FILE [--set ...] [--nodes N] [--gpus-per-node G] [--gpu NAME] [--no-fp8] [--apply OUT]
    llmtrain export --run-dir DIR [--step N] --out DIR [--dtype fp32|bf16|fp16]
    llmtrain generate (--model DIR | --run-dir DIR [--step N]) --prompt TEXT [--chat]
    llmtrain status RUN_DIR|JOB_ID|NAME [--config FILE] [--follow]   # NAME: a run in run.dir
    llmtrain control RUN_DIR save|stop|profile [--steps N] [--ranks 0,8|all]
    llmtrain download [--config FILE] [--model ID] [--dataset ID] [--config-only] [--force] ...
    llmtrain submit --config FILE [--set ...] [--dry-run | --local] [-- SBATCH ARGS]   # submit.sh
    llmtrain sweep --config FILE --grid SECTION.KEY=V,V ... [--local];  llmtrain sweep status DIR|NAME
    llmtrain bench --config FILE (--nprocs 1,2,4 | --nodes 1,2,4);  llmtrain plot RUN_DIR ...
    llmtrain --version

Plumbing, which the scripts run and `llmtrain --help` does not list:

    llmtrain sbatch-command prepare|train|continuation --config FILE --script PATH [...] [-- ARGS]
    llmtrain requeue RUN_DIR JOB_ID --config F --script S --restarts N --max-requeues M   # train.slurm

A config is always `--config FILE` (check-config also takes it as its one positional argument),
and `llmtrain COMMAND --help` shows every option with its default.

User errors (a bad config, unprepared data, a missing model) print one line each on stderr
and exit non-zero; only bugs show a traceback. Torch is imported only by the commands that
need it, so check-config answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import NoReturn

from .config import ConfigError, UserError, load_config, parse_ranks
from .errors import IN_ERROR_TXT, USER_ERROR, exit_process

EXIT_CONFIG = 2  # a config problem, as for a usage error
EXIT_USER = 1  # anything else the user can fix: data, model, paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_progress_bars()
    # check-config and sbatch-command take sbatch arguments after `--`, verbatim (they start
    # with dashes, which argparse would read as its own options).
    split = argv[:1] in (["check-config"], ["sbatch-command"], ["submit"], ["sweep"], ["requeue"]) \
        and "--" in argv
    sbatch_args = argv[argv.index("--") + 1:] if split else []
    if argv[:2] == ["sweep", "status"]:  # `llmtrain sweep status DIR` reads as it is typed
        argv = ["sweep-status", *argv[2:]]
    args = parser().parse_args(argv[:argv.index("--")] if split else argv)
    args.sbatch_args = sbatch_args
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


def quiet_progress_bars() -> None:
    """No progress bars' carriage returns where stderr is a Slurm .out file or a pipe. The
    variables are read once, as datasets and huggingface_hub load; where they have loaded already
    (a worker forked from its agent: training/workers.py) they are told."""
    if sys.stderr.isatty():
        return
    for var in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(var, "1")
    if "huggingface_hub" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "datasets" in sys.modules and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["datasets"].disable_progress_bars()


RANK0_GRACE_S = 3.0
RANK0_WAIT_S = 20.0


def entry() -> NoReturn:
    """The `llmtrain` command and `python -m llmtrain`."""
    code = main()
    rank = os.environ.get("RANK", "0")
    if code in (EXIT_USER, EXIT_CONFIG) and rank != "0":
        # Rank 0 records the run's user error (logs/error.txt); this rank, which failed the same
        # way, leaves once rank 0 has, or torchrun would stop rank 0 before it does when this one
        # is first (rank 0 may still be importing torch on a loaded node).
        if wait_for_rank0(_train_error_file):
            error_lines(_error_lines)  # again: the run's line is in logs/error.txt now
        else:  # rank 0 did not fail so: this rank's line is the run's, saying where
            import socket
            where = f"error: rank {rank} on {socket.gethostname()}: "
            own = [where + line.removeprefix("error: ") for line in _error_lines]
            with contextlib.suppress(OSError):
                from .files import write_atomic
                write_atomic(_train_error_file, "".join(f"{line}\n" for line in own))
            error_lines(own)
    exit_process(code)


_train_error_file = None  # the run's logs/error.txt, once cmd_train knows the run directory
_error_lines: list[str] = []  # this process's user error (error_lines)


def wait_for_rank0(error_file) -> bool:
    """Until rank 0 has written the run's error file (then a moment for it to record the line
    for torchrun), at most RANK0_WAIT_S: whether it did; RANK0_GRACE_S and True where there is
    no run directory to watch."""
    if error_file is None:
        time.sleep(RANK0_GRACE_S)
        return True
    deadline = time.monotonic() + RANK0_WAIT_S
    while not os.path.exists(error_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    return os.path.exists(error_file)


def error_lines(lines: list[str]) -> None:
    """All lines in one write: ranks sharing a terminal never interleave half-lines.

    Under torchrun no rank prints them: each records them in torchrun's error file, and
    llmtrain's agent (training/torchrun.py) prints them once, last, instead of torchrun's failure
    summary (which shows them, not a traceback, under a plain torchrun).
    """
    global _error_lines
    _error_lines = list(lines)
    text = "".join(f"{line}\n" for line in lines)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        os.write(sys.stderr.fileno(), text.encode())
        return
    import json
    message = {"message": text.rstrip(), "extraInfo": {"py_callstack": text.rstrip(),
                                                      "timestamp": str(int(time.time()))}}
    shown = _train_error_file is not None and os.path.exists(_train_error_file)
    try:
        with open(error_file, "w") as f:
            json.dump({"message": message, USER_ERROR: text, IN_ERROR_TXT: shown}, f)
    except OSError:
        os.write(sys.stderr.fileno(), text.encode())  # the agent will not find them


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: argparse's value, unless the help says it in
    words (a default of None means something, such as "the newest checkpoint")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.required:
            return text
        return super()._get_help_string(action)

    def add_argument(self, action):
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # argparse leaves out the commands'
            # own indent when it sizes the column, which wraps the longest command's line
            names = [len(sub.dest) for sub in action._get_subactions()]
            self._action_max_length = max(self._action_max_length, max(names, default=0)
                                          + self._current_indent + self._indent_increment)


class _Parser(argparse.ArgumentParser):
    """The parser of llmtrain and, through add_subparsers, of each command: help with defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


class _Version(argparse.Action):
    """--version from the installed package metadata: no torch import, so it answers at once."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata
        versions = []
        for name in ("llmtrain", "torch", "transformers"):
            try:
                versions.append(f"{name} {metadata.version(name)}")
            except metadata.PackageNotFoundError:
                versions.append(f"{name} (not installed)")
        print(f"{versions[0]} ({', '.join(versions[1:])}, python {sys.version.split()[0]})")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="llmtrain", description="Train Hugging Face causal LMs with DDP, FSDP2 or "
                 "HSDP, times tensor and context parallel, on a laptop or a Slurm cluster.", epilog="`llmtrain COMMAND --help` shows "
                 "a command's options and their defaults.")
    ap.add_argument("--version", action=_Version, help="print the versions of llmtrain, torch, "
                    "transformers and python, and exit")
    sub = ap.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("check-config", help="validate a config without importing torch")
    p.add_argument("file", nargs="?", metavar="FILE", help="the config, as --config FILE is")
    p.add_argument("--config", metavar="FILE", help="the config to check (this or FILE: required)")
    _overrides(p)
    p.add_argument("--world-size", type=int, help="check the batch split for this many "
                   "processes (default: slurm.nodes x slurm.procs_per_node)")
    p.add_argument("--get", metavar="KEY", action="append", help="print a resolved value "
                   "(run_dir, world_size, prepared_dir, prepared, or section.key) instead of a "
                   "summary; repeatable, one line each (default: the summary)")
    p.add_argument("--offline", action="store_true", help="require the model, tokenizer and "
                   "dataset on disk (as a job on an offline compute node will)")
    p.add_argument("--launch", action="store_true", help="also refuse a run that is running or "
                   "queued now (a second launch would find it locked): submit.sh's check")
    p.add_argument("--cluster", action="store_true", help="also refuse a Slurm request the cluster "
                   "can never meet (partition, nodes, CPUs, GPUs, memory, time; from sinfo): "
                   "submit.sh's check")
    p.add_argument("--freeze", metavar="FILE", help="also write the resolved config (overrides "
                   "applied, paths absolute, sbatch arguments after -- added to slurm.extra_args) "
                   "to FILE, for a job to train from (default: none)")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("submit", help="validate a run and queue it on Slurm (what submit.sh runs), "
                       "or train it here with --local; sbatch arguments after --")
    _config(p)
    _overrides(p)
    p.add_argument("--dependency", metavar="SPEC", help="sbatch --dependency of the first job, "
                   "e.g. afterok:123 (default: none)")
    _launch(p, dry_run="print the sbatch command line(s) and the memory estimate; submit nothing",
            local="train on this machine under torchrun instead of Slurm",
            nproc="--local: processes to start")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("sweep", help="one run per point of a grid: a Slurm job array with at "
                       "most --max-parallel points at once, or one after another with --local; "
                       "`llmtrain sweep status SWEEP_DIR`: each point's state, step and eval loss")
    _config(p)
    _overrides(p)
    p.add_argument("--grid", action="append", default=[], required=True, metavar="SECTION.KEY=V,V",
                   help="a key and its values, e.g. train.lr=1e-4,3e-4; several: their product "
                   "(required, repeatable)")
    p.add_argument("--max-parallel", type=int, default=4, help="points Slurm runs at once (the "
                   "array's %%limit)")
    _launch(p, dry_run="print the sbatch command line(s); submit nothing",
            local="train the points here, one after another", nproc="--local: processes per point")
    p.set_defaults(func=cmd_sweep)

    # Not listed apart from sweep (no help=): `llmtrain sweep status` is main's spelling of it.
    p = sub.add_parser("sweep-status", prog="llmtrain sweep status", description="each point's "
                       "state, step and latest eval loss")
    p.add_argument("sweep_dir", metavar="SWEEP_DIR|NAME", help="<run.dir>/<run.name>-sweep, as "
                   "llmtrain sweep printed, or the sweep's run.name")
    _runs(p)
    p.set_defaults(func=cmd_sweep_status)

    # Plumbing, run by submit.sh's and train.slurm's code, not listed in `llmtrain --help`
    # (a parser added without help= is not); its own --help still describes it.
    p = sub.add_parser("sbatch-command", description="print the sbatch command line of a run's "
                       "job, NUL-separated (--shell: quoted, for reading); no torch")
    p.add_argument("job", choices=["prepare", "train", "continuation"], help="prepare: tokenize "
                   "on one CPU node; train: the training job; continuation: train again after "
                   "the job --after names ends, where requeue is refused")
    _config(p)
    _overrides(p)
    p.add_argument("--script", required=True, help="the batch script, train.slurm (required)")
    p.add_argument("--frozen", help="the config file the job reads (default: --config itself)")
    p.add_argument("--after", metavar="JOB_ID", help="the job this one waits for: the prepare "
                   "job (train), the job that ends first (continuation) (default: none)")
    p.add_argument("--dependency", metavar="SPEC", help="the user's sbatch --dependency for the "
                   "first job (default: none)")
    p.add_argument("--continuation", type=int, default=int(os.environ.get("LLMTRAIN_CONTINUATION", 0)),
                   help="continuation jobs before this one (default: $LLMTRAIN_CONTINUATION or 0)")
    p.add_argument("--shell", action="store_true", help="print the line shell-quoted instead")
    p.set_defaults(func=cmd_sbatch_command)

    p = sub.add_parser("requeue", description="after a job's step (train.slurm): requeue it if "
                       "its trainer asked and slurm.max_requeues allows, else a continuation job; "
                       "arguments after -- go to the continuation's batch script")
    p.add_argument("run_dir", help="the run's directory")
    p.add_argument("job_id", help="this job's id ($SLURM_JOB_ID)")
    p.add_argument("--config", required=True, metavar="FILE", help="the frozen config the job "
                   "trains from; a continuation trains from it too (required)")
    p.add_argument("--script", required=True, help="the batch script, train.slurm (required)")
    p.add_argument("--restarts", type=int, required=True, help="requeues and continuations so "
                   "far (required)")
    p.add_argument("--max-requeues", type=int, required=True, help="slurm.max_requeues (required)")
    p.add_argument("--continuation", type=int, default=int(os.environ.get("LLMTRAIN_CONTINUATION", 0)),
                   help="continuation jobs before this one (default: $LLMTRAIN_CONTINUATION or 0)")
    p.set_defaults(func=cmd_requeue)

    p = sub.add_parser("prepare", help="tokenize and pack the dataset (idempotent)")
    _config(p)
    _overrides(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train (under torchrun for several processes)")
    _config(p)
    _overrides(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder, for use "
                       "(KV cache on, generation_config.json, readable by the group)")
    p.add_argument("--run-dir", required=True, help="the run directory (required)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="a new or empty folder (required)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="weights as saved; fp32 is the trained weights bit for bit, bf16 half the "
                   "size and what serving usually loads")
    p.add_argument("--merge", action="store_true", help="LoRA runs: the adapters folded into the "
                   "base model's weights, a plain model folder (default: the adapters alone, as "
                   "peft loads them)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="complete a prompt with a trained model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model folder, e.g. from export (required: "
                     "this or --run-dir)")
    src.add_argument("--run-dir", help="a run directory (required: this or --model)")
    p.add_argument("--step", type=int, help="with --run-dir: the checkpoint step (default: the "
                   "newest complete one)")
    p.add_argument("--prompt", required=True, help="the text to complete (required); with --chat, "
                   "the user's message")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the "
                   "tokenizer's chat template and print the assistant's reply alone")
    p.add_argument("--max-new-tokens", type=int, help="tokens to generate at most (default: the "
                   "model's generation_config.json)")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0: greedy (default: "
                   "the model's generation_config.json)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("status", help="whether a run is running, pending, stopped, finished or "
                       "failed; its progress, checkpoints and log")
    p.add_argument("target", metavar="RUN_DIR|JOB_ID|NAME", help="a run directory, a Slurm job "
                   "id (pending, running, or finished within Slurm's MinJobAge), or a run.name")
    _runs(p)
    p.add_argument("--follow", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between refreshes "
                   "(default: 10)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("control", help="ask a running job to save now, to save and stop, or to "
                       "profile a few steps (refused, exit 1, for a run that is not running)")
    p.add_argument("run_dir", help="the run's directory, <run.dir>/<run.name>")
    p.add_argument("action", choices=["save", "stop", "profile"], help="save: checkpoint now and go "
                   "on; stop: checkpoint and end (not requeued); profile: a torch.profiler trace of "
                   "the next steps, into RUN_DIR/profile")
    p.add_argument("--steps", type=int, default=3, help="profile: how many steps (default: 3)")
    p.add_argument("--ranks", help="profile: the ranks that trace, like 0,8, or all (default: "
                   "the config's profile.ranks, rank 0 unless set)")
    p.set_defaults(func=cmd_control)

    p = sub.add_parser("plot", help="draw runs' loss, eval loss, learning rate, tokens/s, MFU, "
                       "memory and gradient norm into one PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: "
                   "compared on one figure)")
    p.add_argument("--out", metavar="FILE.png", help="the image (default: RUN_DIR/plot.png for one "
                   "run, runs.png in the current folder for several)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("bench", help="the config's run on 1, 2, ... processes of this machine (or, "
                       "with --nodes, Slurm jobs on 1, 2, ... nodes), a few steps each: a markdown "
                       "table of tokens/s, memory and scaling efficiency")
    _config(p)
    _overrides(p)
    p.add_argument("--nprocs", default="1,2", help="process counts, comma-separated (default: 1,2)")
    p.add_argument("--nodes", help="node counts instead, comma-separated: Slurm jobs of "
                   "slurm.procs_per_node processes a node, one after another (default: none: local)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing "
                   "(default: 3)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("estimate", help="the memory a run needs per GPU (parameters, gradients, "
                       "optimizer, activations, loss, buffers) and whether it fits, before queueing it")
    _config(p)
    _overrides(p)
    p.add_argument("--world-size", type=int, help="GPUs to estimate for (default: slurm.nodes x "
                   "slurm.procs_per_node)")
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="one GPU's memory in GiB, for the "
                   "verdict (default: the GPU named in slurm.extra_args or partition, else none)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("plan", help="every layout that fits the cluster's GPUs, ranked by the step time "
                       "a cost model predicts; the best's --set arguments (doc/overview.md, 'Choosing a layout')")
    _config(p)
    _overrides(p)
    p.add_argument("--nodes", type=int, help="nodes to plan for (default: slurm.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs a node (default: slurm.procs_per_node, else "
                   "slurm.gpus_per_node)")
    p.add_argument("--gpu", help="the GPU (h100, h200, b200, a100-80gb, ...; default: the one named in "
                   "slurm.extra_args, partition or qos)")
    p.add_argument("--top", type=int, default=5, help="layouts shown (default: 5)")
    p.add_argument("--no-fp8", action="store_true", help="leave FP8 out (it needs the fp8 extra, torchao; "
                   "default: FP8 where the GPU has it)")
    p.add_argument("--apply", metavar="OUT", help="write the config with the best layout to OUT (checked "
                   "as check-config does; default: write nothing)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("download", help="fetch hub models/datasets into $LLMTRAIN_HOME (login node)")
    p.add_argument("--config", metavar="FILE", help="download the hub ids this config names "
                   "(default: none; then --model or --dataset)")
    _overrides(p)
    p.add_argument("--model", help="model repo id (default: the config's model.name_or_path "
                   "and model.tokenizer)")
    p.add_argument("--dataset", help="dataset repo id (default: the config's data.dataset)")
    p.add_argument("--revision", help="model revision: branch, tag or commit (default: main)")
    p.add_argument("--dataset-revision", help="dataset revision (default: main)")
    p.add_argument("--allow-pattern", action="append", dest="allow_patterns", metavar="GLOB",
                   help="only the model's files matching (repeatable), e.g. '*.safetensors' "
                   "(default: all)")
    p.add_argument("--dataset-allow-pattern", action="append", dest="dataset_allow_patterns",
                   metavar="GLOB", help="only the dataset's files matching (repeatable), e.g. "
                   "'data/train-*' (default: all)")
    p.add_argument("--config-only", action="store_true", help="only the model's config and "
                   "tokenizer files (megabytes), no weights and no dataset: all `llmtrain estimate` "
                   "reads")
    p.add_argument("--force", action="store_true", help="download again even if complete")
    p.set_defaults(func=cmd_download)
    return ap


def _launch(p: argparse.ArgumentParser, dry_run: str, local: str, nproc: str) -> None:
    """The options of the commands that queue jobs or train here instead: submit and sweep."""
    p.add_argument("--dry-run", action="store_true", help=dry_run)
    p.add_argument("--local", action="store_true", help=local)
    p.add_argument("--nproc", type=int, help=f"{nproc} (default: slurm.procs_per_node, else 1)")
    p.add_argument("--script", help="the batch script (default: $LLMTRAIN_REPO/train.slurm)")


def _runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="a NAME is a run in this config's run.dir "
                   "(default: run.dir's default, $LLMTRAIN_HOME/runs)")


def _runs_dir(args):
    """The run.dir of status's --config, where a run's name is looked up (None: the default)."""
    if not args.config:
        return None
    from pathlib import Path
    return Path(load_config(args.config, world_size=1).run.dir)  # its run.dir, not its Slurm keys


def _config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="the run's config file; "
                   "relative paths in it are relative to its folder (required)")


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a config value (repeatable; "
                   "default: none)")


def cmd_check_config(args) -> int:
    if (args.file is None) == (args.config is None):
        got = "neither" if args.file is None else f"FILE {args.file} and --config {args.config}"
        raise ConfigError([f"check-config: give the config once, as --config FILE or FILE "
                           f"(got {got})"])
    args.config = args.config or args.file
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    from .login.submit import freeze, refusals
    missing = refusals(cfg, args.config, offline=args.offline, launch=args.launch, cluster=args.cluster)
    if args.freeze:  # what was validated is what runs: the job reads this file, not the original
        from pathlib import Path

        from .login.slurm import with_extra_args
        freeze(with_extra_args(cfg, args.sbatch_args), Path(args.freeze), args.config)
    if args.get:
        print("\n".join(str(_get(cfg, key)) for key in args.get))
        return 0
    for line in missing:
        print(f"note: {line}", file=sys.stderr)
    from .metrics import plural
    t = cfg.train
    length = f"{t.max_steps} steps" if t.max_steps is not None else plural(t.epochs, "epoch")
    from .parallel.dims import ParallelDims, layout_name
    par = cfg.parallel  # hsdp's shard group stated, the default's too (a node's data-parallel ranks)
    shard = ParallelDims.from_config(cfg, args.world_size or cfg.world_size).shard if par.strategy == "hsdp" else 0
    layout = layout_name(par.strategy, par.tp, par.cp, shard, par.pp, par.pp_schedule, par.ep, par.zero)
    print(f"{args.config}: OK — run {cfg.run.name!r}, {length} of "
          f"{t.global_batch_size} x {cfg.data.seq_len} tokens, {layout}, "
          f"{t.precision}; run_dir: {cfg.run_dir}")
    for line in ParallelDims.from_config(cfg, args.world_size or cfg.world_size).pipeline_warnings(cfg):
        print(line)
    return 0


def _get(cfg, key: str):
    if key == "run_dir":
        return cfg.run_dir
    if key == "world_size":
        return cfg.world_size
    if key == "prepared_dir":
        from .data.sources import prepared_path
        return "\n".join(str(prepared_path(one)) for one in cfg.source_configs())
    if key == "prepared":
        from .login.submit import is_prepared
        return "yes" if is_prepared(cfg) else "no"
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
    from .data.prepare import prepare
    for one in cfg.source_configs():  # a mixture's sources one by one
        prepare(one)
    return 0


def without_torchao() -> None:
    """Keep torchao out of this process. transformers imports it with its modeling code wherever
    it is installed (0.2 s of every start, and on a CPU node four lines of warnings about its CUDA
    kernels), and only train.fp8 uses it: a None in sys.modules makes find_spec, which transformers
    asks, answer None (and `import torchao` fail). Called before transformers' modeling imports."""
    sys.modules.setdefault("torchao", None)


def cmd_train(args) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(args.config, args.overrides, world_size=world_size)
    if cfg.train.fp8 == "none":
        without_torchao()
    from .training.loop import train
    try:
        train(cfg)
    except UserError as e:  # for train.slurm, submit.sh --local and status: the line to show last
        from .rundir import RunPaths
        from .files import write_atomic
        global _train_error_file
        _train_error_file = RunPaths(cfg.run_dir).error
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike; the others wait for it
            try:
                _train_error_file.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(_train_error_file, "".join(
                    f"{line}\n" for line in (e.problems if isinstance(e, ConfigError) else [f"error: {e}"])))
            except OSError:
                pass
        raise
    return 0


def cmd_export(args) -> int:
    without_torchao()  # plain weights, whatever the run trained with
    from .training.export import export
    out = export(args.run_dir, args.out, args.step, args.dtype, args.merge)
    what = "adapter" if os.path.exists(os.path.join(out, "adapter_config.json")) else "weights"
    print(f"exported: {out} ({args.dtype} {what})")
    return 0


def cmd_generate(args) -> int:
    without_torchao()
    from .training.export import generate, load_checkpoint_model, load_folder
    if args.model:
        model, tokenizer = load_folder(args.model)
    else:
        model, tokenizer = load_checkpoint_model(args.run_dir, args.step)
    print(generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.seed,
                   chat=args.chat))
    return 0


def cmd_submit(args) -> int:
    from .login import submit
    if args.local:
        return submit.run_local(args.config, args.overrides, args.nproc)
    job = submit.submit(args.config, args.overrides, dependency=args.dependency,
                        sbatch_args=args.sbatch_args, dry_run=args.dry_run, script=args.script)
    if args.dry_run:
        import shlex
        print("\n".join(shlex.join(cmd) for cmd in job.commands))
    print("\n".join(submit.submitted_lines(job)), flush=True)
    if args.dry_run:  # what one GPU will need, before anything waits in the queue
        from .login.estimate import report
        from .login.slurm import with_extra_args
        try:
            cfg = with_extra_args(load_config(args.config, args.overrides), args.sbatch_args)
            print("memory estimate (llmtrain estimate):\n" + "\n".join(f"  {line}" for line in report(cfg)[0]))
        except Exception as e:  # noqa: BLE001 -- the dry run's answer stands without it
            print(f"memory estimate: not available ({e})")
            return 0
        from .login.plan import gpu_in, verdict
        try:
            gpu = gpu_in(None, cfg)
        except UserError:
            print("planner: the slurm section names no GPU it knows (--gres=gpu:h100:8, a partition); "
                  "`llmtrain plan --gpu NAME` plans for one")
            return 0
        try:
            print(f"planner (llmtrain plan): {verdict(cfg, gpu)}")
        except Exception as e:  # noqa: BLE001 -- as the estimate's
            print(f"planner: not available ({e})")
    return 0


def cmd_sweep(args) -> int:
    from .login import sweep
    if args.local and args.dry_run:
        raise UserError("--dry-run: prints the sbatch lines of a Slurm sweep; a --local sweep has none")
    if args.local:
        done, codes = sweep.sweep_local(args.config, args.overrides, args.grid, args.nproc)
    else:
        done = sweep.sweep_slurm(args.config, args.overrides, args.grid, max_parallel=args.max_parallel,
                                 sbatch_args=args.sbatch_args, dry_run=args.dry_run, script=args.script)
        codes = []
    if args.dry_run:
        import shlex
        print("\n".join(shlex.join(cmd) for cmd in done.commands))
        return 0
    for job_id in done.prepare_job_ids:
        print(f"prepare_job_id: {job_id} (tokenizes the data on one node; the array waits for it)")
    if done.array_job_id:
        print(f"array_job_id: {done.array_job_id} ({len(done.points)} points, at most "
              f"{args.max_parallel} at once)")
    print(f"sweep_dir: {done.dir}")
    print(sweep.status_table(done))
    if not args.local:
        print(f"watch: llmtrain sweep status {done.dir}; squeue -r -j {done.array_job_id}")
    failed = [str(p["index"]) for p, code in zip(done.points, codes) if code]
    if failed:
        error_lines([f"error: sweep {done.name}: point(s) {', '.join(failed)} failed; see their "
                     f"run directories (above)"])
        return EXIT_USER
    return 0


def cmd_sweep_status(args) -> int:
    from .login.sweep import read_sweep, status_table
    print(status_table(read_sweep(args.sweep_dir, _runs_dir(args))))
    return 0


def cmd_sbatch_command(args) -> int:
    import shlex
    from pathlib import Path

    from .login.slurm import continuation_command, sbatch_command, with_extra_args
    home = _home()
    cfg = with_extra_args(load_config(args.config, args.overrides), args.sbatch_args)
    frozen = Path(args.frozen or args.config)
    if args.job == "continuation":
        if not args.after:
            raise UserError("--after: a continuation job waits for the job it continues; give its id")
        cmd = continuation_command(cfg, args.after, script=Path(args.script), frozen=frozen, home=home,
                                   continuation=args.continuation)
    else:
        cmd = sbatch_command(cfg, args.job, script=Path(args.script), frozen=frozen, home=home,
                             after=args.after, dependency=args.dependency, continuation=args.continuation)
    if args.shell:
        print(shlex.join(cmd))
    else:
        sys.stdout.write("".join(f"{word}\0" for word in cmd))
    return 0


def _home() -> str:
    home = os.environ.get("LLMTRAIN_HOME")
    if not home:
        raise UserError("LLMTRAIN_HOME is not set; source the env.sh that setup.sh wrote")
    return home


def cmd_requeue(args) -> int:
    from pathlib import Path

    from .login.slurm import come_back
    return come_back(Path(args.run_dir), args.job_id, args.restarts, args.max_requeues,
                     config=Path(args.config), script=Path(args.script), home=_home(),
                     continuation=args.continuation, script_args=args.sbatch_args)


def cmd_download(args) -> int:
    from .login.download import download, targets
    given = [flag for flag, value in (("--dataset", args.dataset), ("--allow-pattern", args.allow_patterns),
                                      ("--dataset-allow-pattern", args.dataset_allow_patterns)) if value]
    if args.config_only and given:
        raise UserError(f"--config-only: not with {given[0]} (it fetches the model's config and "
                        f"tokenizer files alone); drop one of them")
    # Checked for the world size its slurm section asks for, as check-config does (for 1 process,
    # configs/llama3-70b.yaml's tp 8 was refused: its download could not start).
    cfg = load_config(args.config, args.overrides) if args.config else None
    todo = targets(cfg, args.model, args.dataset, datasets=not args.config_only)
    if not todo:
        raise UserError("nothing to download: the config names no hub ids (only local paths); "
                        "or pass --model / --dataset")
    for repo_type, repo_id in todo:
        revision, patterns = ((args.dataset_revision, args.dataset_allow_patterns) if repo_type == "dataset"
                              else (args.revision, args.allow_patterns))
        download(repo_type, repo_id, revision, patterns, args.force, config_only=args.config_only)
    return 0


def cmd_control(args) -> int:
    from .login.control import request
    if args.action == "profile" and args.steps < 1:
        raise UserError(f"--steps: must be >= 1 (got {args.steps})")
    reason = str(args.steps) if args.action == "profile" else "user"
    if args.ranks is not None:  # profile's switch text becomes `STEPS RANKS` (control._take_profile)
        if args.action != "profile":
            raise UserError(f"--ranks: only for profile (got {args.action} --ranks {args.ranks})")
        try:
            ranks = parse_ranks(args.ranks)
        except ValueError as e:
            raise UserError(f"--ranks: {e}, like 0,8 (got {args.ranks!r})") from None
        reason += " " + (ranks if ranks == "all" else ",".join(map(str, ranks)))
    # a run that is not running: one line, exit 1
    path = request(args.run_dir, args.action, reason)
    print(f"{args.action} requested: {path} (acted on within seconds, at a step boundary)")
    return 0


def cmd_bench(args) -> int:
    from .login.bench import parse_nprocs, scaling_table
    if args.nodes:
        from .login.bench import slurm_table
        print(slurm_table(args.config, args.overrides, parse_nprocs(args.nodes, "--nodes"), args.steps,
                          args.warmup))
        return 0
    print(scaling_table(args.config, args.overrides, parse_nprocs(args.nprocs), args.steps, args.warmup))
    return 0


def cmd_estimate(args) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise UserError(f"--world-size: must be >= 1 (got {args.world_size})")
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    from .data.tokenizer import ModelNotFound
    from .login.estimate import report
    try:
        lines, fits = report(cfg, args.gpu_mem, args.world_size)
    except ModelNotFound as e:  # the estimate reads config.json, not the weights (~140 GB for 70B)
        of = f"--model {e.value}" if args.overrides else f"--config {args.config}"  # a --set may name another
        fix = (f"the estimate needs only its config files, not the weights: "
               f"bash download_data_model.sh {of} --config-only")
        raise ModelNotFound(e.what, e.value, e.path, fix) from None
    print("\n".join(lines))
    return 1 if fits is False else 0  # `llmtrain estimate && bash submit.sh` stops at a run that cannot fit


def cmd_plan(args) -> int:
    from pathlib import Path

    import yaml

    from .config.load import overridden
    from .files import write_atomic
    from .login.plan import gpu_in, plan, report
    from .login.estimate import model_shape
    raw = load_config(args.config, args.overrides)  # the user's config as it is: its own problems first
    nodes = args.nodes or raw.slurm.nodes
    per_node = args.gpus_per_node or raw.slurm.procs_per_node or raw.slurm.gpus_per_node
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", per_node), ("--top", args.top)):
        if not value or value < 1:
            raise UserError(f"{flag}: must be >= 1 (got {value})")
    gpu = gpu_in(args.gpu, raw)
    cluster = [f"slurm.nodes={nodes}", f"slurm.gpus_per_node={per_node}", "slurm.procs_per_node=null"]
    neutral = ["parallel.strategy=fsdp", "parallel.tp=1", "parallel.cp=1", "parallel.pp=1", "parallel.ep=1",
               "parallel.shard_size=null", "train.micro_batch_size=1", "train.fp8=none"]
    cfg = load_config(args.config, [*args.overrides, *cluster, *neutral], world_size=nodes * per_node)
    from .data.tokenizer import ModelNotFound
    try:
        shape = model_shape(cfg)
    except ModelNotFound as e:  # as estimate's: the config files are enough
        raise ModelNotFound(e.what, e.value, e.path, f"the planner needs only its config files, not the weights: "
                            f"bash download_data_model.sh --config {args.config} --config-only") from None
    ranked = plan(cfg, shape, nodes * per_node, per_node, gpu, fp8=not args.no_fp8)
    print("\n".join(report(cfg, ranked, gpu, nodes * per_node, per_node, args.top)))
    if not ranked:
        return 1
    if args.apply:
        sets = [*args.overrides, *cluster, *ranked[0][0].overrides()]
        out = Path(args.apply)
        write_atomic(out, yaml.safe_dump(overridden(args.config, sets), sort_keys=False))
        try:
            load_config(out, world_size=nodes * per_node)
        except ConfigError:
            out.unlink()
            raise
        print(f"wrote {out}: the config with #1's layout")
    return 0


def cmd_plot(args) -> int:
    from .login.plot import plot
    out = plot(args.run_dirs, args.out)
    print(f"plot: {out}")
    return 0


def cmd_status(args) -> int:
    from .login.status import status
    try:
        status(args.target, args.follow, args.interval, _runs_dir(args))
    except BrokenPipeError:
        # The reader left (`llmtrain status X | head -1`): what it read was right; no traceback,
        # and nothing more to flush at exit (the Python docs' recipe, signal.SIGPIPE notes).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    entry()
