"""Planning before and around runs: the scaling table (llmtrain bench). The feasibility check of
a Slurm request is in test_slurm.py (it needs the test cluster) and test_sbatch.py (sinfo's lines)."""

from __future__ import annotations

import statistics

import pytest

from conftest import cli, prepared_home, read_metrics, tiny_config


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    with prepared_home(tmp_path_factory, "plan", tiny_config()) as prepared:
        yield prepared


@pytest.mark.slow
def test_the_scaling_table_for_one_and_two_processes_is_the_runs_own_figures(plan):
    root, config = plan
    proc = cli("bench", "--config", config, "--nprocs", "1,2", "--steps", "6", "--warmup", "2", check=True)
    header, rule, *rows = proc.stdout.splitlines()
    assert header == ("| processes | tokens/s | tokens/s per process | peak memory per process (GiB) | "
                      "scaling efficiency |")
    assert len(rows) == 2 and proc.stderr.splitlines() == ["bench: 1 process, 6 steps ...",
                                                           "bench: 2 processes, 6 steps ..."]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    runs = root / "home" / "runs" / "test-scaling"
    speeds = {}
    for n, (procs, tps, per, mem, eff) in zip((1, 2), cells):
        train = [r for r in read_metrics(runs / f"{n}p") if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, 7))  # a fresh run of 6 steps, nothing saved
        speeds[n] = statistics.median(r["tokens_per_sec"] for r in train if r["step"] > 2)
        assert (procs, tps, per, mem) == (str(n), f"{speeds[n]:,.0f}", f"{speeds[n] / n:,.0f}",
                                          f"{max(r['peak_mem_gib'] for r in train):.2f}")
        assert not (runs / f"{n}p" / "checkpoints" / "latest").exists()
    assert cells[0][4] == "100%" and cells[1][4] == f"{speeds[2] / 2 / speeds[1]:.0%}"


def test_a_process_count_the_batch_does_not_divide_is_one_line(plan):
    _, config = plan
    proc = cli("bench", "--config", config, "--nprocs", "1,3")
    assert (proc.returncode, proc.stderr) == (2, "train.global_batch_size: must be divisible by "
                                                 "micro_batch_size x world size = 4 x 3 = 12 (got 8)\n")
    assert not proc.stdout
