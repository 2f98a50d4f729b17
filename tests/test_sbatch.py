"""The sbatch command lines of a run (llmtrain/login/slurm.py), in-process, without Slurm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from llmtrain.cli import main
from llmtrain.config import load_config
from llmtrain.login.slurm import requeue_decision, sbatch_command, with_extra_args, without_gpus
from llmtrain.rundir import SHELL_NAMES

SCRIPT = Path("/repo/train.slurm")
FROZEN = Path("/runs/slurm/submitted/20261121-101010-1.yaml")


@pytest.fixture
def config(tmp_path, home):
    def make(slurm: dict | None = None, **sections):
        cfg = tiny_config(run={"name": "slurm", "dir": str(tmp_path / "runs")},
                          data={"prepared_dir": str(tmp_path / "prepared")}, **sections)
        cfg["slurm"] = {"nodes": 1, "procs_per_node": 2, **(slurm or {})}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path
    return make


def command(path: Path, job: str = "train", *sets: str, extra=(), **kw) -> tuple[dict, list[str]]:
    cfg = with_extra_args(load_config(path, list(sets)), list(extra))
    cmd = sbatch_command(cfg, job, script=SCRIPT, frozen=FROZEN, home="/home/llm", **kw)
    assert cmd[0] == "env" and cmd[-1] == str(SCRIPT)
    at = cmd.index("sbatch")
    return dict(w.split("=", 1) for w in cmd[1:at]), cmd[at:-1]


# (overrides, extra sbatch arguments) -> the sbatch arguments after `sbatch --parsable`
MATRIX = [
    ([], [], ["--job-name=slurm", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=0",
              "--time=01:00:00", "--output={run_dir}/%x-%j.out", "--open-mode=append", "--requeue",
              "--signal=B:USR1@120"]),
    (["slurm.nodes=4", "slurm.time=02:30:00", "slurm.signal_lead_s=0", "slurm.mem=200G",
      "train.global_batch_size=32"], [],
     ["--job-name=slurm", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=200G",
      "--time=02:30:00", "--output={run_dir}/%x-%j.out", "--open-mode=append", "--requeue"]),
    (["slurm.partition=gpu", "slurm.account=acme", "slurm.qos=high", "slurm.gpus_per_node=4",
      "slurm.procs_per_node=4", "train.micro_batch_size=2"], ["--exclusive", "--constraint=a100"],
     ["--job-name=slurm", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=0",
      "--time=01:00:00", "--output={run_dir}/%x-%j.out", "--open-mode=append", "--requeue",
      "--signal=B:USR1@120", "--gpus-per-node=4", "--partition=gpu", "--account=acme", "--qos=high",
      "--exclusive", "--constraint=a100"]),
    (["slurm.extra_args=[--reservation=r1]", "slurm.cpus_per_node=32"], ["--hold"],
     ["--job-name=slurm", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=32", "--mem=0",
      "--time=01:00:00", "--output={run_dir}/%x-%j.out", "--open-mode=append", "--requeue",
      "--signal=B:USR1@120", "--reservation=r1", "--hold"]),
]


@pytest.mark.parametrize("sets,extra,expected", MATRIX)
def test_the_training_jobs_sbatch_line_follows_the_config(config, sets, extra, expected):
    path = config()
    env, sbatch = command(path, "train", *sets, extra=extra)
    run_dir = load_config(path, sets).run_dir
    assert sbatch == ["sbatch", "--parsable", *(e.format(run_dir=run_dir) for e in expected)]
    procs = "4" if "slurm.procs_per_node=4" in sets else "2"
    assert env == {"LLMTRAIN_CONFIG": str(FROZEN), "LLMTRAIN_HOME": "/home/llm",
                   "LLMTRAIN_RUN_DIR": str(run_dir), "LLMTRAIN_PROCS_PER_NODE": procs,
                   "LLMTRAIN_MAX_REQUEUES": "5", "LLMTRAIN_MAX_RESTARTS": "0", "LLMTRAIN_STEP": "train",
                   "LLMTRAIN_CONTINUATION": "0", **SHELL_NAMES}


def test_procs_per_node_defaults_to_the_gpus(config):
    env, _ = command(config({"gpus_per_node": 8, "procs_per_node": None}, train={"global_batch_size": 64}))
    assert env["LLMTRAIN_PROCS_PER_NODE"] == "8"


def test_dependencies_of_the_first_job_the_training_job_and_a_continuation(config):
    path = config()
    _, first = command(path, "train", dependency="afterok:41")
    assert first[-2:] == ["--dependency=afterok:41", "--kill-on-invalid-dep=yes"]
    # After a prepare job: its id, and the user's dependency went to the prepare job.
    _, after = command(path, "train", after="77", dependency="afterok:41")
    assert after[-2:] == ["--dependency=afterok:77", "--kill-on-invalid-dep=yes"]
    assert "--dependency=afterok:41" not in after
    env, cont = command(path, "continuation", after="99", continuation=2)
    assert cont[-1] == "--dependency=afterany:99" and env["LLMTRAIN_CONTINUATION"] == "3"
    assert cont[:-1] == first[:-2]  # the same resources as the first job


def test_the_prepare_job_keeps_place_but_no_gpus(config):
    path = config({"nodes": 2, "gpus_per_node": 8, "procs_per_node": 8, "cpus_per_node": 16,
                   "partition": "gpu", "account": "acme", "qos": "high", "time": "02:00:00",
                   "extra_args": ["--gres=gpu:8,nvme:1", "--constraint=a100"]},
                  train={"global_batch_size": 64})
    env, sbatch = command(path, "prepare", extra=["--gpus-per-task", "1", "--exclusive", "--cpus-per-gpu=4"],
                          dependency="afterok:5")
    run_dir = load_config(path).run_dir
    assert sbatch == [
        # its own time: the demo's stories take the shortest limit, not the training job's 2 h
        "sbatch", "--parsable", "--cpus-per-task=16", "--mem=0", "--time=00:30:00", "--requeue",
        "--open-mode=append", "--partition=gpu", "--account=acme", "--qos=high",
        "--gres=nvme:1", "--constraint=a100", "--exclusive",  # the user's, less their GPU requests
        "--job-name=prepare-slurm", "--nodes=1", "--ntasks=1", f"--output={run_dir}/prepare-%j.out",
        "--dependency=afterok:5"]
    assert env["LLMTRAIN_STEP"] == "prepare"


def test_the_prepare_jobs_cpus_and_time_limit_come_from_the_corpus_size(config, tmp_path):
    """A 100B-token corpus took the training job's limit (1 h on 8 CPUs) and timed out. Now the
    time is the source's size at 1 MB/s a CPU (compressed files count 4x), at least 30 min, in
    whole 10 minutes; slurm.prepare_cpus and slurm.prepare_time say otherwise."""
    from llmtrain.login.slurm import prepare_resources

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # 3 x 10 GB of text, as sparse files: sizes are all that is read
        with open(corpus / f"part-{i}.txt", "wb") as f:
            f.truncate(10 * 10**9)
    with open(corpus / "more.jsonl.gz", "wb") as f:
        f.truncate(5 * 10**9)  # 20 GB of text once decompressed
    path = config({"cpus_per_node": 8, "prepare_cpus": 32})
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["dataset"] = str(corpus)
    path.write_text(yaml.safe_dump(cfg))
    # 600 s + 50 GB / (32 x 1 MB/s) = 2,162.5 s -> 2,400 s
    assert prepare_resources(load_config(path)) == (32, "00:40:00", "~50.0 GB of text on 32 CPUs")
    assert prepare_resources(load_config(path, ["slurm.prepare_cpus=null"])) == (
        8, "02:00:00", "~50.0 GB of text on 8 CPUs")  # 600 + 6,250 s
    assert prepare_resources(load_config(path, ["slurm.prepare_time=1-00:00:00"])) == (
        32, "1-00:00:00", "slurm.prepare_time")
    env, sbatch = command(path, "prepare")
    assert "--cpus-per-task=32" in sbatch and "--time=00:40:00" in sbatch


@pytest.mark.parametrize("args,kept", [
    (["--gres", "gpu:a100:4", "--qos=x"], ["--qos=x"]),
    (["--gres=gpu:2,shard:1,nvme:1"], ["--gres=shard:1,nvme:1"]),
    (["-G", "4", "-G4", "--gpus=8", "--gpus-per-task", "2", "--gpu-bind=closest", "--mem-per-gpu", "8G"], []),
    (["--exclusive", "--constraint=h100"], ["--exclusive", "--constraint=h100"]),
])
def test_gpu_requests_are_dropped_with_their_values(args, kept):
    assert without_gpus(args) == kept


def test_the_cli_prints_the_line_nul_separated_and_freezes_the_extra_arguments(config, capfd, tmp_path):
    path = config()
    assert main(["sbatch-command", "train", "--config", str(path), "--script", str(SCRIPT),
                 "--set", "slurm.nodes=2", "--set", "train.global_batch_size=16", "--", "--exclusive",
                 "--hold"]) == 0
    words = capfd.readouterr().out.split("\0")
    assert words[-1] == "" and words[-2] == str(SCRIPT)
    assert "--nodes=2" in words and words[-4:-2] == ["--exclusive", "--hold"]
    assert f"LLMTRAIN_CONFIG={path}" in words  # no --frozen: the config itself
    # The frozen config keeps the extra arguments: a continuation asks for the same.
    frozen = tmp_path / "frozen.yaml"
    assert main(["check-config", str(path), "--set", "slurm.nodes=2", "--set", "train.global_batch_size=16",
                 "--freeze", str(frozen),
                 "--", "--exclusive"]) == 0
    assert yaml.safe_load(frozen.read_text())["slurm"]["extra_args"] == ["--exclusive"]
    capfd.readouterr()
    assert main(["sbatch-command", "continuation", "--config", str(frozen), "--script", str(SCRIPT),
                 "--after", "12", "--shell"]) == 0
    line = capfd.readouterr().out
    assert "--nodes=2" in line and "--exclusive --dependency=afterany:12" in line


def test_a_bad_config_is_one_line_and_exit_2(config, capfd):
    path = config()
    assert main(["sbatch-command", "train", "--config", str(path), "--script", str(SCRIPT),
                 "--set", "slurm.nodes=0"]) == 2
    assert capfd.readouterr().err.splitlines() == ["slurm.nodes: must be > 0 (got 0)"]


@pytest.mark.parametrize("exit_json,restarts,expected", [
    ({"reason": "preempt", "requeue": True, "job_id": "7"}, 0,
     (True, "requeueing job 7 (requeue 1 of at most 2)")),
    ({"reason": "preempt", "requeue": True, "job_id": "7"}, 1,
     (True, "requeueing job 7 (requeue 2 of at most 2)")),
    ({"reason": "preempt", "requeue": True, "job_id": "7"}, 2,
     (False, "not requeueing: the job was requeued 2 times already for preemption or signals "
             "(slurm.max_requeues; time-limit requeues are not counted)")),
    # The time limit of a run that needs many allocations is the plan, not a failure.
    ({"reason": "deadline", "requeue": True, "job_id": "7", "trained": 40}, 2,
     (True, "requeueing job 7 at its time limit (planned; slurm.max_requeues counts the other "
            "requeues: 2 of 2 so far)")),
    # ... unless the launch trained nothing before it (a time limit too short to train at all).
    ({"reason": "deadline", "requeue": True, "job_id": "7", "trained": 0}, 2,
     (False, "not requeueing: the job was requeued 2 times already for preemption or signals "
             "(slurm.max_requeues; time-limit requeues are not counted)")),
    ({"reason": "user", "requeue": False, "job_id": "7"}, 0, (False, "")),
    ({"reason": "preempt", "requeue": True, "job_id": "6"}, 0, (False, "")),  # another job's file
    ("{torn", 0, (False, "")),
    (None, 0, (False, "")),
])
def test_requeue_only_when_this_jobs_trainer_asked_and_requeues_remain(tmp_path, exit_json, restarts,
                                                                       expected):
    if exit_json is not None:
        (tmp_path / "control").mkdir()
        text = exit_json if isinstance(exit_json, str) else json.dumps(exit_json)
        (tmp_path / "control" / "exit.json").write_text(text)
    assert requeue_decision(tmp_path, "7", restarts, max_requeues=2) == expected


def test_one_requeue_is_one_time(tmp_path):
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "exit.json").write_text('{"requeue": true, "job_id": "7"}')
    assert requeue_decision(tmp_path, "7", 1, max_requeues=1) == (
        False, "not requeueing: the job was requeued 1 time already for preemption or signals "
               "(slurm.max_requeues; time-limit requeues are not counted)")


def test_time_limit_requeues_do_not_use_up_max_requeues(tmp_path, monkeypatch, capfd):
    """What train.slurm runs after each launch (`llmtrain requeue`), with scontrol recording its
    calls: ten time-limit stops in a row all come back with slurm.max_requeues 1; then one
    preemption is allowed and a second is not. A new submission (another frozen config) counts
    from zero."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >>"{tmp_path}/scontrol.calls"\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True)

    def launch_ends(reason: str, restarts: int, config: str = "submitted/a.yaml") -> str:
        (run_dir / "control" / "exit.json").write_text(json.dumps(
            {"reason": reason, "requeue": True, "job_id": "7", "trained": 5}))
        capfd.readouterr()
        assert main(["requeue", str(run_dir), "7", "--config", config, "--script", "train.slurm",
                     "--restarts", str(restarts), "--max-requeues", "1"]) == 0
        return capfd.readouterr().out

    for restarts in range(10):
        assert "at its time limit (planned" in launch_ends("deadline", restarts)
    assert "requeue 1 of at most 1" in launch_ends("preempt", 10)
    assert "not requeueing: the job was requeued 1 time already" in launch_ends("preempt", 11)
    assert (tmp_path / "scontrol.calls").read_text().count("requeue 7") == 11
    assert "requeue 1 of at most 1" in launch_ends("preempt", 0, config="submitted/b.yaml")


