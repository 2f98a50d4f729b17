"""Submitting a run: what `bash submit.sh` does, and the entry point for notebooks.

    import llmtrain
    job = llmtrain.submit("config.yaml", ["train.lr=3e-4", "slurm.nodes=2"])
    job.job_id, job.run_dir, job.log     # '4242', Path(...), Path(.../demo-4242.out)
    job.state()                          # 'pending', 'running', 'finished', 'failed', ...
    job.metrics()                        # metrics.jsonl's records so far
    job.wait()                           # until the run leaves the queue and the nodes

    llmtrain submit --config FILE [--set K=V ...] [--dependency SPEC] [--dry-run] [-- SBATCH ARGS]
    llmtrain submit --local --config FILE [--set K=V ...] [--nproc N]

submit.sh parses its flags and runs `llmtrain submit`; `llmtrain sweep` submits its points
through the same functions. Everything is checked before anything is queued (`refusals`): the
config, the model, tokenizer and dataset on disk (compute nodes are offline), a run already
running or queued under the same name, and a request the cluster can never meet. What was
checked is what runs: the jobs train from a frozen copy of the resolved config,
`<run_dir>/submitted/<stamp>.yaml`. Unprepared data gets a CPU prepare job first, and training
waits for it (afterok). No torch here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import Config, ConfigError, UserError, dump_yaml, load_config
from ..data.sources import has_weights, is_hub_id, local_path, on_disk, tokenizer_source
from ..files import read_json
from ..optimizers import OPTIMIZERS
from ..rundir import CHECKPOINTS, META, RunPaths, complete_checkpoints
from .slurm import prepare_resources, sbatch_command, with_extra_args

DRY_RUN_JOB_ID = "DRY_RUN_JOB_ID"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass
class Job:
    """A submitted run: its Slurm job (None for a local run), where it writes, what it trains."""

    job_id: str | None
    name: str  # run.name: the job's name in squeue, and its log's
    run_dir: Path
    config: Path  # the frozen config the job trains from
    prepare_job_id: str | None = None
    prepare_resources: str = ""  # the prepare job's CPUs and time limit, and where they come from
    commands: list[list[str]] = dataclasses.field(default_factory=list)  # sbatch lines run

    @property
    def log(self) -> Path | None:
        """The job's output, <run_dir>/<run.name>-<job id>.out (a requeue appends to it)."""
        return self.run_dir / f"{self.name}-{self.job_id}.out" if self.job_id else None

    def state(self) -> str:
        """pending, running, stopped by request, finished, failed, cancelled, ... (`llmtrain status`'s)."""
        from .status import assess, latest_job
        return assess(self.run_dir, self.job_id or latest_job(self.run_dir)).state

    def status(self) -> str:
        """What `llmtrain status` prints for the run."""
        from .status import latest_job, render
        return render(self.run_dir, self.job_id or latest_job(self.run_dir))

    def metrics(self) -> list[dict]:
        from ..metrics import read_metrics
        return read_metrics(self.run_dir)

    def wait(self, poll_s: float = 10.0) -> str:
        """Until the run is neither pending nor running; its final state."""
        while (state := self.state()) in ("pending", "running"):
            time.sleep(poll_s)
        return state


def refusals(cfg: Config, config: str | os.PathLike, *, offline: bool, launch: bool,
             cluster: bool) -> list[str]:
    """Notes on what is not downloaded yet; raises ConfigError/UserError for what may not run:
    with offline, a model/tokenizer/dataset not on disk; with launch, a run that is running or
    queued now; with cluster, a request no partition or node can meet."""
    from ..data.sources import given_prepared
    # data.prepared, prepared: the source may be gone
    datasets = [(one.data.dataset, "datasets", s.key("dataset"))
                for one, s in zip(cfg.source_configs(), cfg.data.sources) if given_prepared(one) is None]
    missing = list(dict.fromkeys(
        f"{what}: {source} is not downloaded yet (looked in {local_path(source, kind)}); "
        f"run: bash download_data_model.sh --config {config}"
        for source, kind, what in ((cfg.model.name_or_path, "models", "model.name_or_path"),
                                   (tokenizer_source(cfg), "models", "model.tokenizer"), *datasets)
        if source and not on_disk(source, kind)))
    model = cfg.model.name_or_path
    if model and on_disk(model, "models") and not has_weights(local_path(model, "models")):
        # its config files alone (download_data_model.sh --config-only): the estimate's, not training's
        fix = f"run: bash download_data_model.sh --config {config}" if is_hub_id(model) else "copy them there"
        missing.append(f"model.name_or_path: {model} has no weights yet (no model.safetensors, "
                       f"pytorch_model.bin or index of either in {local_path(model, 'models')}); {fix}")
    if offline and missing:
        raise ConfigError(missing)
    if launch and cfg.run_dir.is_dir():
        from .status import ARRAY_TASK, assess, latest_job
        job = latest_job(cfg.run_dir)
        verdict = assess(cfg.run_dir, job)
        task = read_json(cfg.run_dir / "submitted" / ARRAY_TASK) or {}
        if job and str(task.get("array_job_id")) == job:  # a sweep point's task not started yet
            job = f"{job}_{task.get('index')}"
        if verdict.state in ("running", "pending"):
            after = f"submit with --dependency afterany:{job} to continue after it, " if job else ""
            raise UserError(f"run {cfg.run.name!r} is {verdict.state} now ({verdict.text}); {after}"
                            f"stop it (llmtrain control {cfg.run_dir} stop), or use another run.name")
    if cluster:  # a request no node or partition can meet would pend forever
        from .feasibility import cluster_problems
        if problems := cluster_problems(cfg):
            raise ConfigError(problems)
    return missing


