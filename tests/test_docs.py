"""The walkthrough in README.md and doc/overview.md: its commands do what the text says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO, llmtrain


def commands(doc: Path, start: str) -> list[list[str]]:
    """The command lines in the doc's code blocks that begin with `start`, comments dropped."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", doc.read_text(), re.MULTILINE | re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith(start)]


def run_name(argv: list[str], key: str = "run.name") -> str:
    """The run.name (or another key) a `bash submit.sh ...` line trains: its config and its --set
    overrides."""
    config = REPO / argv[argv.index("--config") + 1]
    sets = [x for i, a in enumerate(argv) if a == "--set" for x in ("--set", argv[i + 1])]
    return llmtrain("check-config", config, *sets, "--get", key, check=True).stdout.strip()


def test_the_cluster_example_trains_a_run_of_its_own():
    """Submitting the quickstart's run name again resumes that finished run: nothing trains."""
    [quickstart] = [c for c in commands(REPO / "README.md", "bash submit.sh --local")
                    if "configs/demo.yaml" in c]
    cluster = [c for c in commands(REPO / "doc" / "overview.md", "bash submit.sh")
               if "configs/demo.yaml" in c and "--local" not in c]
    assert cluster, "doc/overview.md has no Slurm example with configs/demo.yaml"
    for command in cluster:
        assert run_name(command) != run_name(quickstart), shlex.join(command)


def test_the_cluster_example_runs_one_thread_a_core_of_the_demo_box():
    """The local cluster's fake nodes declare 8 CPUs each but share this machine's cores: the
    example's nodes x slurm.cpus_per_node threads (one process a node) fit the 2 cores the demo
    is made for, instead of 8 threads a process (several times slower)."""
    [cluster] = [c for c in commands(REPO / "doc" / "overview.md", "bash submit.sh")
                 if "configs/demo.yaml" in c and "--local" not in c]
    assert cluster[cluster.index("--procs-per-node") + 1] == "1"
    nodes = int(cluster[cluster.index("--nodes") + 1])
    assert nodes * int(run_name(cluster, "slurm.cpus_per_node")) <= 2, shlex.join(cluster)