def test_sinfo_lines_become_nodes_with_their_gpus_memory_and_time_limit():
    """`sinfo -h -N -o '%N|%P|%c|%m|%G|%l'` as clusters print it (feasibility.py's input)."""
    from llmtrain.login.feasibility import format_limit, mem_mb, parse_sinfo

    nodes = parse_sinfo("gpu01|gpu*|64|512000|gpu:a100:4(S:0-1)|2-00:00:00\n"
                        "gpu02|gpu*|64|512000+|gpu:h100:8,gpu:a100:2(S:0)|1-12\n"
                        "cpu01|cpu|128|256000|(null)|infinite\n"
                        "tiny|debug|2|4000|gres/gpu:1|30:00\n")
    got = [(n.name, n.partition, n.default, n.cpus, n.mem_mb, n.gpus, n.time_limit_s) for n in nodes]
    assert got == [("gpu01", "gpu", True, 64, 512000, 4, 2 * 86400),
                   ("gpu02", "gpu", True, 64, 512000, 10, 36 * 3600),
                   ("cpu01", "cpu", False, 128, 256000, 0, float("inf")),
                   ("tiny", "debug", False, 2, 4000, 1, 30 * 60)]
    assert [format_limit(n.time_limit_s) for n in nodes] == ["2-00:00:00", "1-12:00:00", "no limit", "00:30:00"]
    assert [mem_mb(v) for v in ("0", "64G", "500000M", "128000", "1T", "lots")] == [0, 65536, 500000, 128000,
                                                                                   1048576, 0]