def lead_warning(cfg: Config) -> str | None:
    """A warning where slurm.signal_lead_s is less than a stop at the time limit needs: two steps
    and the final save (training/control.py's Deadline), as the run's last launch measured them
    (metrics.jsonl, the latest checkpoint's meta.json), else the save of the model's weights and
    AdamW state at an assumed write rate. The trainer stops that early by itself once it has
    timed a step; until then, and for Slurm's warning signal, the lead is what counts."""
    from ..metrics import read_metrics
    from ..rundir import CHECKPOINTS, META, latest_checkpoint
    from ..rundir import ASSUMED_WRITE_BYTES_PER_S_PER_NODE, DEADLINE_MARGIN_S
    s = cfg.slurm
    if s.signal_lead_s <= 0:
        return None
    speeds = [r["tokens_per_sec"] for r in read_metrics(cfg.run_dir) if r.get("tokens_per_sec")]
    step_s = cfg.train.global_batch_size * cfg.data.seq_len / speeds[-1] if speeds else 0.0
    latest = latest_checkpoint(cfg.run_dir / CHECKPOINTS)
    meta = read_json(cfg.run_dir / CHECKPOINTS / latest / META) if latest else None
    if isinstance(meta, dict) and isinstance(meta.get("save_s"), (int, float)):
        save_s, save = float(meta["save_s"]), f"a save of ~{meta['save_s']:.0f} s (measured)"
    elif cfg.model.lora is None and (params := approx_params(cfg)):
        size = (4 + OPTIMIZERS[cfg.train.optimizer].state_bytes) * params  # fp32 weights, optimizer state
        save_s = size / (s.nodes * ASSUMED_WRITE_BYTES_PER_S_PER_NODE)
        save = (f"a save of ~{size / 1e9:,.0f} GB (~{save_s:.0f} s at an assumed "
                f"{ASSUMED_WRITE_BYTES_PER_S_PER_NODE / 1e9:g} GB/s per node)")
    else:
        save_s, save = 0.0, "the save"
    need = 2 * step_s + save_s + DEADLINE_MARGIN_S
    if need <= s.signal_lead_s:
        return None
    steps = f"two steps of ~{step_s:.0f} s (measured) and " if step_s else ""
    return (f"warning: slurm.signal_lead_s: a stop at the time limit needs {steps}{save}, "
            f"{need:.0f} s with the margin, more than the {s.signal_lead_s} s lead; the trainer "
            f"stops that early by itself once it has timed a step, but before that (and for "
            f"Slurm's warning signal) the lead counts: set slurm.signal_lead_s: {60 * -(-need // 60):.0f}")


def approx_params(cfg: Config) -> int | None:
    """The model's parameters from its Hugging Face config (a Llama-like decoder's matrices,
    within a few percent; no torch), or None where the config does not say."""
    m = cfg.model
    hf = m.architecture or read_json(local_path(m.name_or_path, "models") / "config.json") or {}
    try:
        h, layers, inter, vocab = (int(hf[k]) for k in ("hidden_size", "num_hidden_layers",
                                                        "intermediate_size", "vocab_size"))
        heads = int(hf["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    head_dim = int(hf.get("head_dim") or h // heads)
    kv = int(hf.get("num_key_value_heads") or heads) * head_dim
    attention = 2 * h * heads * head_dim + 2 * h * kv
    return layers * (attention + 3 * h * inter) + vocab * h * (1 if hf.get("tie_word_embeddings") else 2)


def pin_prepared(cfg: Config) -> Config:
    """`cfg` with the prepared folder it names (data.prepared), found here once, on the login
    node: no rank of its jobs reads the source's files (a corpus of thousands of files, stat-ed by
    every rank), a requeue trains on after the source is gone, and what follows here (is it
    prepared? the frozen copy) reads data.prepared instead of fingerprinting the source again."""
    from ..data.sources import prepared_path
    pinned = cfg.data.pinned([prepared_path(one) for one in cfg.source_configs()])  # each source's own folder
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **pinned))


