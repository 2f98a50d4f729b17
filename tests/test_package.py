"""What pyproject.toml promises matches what the code needs."""

from __future__ import annotations

import re
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
