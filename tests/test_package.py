"""What pyproject.toml promises matches what the code needs; what the login node imports."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import torch

from conftest import REPO

MIN_TORCH = (2, 11)  # FSDP2 fully_shard, DCP staging/async_save, _set_pg_timeout; the GPU image


def test_the_declared_torch_lower_bound_is_the_oldest_torch_the_code_runs_on():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"torch\b", d)]
    lower = re.search(r">=\s*([\d.]+)", spec).group(1)
    assert tuple(int(x) for x in lower.split(".")[:2]) == MIN_TORCH, spec
    assert tuple(int(x) for x in torch.__version__.split(".")[:2]) >= MIN_TORCH


# What runs on a login node: the CLI and config, the run directory's files, metrics reading, the
# trackers' module, the leaves they stand on, and everything under llmtrain/login/ (the plot,
# the estimator and the bench among them). None may import torch (seconds on a busy login node, and a
# broken CUDA install there must not matter).
def login_modules() -> list[str]:
    pkg = REPO / "src" / "llmtrain"
    return (["llmtrain.cli", "llmtrain.config", "llmtrain.rundir", "llmtrain.metrics", "llmtrain.tracking",
             "llmtrain.errors", "llmtrain.files", "llmtrain.optimizers", "llmtrain.data.sources",
             "llmtrain.parallel.dims", "llmtrain.parallel.world"]
            + [f"llmtrain.login.{p.stem}" for p in sorted((pkg / "login").glob("*.py"))])


def test_nothing_the_login_node_runs_imports_torch():
    modules = login_modules()
    assert "llmtrain.login.status" in modules and "llmtrain.login.download" in modules
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m + ' imports torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-500:]