def freeze(cfg: Config, path: Path, source: str | os.PathLike) -> None:
    """The resolved config (overrides applied, paths absolute, data.prepared pinned), for a job
    to train from."""
    from ..files import write_atomic
    cfg = pin_prepared(cfg)  # a no-op where the caller pinned it
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, f"# frozen by llmtrain submit from {source}\n" + dump_yaml(cfg))


_stamps = itertools.count()


def stamp() -> str:
    """The frozen config's name: time and pid, and a count after the first in this process (two
    submissions within a second from one notebook never share a file)."""
    n = next(_stamps)
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" + (f".{n}" if n else "")


def is_prepared(cfg: Config) -> bool:
    from ..data.sources import prepared_path, read_manifest
    return all(read_manifest(prepared_path(one)) is not None for one in cfg.source_configs())


def submit(config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
           dependency: str | None = None, sbatch_args: list[str] | tuple[str, ...] = (),
           dry_run: bool = False, script: str | os.PathLike | None = None) -> Job:
    """Validate the run and queue it on Slurm (a prepare job first where the data is not
    prepared); with dry_run, compute the sbatch lines (Job.commands) and queue nothing."""
    home, script = slurm_environment(script)
    cfg = load_config(config, list(overrides))
    # A run that trains or waits now is refused, unless this job waits for one (--dependency).
    refusals(cfg, config, offline=True, launch=not dependency, cluster=True)
    if warning := lead_warning(cfg):
        print(warning, file=sys.stderr, flush=True)
    cfg = pin_prepared(with_extra_args(cfg, list(sbatch_args)))
    frozen = cfg.run_dir / "submitted" / f"{stamp()}.yaml"
    if not dry_run:
        freeze(cfg, frozen, config)
    job = Job(None, cfg.run.name, cfg.run_dir, frozen)
    after = None
    if not is_prepared(cfg):  # one CPU job tokenizes the data first
        job.prepare_job_id = after = sbatch(job.commands, sbatch_command(
            cfg, "prepare", script=script, frozen=frozen, home=home, dependency=dependency), dry_run)
        cpus, limit, why = prepare_resources(cfg)
        job.prepare_resources = f"{cpus} CPUs, time limit {limit} ({why})"
    job.job_id = sbatch(job.commands, sbatch_command(
        cfg, "train", script=script, frozen=frozen, home=home, after=after,
        dependency=None if after else dependency), dry_run)
    return job


def slurm_environment(script) -> tuple[str, Path]:
    """(LLMTRAIN_HOME, the batch script) for the jobs; one line for what is missing."""
    home = os.environ.get("LLMTRAIN_HOME")
    if not home:
        raise UserError("LLMTRAIN_HOME is not set; source the env.sh that setup.sh wrote")
    if not shutil.which("sbatch"):
        raise UserError("no Slurm on this machine (sbatch not found); to run here, use: "
                        "bash submit.sh --local")
    if script is None:
        repo = os.environ.get("LLMTRAIN_REPO")
        if not repo:
            raise UserError("LLMTRAIN_REPO is not set; source the env.sh that setup.sh wrote")
        script = Path(repo) / "train.slurm"
    return home, Path(script)


def sbatch(commands: list[list[str]], cmd: list[str], dry_run: bool) -> str:
    """Run one sbatch line (appended to `commands`); the job id it prints."""
    commands.append(cmd)
    if dry_run:
        return DRY_RUN_JOB_ID
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # sbatch's errors go to stderr
    job_id = proc.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    if proc.returncode != 0:
        raise UserError("sbatch failed (above); nothing more was submitted")
    if not job_id:
        raise UserError("sbatch printed no job id")
    return job_id


def submitted_lines(job: Job) -> list[str]:
    """What `llmtrain submit` prints: key: value lines, for people and for scripts."""
    lines = [f"prepare_job_id: {job.prepare_job_id} (tokenizes the data on one node, "
             f"{job.prepare_resources}; training waits for it)"] if job.prepare_job_id else []
    return lines + [f"job_id: {job.job_id}", f"run_dir: {job.run_dir}",
                    f"log: {job.log}",
                    f"config: {job.config} (the jobs train from this copy; to change the run, "
                    f"submit again)",
                    f"watch: squeue -j {job.job_id}; tail -f {job.log}; "
                    f"llmtrain status {job.job_id}"]


