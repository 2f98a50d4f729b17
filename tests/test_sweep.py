"""llmtrain sweep: the grid, the points run one after another here (--local), and the status table.
(On the local Slurm, as one throttled job array: tests/test_slurm.py.)"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import cli, llmtrain, read_metrics, tiny_config
from llmtrain.login.sweep import parse_grid, points


def test_the_grid_is_the_product_of_its_keys_in_the_order_given():
    grid = parse_grid(["train.lr=1e-4,3e-4", "train.warmup_steps=10,50,100"])
    assert points(grid) == [[f"train.lr={lr}", f"train.warmup_steps={w}"]
                            for lr in ("1e-4", "3e-4") for w in ("10", "50", "100")]


@pytest.mark.parametrize("grid,line", [
    (["train.lr"], "--grid train.lr: expected section.key=value,value,... (e.g. --grid train.lr=1e-4,3e-4)"),
    (["train.lr=1e-4,"], "--grid train.lr=1e-4,: expected section.key=value,value,... (e.g. --grid "
                         "train.lr=1e-4,3e-4)"),
    (["slurm.nodes=1,2"], "--grid slurm.nodes: a sweep's points share one job array (its Slurm request) "
                          "and are named <run.name>-<i> in run.dir; sweep this key as separate sweeps"),
    (["train.lr=1e-4", "train.lr=3e-4"], "--grid train.lr: given twice; list all its values in one --grid"),
    (["train.lr=1e-3,fast"], "point 1 (train.lr=fast): train.lr: must be a number (got 'fast')"),
    (["train.lrr=1e-3"], "point 0 (train.lrr=1e-3): train.lrr: unknown key (did you mean 'lr'?)"),
], ids=["no-values", "empty-value", "slurm-key", "twice", "bad-value", "unknown-key"])
def test_a_bad_grid_is_one_line_and_nothing_is_written(tmp_path, write_config, grid, line):
    config = write_config(tiny_config(run={"dir": str(tmp_path / "runs")}))
    proc = cli("sweep", "--config", config, "--local", *(x for g in grid for x in ("--grid", g)))
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [line])
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_local_sweep_trains_each_point_in_turn_and_the_table_shows_them_all(tmp_path, home):
    cfg = tiny_config(run={"name": "lrs", "dir": str(tmp_path / "runs")},
                      data={"prepared_dir": str(tmp_path / "prepared")},
                      train={"max_steps": 2, "eval_every": 2, "checkpoint_every": 0},
                      slurm={"procs_per_node": 1})
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = llmtrain("sweep", "--config", config, "--local", "--grid", "train.lr=1e-3,1e-2,3e-2",
                    "--grid", "train.warmup_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "lrs-sweep"
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["overrides"] for p in record["points"]] == [
        ["train.lr=1e-3", "train.warmup_steps=1"], ["train.lr=1e-2", "train.warmup_steps=1"],
        ["train.lr=3e-2", "train.warmup_steps=1"]]
    table = cli("sweep", "status", sweep_dir, check=True).stdout
    assert table == proc.stdout[proc.stdout.index("sweep: lrs "):]  # as printed at the end
    evals = []
    for i, point in enumerate(record["points"]):
        run_dir = tmp_path / "runs" / f"lrs-{i}"
        trained = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        asked = dict(o.split("=") for o in point["overrides"])
        assert (trained["lr"], trained["warmup_steps"]) == (float(asked["train.lr"]),
                                                            int(asked["train.warmup_steps"]))
        evals.append([r["eval_loss"] for r in read_metrics(run_dir) if r["kind"] == "eval"][-1])
        assert re.search(rf"^\| {i} \| lrs-{i} \| {re.escape(', '.join(point['overrides']))} \| finished "
                         rf"\| 2 \| {evals[-1]:.4f} \|$", table, re.MULTILINE), table
    assert len(set(evals)) == 3  # three different trainings, not one run three times


def test_a_sweep_of_other_points_under_the_same_name_is_refused(tmp_path, write_config):
    """Point i would resume the earlier sweep's run i, trained with other values."""
    config = write_config(tiny_config(run={"name": "lrs", "dir": str(tmp_path / "runs")}))
    record = tmp_path / "runs" / "lrs-sweep" / "sweep.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"name": "lrs", "points": [{"index": 0, "overrides": ["train.lr=1e-3"]}]}))
    proc = cli("sweep", "--config", config, "--local", "--grid", "train.lr=1e-2")
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        f"run.name: a sweep 'lrs' with other points exists ({record}); choose another run.name, or "
        f"give the same --grid to continue it"])
    proc = cli("sweep", "--config", config, "--local", "--dry-run", "--grid", "train.lr=1e-3")
    assert (proc.returncode, proc.stderr) == (1, "error: --dry-run: prints the sbatch lines of a Slurm "
                                                 "sweep; a --local sweep has none\n")
    assert not (tmp_path / "runs" / "lrs-0").exists()


def test_frozen_configs_of_one_process_never_share_a_name():
    from llmtrain.login.submit import stamp
    names = [stamp() for _ in range(3)]
    assert len(set(names)) == 3 and all(re.fullmatch(r"\d{8}-\d{6}-\d+(\.\d+)?", n) for n in names), names
