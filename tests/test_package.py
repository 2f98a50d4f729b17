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
             "llmtrain.errors", "llmtrain.files", "llmtrain.gpus", "llmtrain.optimizers", "llmtrain.data.sources",
             "llmtrain.parallel.dims", "llmtrain.parallel.tensor", "llmtrain.parallel.world"]
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



# The package's layers, lowest first (doc/architecture.md, "Modules"): a module imports only from
# lower layers, or from its own folder (its own module for a top-level one). Lazy imports count.
LAYERS = [
    ["errors", "files", "gpus", "optimizers", "data.sources", "parallel.tensor", "model.moe"],  # the leaves
    ["parallel.dims"],  # the layout, on the tensor-parallel plans
    ["rundir", "metrics"],
    ["config"],
    ["data", "tracking"],
    ["model"],
    ["parallel"],
    ["training", "login"],
    ["cli"],
    ["", "__main__"],  # the package's face (llmtrain.submit) and `python -m llmtrain`
]


def imports_of_the_package() -> dict[str, set[str]]:
    """llmtrain's modules (names without `llmtrain.`) -> the llmtrain modules each imports."""
    import ast
    root = REPO / "src" / "llmtrain"
    graph = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("llmtrain")):
                base = (package[:len(package) - node.level + 1] if node.level
                        else node.module.split(".")[1:])
                target = base + (node.module.split(".") if node.level and node.module else [])
                for alias in node.names:  # `from . import x` may name a module
                    sub = target + [alias.name]
                    is_module = (root.joinpath(*sub).with_suffix(".py").exists() or root.joinpath(*sub).is_dir())
                    found.add(".".join(sub if is_module else target))
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix("llmtrain").lstrip(".") for a in node.names
                          if a.name.split(".")[0] == "llmtrain"}
        graph[name] = found - {name}
    return graph


def place(module: str) -> tuple[int, str]:
    """(layer, the folder or top-level module it belongs to) of a module name."""
    best = max((entry for layer in LAYERS for entry in layer
                if module == entry or module.startswith(entry + ".") or entry == ""), key=len)
    [layer] = [i for i, entries in enumerate(LAYERS) if best in entries]
    return layer, best


def test_every_import_goes_down_the_layers_and_none_goes_round():
    graph = imports_of_the_package()
    assert {"config.rules", "training.loop", "parallel.dims", "data.tokenizer"} <= set(graph)
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
              if place(t)[0] > place(m)[0] or (place(t)[0] == place(m)[0] and place(t)[1] != place(m)[1])]
    assert upward == [], upward
    # No circle among modules (within a folder too): a depth-first search finds no back edge.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            assert state.get(t) != 1, " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2
    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    # config's schema and rules stand on the leaves and the layout alone (the disk's checks are
    # environment.py's).
    leaves = set(LAYERS[0]) | {"parallel.dims"}
    assert graph["config.schema"] <= leaves and graph["config.rules"] <= leaves | {"config.schema"}


def test_no_function_imports_a_dotted_module_without_as():
    """`import torch._inductor.config` inside a function binds the name `torch` local to the
    whole function, so a use of `torch` above it fails (UnboundLocalError), on the path that
    reaches it only: the GPU path of float8.convert did, on the first GPU run. `from torch._inductor
    import config` or `import torch.distributed as dist` binds no such name."""
    import ast
    found = []
    for path in sorted((REPO / "src" / "llmtrain").rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(REPO)}:{node.lineno}: import {alias.name}"
                          for node in ast.walk(fn) if isinstance(node, ast.Import)
                          for alias in node.names if "." in alias.name and alias.asname is None]
    assert not found, "\n".join(found)