@pytest.mark.parametrize("sinfo,problems", [
    ("node1|debug*|8|4000|(null)|infinite\n", []),
    ("node1|debug*|8|4000|(null)|1:00:00\n", ["slurm.time: asks 02:00:00; the default partition debug allows "
                                              "at most 01:00:00; lower slurm.time (a requeue continues the "
                                              "run) or choose another partition"]),
    ("", []),  # sinfo shows nothing to judge by: sbatch decides
    (None, []),  # no sinfo on this machine: sbatch (or its absence) says so
])
def test_the_cluster_check_judges_only_by_what_sinfo_shows(config, monkeypatch, sinfo, problems):
    from llmtrain.login import feasibility

    monkeypatch.setattr(feasibility, "_sinfo", lambda: sinfo)
    cfg = load_config(config(slurm={"cpus_per_node": 4, "time": "02:00:00"}))
    assert feasibility.cluster_problems(cfg) == problems


@pytest.mark.parametrize("rules,slurm,problems", [
    ({"AllowAccounts": "ALL", "AllowQos": "ALL", "MaxNodes": "UNLIMITED"},
     {"account": "bio", "qos": "low", "nodes": 4}, []),
    ({"AllowAccounts": "physics,chem", "AllowQos": "high,normal"}, {"account": "bio", "qos": "low"},
     ["slurm.account: partition gpu does not take account 'bio' (allows chem, physics); choose another "
      "account or another partition (slurm.partition)",
      "slurm.qos: partition gpu does not take qos 'low' (allows high, normal); choose another QOS or "
      "another partition (slurm.partition)"]),
    ({"AllowQos": "ALL", "DenyQos": "scavenger"}, {"qos": "scavenger"},
     ["slurm.qos: partition gpu does not take qos 'scavenger' (denies 'scavenger'); choose another QOS "
      "or another partition (slurm.partition)"]),
    ({"MaxNodes": "2"}, {"nodes": 4, "procs_per_node": 1},
     ["slurm.nodes: asks 4 nodes; partition gpu allows at most 2 per job; lower slurm.nodes or choose "
      "another partition"]),
], ids=["all", "allow-lists", "deny-list", "max-nodes"])
def test_the_partitions_rules_on_accounts_qos_and_nodes(config, rules, slurm, problems):
    """`scontrol show partition -o` fields, as a cluster with restricted partitions prints them."""
    from llmtrain.login.feasibility import partition_problems

    cfg = load_config(config(slurm=slurm, train={"global_batch_size": 32}))
    assert partition_problems(cfg, "gpu", "partition gpu", rules) == problems