def run_local(config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
              nproc: int | None = None) -> int:
    """Train on this machine under torchrun (llmtrain's, without its launcher traceback): checked
    and prepared first. Ctrl-C saves and stops, as `llmtrain control RUN_DIR stop` does; a third
    Ctrl-C ends the run at once, without saving (130). Returns torchrun's exit code; a failure's
    line is the last one printed."""
    overrides = list(overrides)
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc: must be a positive integer (got {nproc})")
    # Checked for this machine's processes: slurm.nodes and the Slurm-only keys do not count here.
    cfg = load_config(config, overrides, world_size=nproc or "local")
    nproc = nproc or cfg.slurm.procs_per_node or 1
    refusals(cfg, config, offline=True, launch=True, cluster=False)
    if (step := finished_at(cfg)) is not None:  # said now, not after torchrun and its workers start (10 s)
        print(f"nothing to train: {cfg.run_dir} is at step {step} of {cfg.train.max_steps} already; raise "
              f"train.max_steps (or train.epochs) to train further")
        return 0
    from ..data.prepare import prepare
    # The ranks train from this folder, found once here: none of them reads the source's files.
    folders = [prepare(one) for one in cfg.source_configs()]
    # data.prepared, or each data.mixture entry's; quoted: any path is YAML text
    overrides += [f"data.{key}={json.dumps(value)}" for key, value in cfg.data.pinned(folders).items()]
    print(f"run_dir: {cfg.run_dir}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": thread_share(nproc)}
    if nproc == 1:  # a group of one: not a rank of an outer launcher (srun, torchrun) we run in
        env = {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    threads = f"{env['OMP_NUM_THREADS']} thread(s) (OMP_NUM_THREADS)"
    print(f"torchrun: {nproc} process(es) x {threads}" if nproc > 1 else
          f"one process (no torchrun needed) x {threads}", flush=True)
    # Only what this launch records counts: an earlier launch's error line or stop goes first.
    error_file = RunPaths(cfg.run_dir).error
    for old in (error_file, RunPaths(cfg.run_dir).exit):
        old.unlink(missing_ok=True)
    # torchrun ignores SIGINT (it is told not to take it over: its own handling ends in a
    # SignalException traceback), and so do the workers it starts: the terminal's Ctrl-C reaches
    # this process only (CtrlC). One process is the trainer alone (a group of one), without a
    # launcher's start-up.
    cmd = (torchrun_command(nproc, config, overrides, ["--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT"])
           if nproc > 1 else train_command(config, overrides))
    ctrl_c = CtrlC(cfg.run_dir)
    before = {signal.SIGINT: signal.signal(signal.SIGINT, ctrl_c.pressed)}
    try:
        # One process gets a session of its own, as torchrun's workers do: the terminal's
        # Ctrl-C reaches this launcher only, however many times it is pressed.
        child = ctrl_c.child = subprocess.Popen(cmd, env=env, start_new_session=nproc == 1,
                                                preexec_fn=child_of_this_launcher())
        if ctrl_c.forced:  # the third press came while the child was being started
            ctrl_c.end_run()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a killed launcher stops torchrun too
            before[sig] = signal.signal(sig, lambda s, _: child.send_signal(s))
        rc = child.wait()
        if ctrl_c.forced:  # with the handler still ours: a fourth press is not a traceback
            return ctrl_c.ended()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    rc = 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell says
    if rc:  # the trainer's line was the last one (llmtrain's torchrun; one process: the trainer)
        return rc
    print(f"run_dir: {cfg.run_dir}")
    return 0


def child_of_this_launcher():
    """The Popen preexec_fn of a local run's child (torchrun's agent, or the one trainer): it
    ignores SIGINT (the launcher takes Ctrl-C) and gets SIGTERM when this launcher dies. A
    launcher killed with SIGKILL (kill -9, the OOM killer) runs none of its handlers, and the
    child, in a session of its own, trained on as an orphan, holding the run directory's lock and
    the CPUs. With Linux's PR_SET_PDEATHSIG the kernel tells it: SIGTERM is "save and stop" to
    the trainer (a checkpoint is better than nothing; it then exits), and torchrun forwards it to
    its workers, which also die with the agent (training/distributed.py `die_with_launcher`). The
    signal follows the *thread* that forked the child: this is called from the launcher's main
    thread, which waits for the child until it ends."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes
        try:  # looked up here, before the fork, not in the child
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass
    launcher = os.getpid()

    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if prctl is not None:
            prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
            if os.getppid() != launcher:  # the launcher died before the call: nobody would tell us
                os._exit(1)
    return setup


class CtrlC:
    """The terminal's Ctrl-C at a local run, as a person at it expects. The first asks the trainer
    to save and stop (the stop switch); the second says that this is under way and what a third
    does; the third ends the run at once: a save can take minutes, and a person who cannot wait
    for it must not have to find and kill the processes (the launcher's own group holds torchrun's
    agent only; its workers and the one trainer each have a session of their own). Nothing is
    saved then: the run resumes from its last checkpoint, which the closing line names."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.presses = 0
        self.child: subprocess.Popen | None = None
        self.tree: list[int] = []

    @property
    def forced(self) -> bool:
        return self.presses >= 3

    def pressed(self, *_) -> None:  # the SIGINT handler
        self.presses += 1
        if self.presses == 1:
            ask_to_stop(self.run_dir)
        elif self.presses == 2:  # the switch stays written once: a second one, written during
            # the save, would outlive the run and only be removed by the next launch, with a word
            print("interrupted again: the trainer saves a checkpoint at its next step, then stops; "
                  "a third Ctrl-C stops it at once, without saving", file=sys.stderr, flush=True)
        elif self.presses == 3 and self.child is not None:
            self.end_run()

    def end_run(self) -> None:
        """SIGKILL the child and every process under it, the group leaders' groups with them
        (whatever they started). The tree is read before the first kill: a killed agent's
        workers are no longer its children."""
        if self.tree:  # already done
            return
        self.tree = process_tree(self.child.pid)
        for pid in self.tree:
            try:
                if os.getpgid(pid) == pid:  # the one trainer, torchrun's workers: not the agent
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # ended meanwhile

    def ended(self) -> int:
        """After the child was reaped: wait (briefly) until the rest of its tree is gone, leave
        no stop request behind, and say what the run can resume from. 130: ended by Ctrl-C."""
        deadline = time.monotonic() + 10
        while any(map(running, self.tree)) and time.monotonic() < deadline:
            time.sleep(0.05)
        RunPaths(self.run_dir).switch("stop").unlink(missing_ok=True)
        from ..rundir import CHECKPOINTS, complete_checkpoints
        done = complete_checkpoints(self.run_dir / CHECKPOINTS)
        last = f"the last checkpoint is {done[0].name}" if done else "there is no checkpoint yet"
        print(f"stopped without saving: {last}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


def process_tree(root: int) -> list[int]:
    """`root` and the processes under it, parents first (Linux /proc; elsewhere `root` alone)."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return [root]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the (command name)
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(pid)
    tree = [root]
    for pid in tree:  # grows as it is walked
        tree.extend(children.get(pid, ()))
    return tree


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed one its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
    except (ValueError, IndexError):
        return True


def ask_to_stop(run_dir: Path) -> None:
    print("interrupted: asking the trainer to save and stop at the next step", file=sys.stderr, flush=True)
    from ..files import write_atomic
    RunPaths(run_dir).control.mkdir(parents=True, exist_ok=True)
    write_atomic(RunPaths(run_dir).switch("stop"), "user\n")


def train_command(config: str | os.PathLike, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "llmtrain", "train", "--config", str(config),
            *(x for o in overrides for x in ("--set", o))]


def torchrun_command(nproc: int, config: str | os.PathLike, overrides: list[str],
                     options: list[str] = ()) -> list[str]:
    """llmtrain's torchrun (no launcher traceback) training `config` on `nproc` local processes.
    --standalone: a private rendezvous on a free local port, so two local runs never meet."""
    return [sys.executable, "-m", "llmtrain.training.torchrun", *options, "--standalone",
            "--nproc-per-node", str(nproc), "-m", *train_command(config, overrides)[2:]]


def finished_at(cfg: Config) -> int | None:
    """The step of the run's newest complete checkpoint where a resume would have nothing to
    train (it reached train.max_steps); None otherwise (train.epochs: the steps need the data)."""
    if cfg.train.resume != "auto" or cfg.train.max_steps is None:
        return None
    newest = complete_checkpoints(cfg.run_dir / CHECKPOINTS)[:1]
    step = (read_json(newest[0] / META) or {}).get("step") if newest else None
    return step if isinstance(step, int) and step >= cfg.train.max_steps else None


def thread_share(nproc: int) -> str:
    """OMP_NUM_THREADS for each of nproc local processes: their share of the CPUs this process
    may use (its affinity mask), unless the user chose a number (torchrun would set 1)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // nproc))
