"""setup.sh and submit.sh as a user runs them, from a path with spaces; ShellCheck on every script."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from conftest import REPO, read_metrics

SCRIPTS = ["setup.sh", "submit.sh", "download_data_model.sh", "train.slurm", "lib/find-env.sh",
           "cluster/local-cluster.sh", ".ci/run"]
USER_SCRIPTS = ["setup.sh", "submit.sh", "download_data_model.sh"]
pytestmark = pytest.mark.slow


def bash(*args, env=None, cwd=None, timeout=600):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_shellcheck_and_bash_n(script):
    assert shutil.which("shellcheck"), "ShellCheck is not installed (apt-get install shellcheck)"
    lint = subprocess.run(["shellcheck", "-x", script], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert bash("-n", REPO / script).returncode == 0


@pytest.mark.parametrize("script", USER_SCRIPTS)
def test_unknown_flag_is_exit_2_with_usage(script):
    proc = bash(REPO / script, "--frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == f"{script}: unknown option: --frobnicate"
    assert "Usage: bash " + script in proc.stderr


def test_setup_in_a_path_with_spaces_then_demo_through_submit(tmp_path):
    """Fresh setup (a real venv), an idempotent second run, then the demo on its environment."""
    shared = tmp_path / "shared fs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMTRAIN_", "VIRTUAL_ENV"))}
    clone = tmp_path / "my repo"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns("workspace", ".llmtrain-home", ".git"))

    first = bash(clone / "setup.sh", "--shared-dir", shared, env=env)
    assert first.returncode == 0, first.stderr
    home = shared / "llmtrain"
    assert f'source "{home}/env.sh"' in first.stdout
    stamp = {p: p.stat().st_mtime_ns for p in [home / "env.sh", home / "venv" / "constraints.txt"]}

    second = bash(clone / "setup.sh", "--shared-dir", shared, env=env, timeout=60)
    assert second.returncode == 0 and "venv is up to date" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp  # nothing rewritten

    probe = bash("-c", f'source "{home}/env.sh" && echo "$LLMTRAIN_HOME|$HF_HOME" && '
                 'python -c "import torch, llmtrain; print(torch.__version__)"', env=env)
    assert probe.stdout.splitlines() == [f"{home}|{home}/cache/huggingface", "2.13.0+cpu"]

    demo = bash(clone / "submit.sh", "--local", "--config", clone / "configs" / "demo.yaml",
                "--set", "train.max_steps=60", "--set", "train.eval_every=30", env=env)
    assert demo.returncode == 0, demo.stderr[-3000:]
    run_dir = home / "runs" / "demo"
    assert demo.stdout.splitlines().count(f"run_dir: {run_dir}") == 2  # before and after training
    train = [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert train[0] > 4.5 and train[-1] < 1.5

    # The Slurm path from the same spaced paths: the exact command, every path one argument.
    if shutil.which("sbatch"):
        dry = bash(clone / "submit.sh", "--config", clone / "configs" / "demo.yaml", "--dry-run",
                   env=env)
        assert dry.returncode == 0, dry.stderr
        [cmd] = [shlex.split(x) for x in dry.stdout.splitlines() if x.startswith("env ")]
        assert str(clone / "train.slurm") in cmd and f"LLMTRAIN_HOME={home}" in cmd
        assert f"--output={run_dir}/%x-%j.out" in cmd


def test_submit_rejects_a_bad_config_before_starting(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "demo.yaml").read_text().replace("max_steps: 300", "max_stepz: 3"))
    proc = bash(REPO / "submit.sh", "--local", "--config", bad)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["train.max_stepz: unknown key (did you mean 'max_steps'?)",
                                        "train.max_steps: required, no default"]


def test_submit_without_slurm_points_to_local(tmp_path):
    """A machine without sbatch: a PATH holding only the tools submit.sh needs besides Slurm."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname", "basename", "sed", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(tools)}
    proc = bash(REPO / "submit.sh", "--config", REPO / "configs" / "demo.yaml", env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("submit.sh: no Slurm on this machine (sbatch not found); to run "
                                   "here, use: bash submit.sh --local")