@pytest.mark.parametrize("storage,account,default,problems", [
    ("accounting_storage/slurmdbd", None, "bio\n", ["slurm.account: partition gpu allows only accounts chem, "
     "physics, and no account is given (your default: bio); set slurm.account"]),
    ("accounting_storage/slurmdbd", None, "\n", ["slurm.account: partition gpu allows only accounts chem, "
     "physics, and no account is given (your default: none); set slurm.account"]),
    ("accounting_storage/slurmdbd", None, "physics\n", []),
    ("accounting_storage/slurmdbd", None, None, []),  # sacctmgr does not answer: sbatch decides
    ("accounting_storage/slurmdbd", "chem", "bio\n", []),
    (None, None, None, []),  # neither scontrol nor sacctmgr says
    ("accounting_storage/none", "chem", None, ["slurm.account: partition gpu allows only accounts chem, "
     "physics, and this cluster keeps no accounting (AccountingStorageType=accounting_storage/none), so "
     "Slurm never knows a job's account and the job would pend forever; choose another partition "
     "(slurm.partition)"]),
], ids=["default-not-allowed", "no-default", "default-allowed", "no-sacctmgr", "account-given", "unknown",
        "no-accounting"])
def test_the_account_slurm_would_charge_against_the_partitions_allow_list(config, storage, account,
                                                                          default, problems):
    """With no slurm.account Slurm charges the user's default account (`sacctmgr -nP show user
    NAME format=DefaultAccount`); without accounting no job has one, and each would pend forever."""
    from llmtrain.login.feasibility import job_account_problems

    def sacctmgr(args):
        assert args[:2] == ["show", "user"] and args[3] == "format=DefaultAccount"
        return default

    cfg = load_config(config(slurm={"account": account}))
    rules = {"AllowAccounts": "physics,chem"}
    assert job_account_problems(cfg, "partition gpu", rules, lambda: storage, sacctmgr) == problems
    assert job_account_problems(cfg, "partition gpu", {"AllowAccounts": "ALL"}, lambda: storage, sacctmgr) == []


