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


def run_name(argv: list[str]) -> str:
    """The run.name a `bash submit.sh ...` line trains: its config and its --set overrides."""
    config = REPO / argv[argv.index("--config") + 1]
    sets = [x for i, a in enumerate(argv) if a == "--set" for x in ("--set", argv[i + 1])]
    return llmtrain("check-config", config, *sets, "--get", "run.name", check=True).stdout.strip()


def test_the_cluster_example_trains_a_run_of_its_own():
    """Submitting the quickstart's run name again resumes that finished run: nothing trains."""
    [quickstart] = [c for c in commands(REPO / "README.md", "bash submit.sh --local")
                    if "configs/demo.yaml" in c]
    cluster = [c for c in commands(REPO / "doc" / "overview.md", "bash submit.sh")
               if "configs/demo.yaml" in c and "--local" not in c]
    assert cluster, "doc/overview.md has no Slurm example with configs/demo.yaml"
    for command in cluster:
        assert run_name(command) != run_name(quickstart), shlex.join(command)