def test_accounting_limits_where_sacctmgr_answers(config):
    """The user's associations and a QOS's MaxWall and MaxTRESPerJob (`sacctmgr -nP` output)."""
    from llmtrain.login.feasibility import accounting_problems

    answers = {"assoc": "physics\nchem\n", "qos": "high|1-00:00:00|node=2,gres/gpu=8\n"}
    cfg = load_config(config(slurm={"account": "bio", "qos": "high", "nodes": 4, "procs_per_node": 1,
                                    "gpus_per_node": 4, "time": "2-00:00:00"},
                             train={"global_batch_size": 16}))
    assert accounting_problems(cfg, lambda args: answers[args[1]]) == [
        "slurm.account: you have no association with account 'bio' (yours: chem, physics); choose one of them",
        "slurm.time: asks 2-00:00:00; QOS high allows at most 1-00:00:00; lower slurm.time (a requeue "
        "continues the run) or choose another QOS",
        "slurm.nodes: asks 4 nodes; QOS high allows at most 2 per job",
        "slurm.gpus_per_node: asks 16 GPUs in all; QOS high allows at most 8 per job"]
    assert accounting_problems(cfg, lambda args: "" if args[1] == "qos" else "bio\n") == [
        "slurm.qos: no QOS 'high' on this cluster (sacctmgr show qos lists them)"]
    assert accounting_problems(cfg, lambda args: None) == []  # no accounting database: sbatch decides


LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192}


def test_submit_warns_where_the_lead_cannot_cover_the_final_save_and_two_steps(config, tmp_path):
    """A 70B on 8 nodes: its ~847 GB save at 0.5 GB/s a node needs minutes, not the default 120 s;
    on 64 nodes the lead covers it. Once the run has measured its step and save, those count."""
    from llmtrain.login.submit import lead_warning

    path = config(model={"architecture": LLAMA_70B}, slurm={"nodes": 8},
                  train={"global_batch_size": 128, "micro_batch_size": 1, "eval_samples": 128})
    assert lead_warning(load_config(path)) == (
        "warning: slurm.signal_lead_s: a stop at the time limit needs a save of ~847 GB (~212 s at "
        "an assumed 0.5 GB/s per node), 227 s with the margin, more than the 120 s lead; the "
        "trainer stops that early by itself once it has timed a step, but before that (and for "
        "Slurm's warning signal) the lead counts: set slurm.signal_lead_s: 240")
    assert lead_warning(load_config(path, ["slurm.nodes=64"])) is None
    run_dir = load_config(path).run_dir
    (run_dir / "checkpoints" / "step-00000100").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000100" / "meta.json").write_text('{"save_s": 40.2}')
    (run_dir / "checkpoints" / "latest").write_text("step-00000100\n")
    # global batch 128 x 64 tokens at 109.2 tokens/s: 75 s steps
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 100, "tokens_per_sec": 109.2267}\n')
    assert lead_warning(load_config(path, ["slurm.nodes=64"])) == (
        "warning: slurm.signal_lead_s: a stop at the time limit needs two steps of ~75 s (measured) "
        "and a save of ~40 s (measured), 205 s with the margin, more than the 120 s lead; the "
        "trainer stops that early by itself once it has timed a step, but before that (and for "
        "Slurm's warning signal) the lead counts: set slurm.signal_lead_s: 240")
