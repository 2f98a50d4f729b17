"""download_data_model.sh with the real huggingface_hub client against a stand-in hub on 127.0.0.1."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import DEMO, REPO, cli, tiny_config
from hub_server import Hub, Repo

SECRET = "hf_secretTOKEN1234567890"


def model_files(tmp: Path) -> dict[str, bytes]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    folder = tmp / "src-model"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=128)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO / "tokenizer").save_pretrained(folder)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def dataset_files() -> dict[str, bytes]:
    import datasets
    buf = io.BytesIO()
    lines = (DEMO / "stories.txt").read_text().splitlines()[:400]
    datasets.Dataset.from_dict({"text": lines}).to_parquet(buf)
    return {"data/train-00000-of-00001.parquet": buf.getvalue(), "README.md": b"# stories\n"}


@pytest.fixture
def hub(tmp_path):
    with Hub() as h:
        h.repos[("model", "org/tiny")] = Repo(model_files(tmp_path))
        h.repos[("dataset", "org/stories")] = Repo(dataset_files())
        yield h


@pytest.fixture
def env(tmp_path, hub):
    """The environment a user has after `source env.sh`, with a private home and the stand-in hub."""
    home = tmp_path / "home"
    home.mkdir()
    real = Path(os.environ["LLMTRAIN_HOME"])
    (home / "env.sh").write_text(f'source "{real}/env.sh"\nexport LLMTRAIN_HOME="{home}"\n'
                                 f'export HF_HOME="{home}/hf"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LLMTRAIN_"))}
    return {**clean, "LLMTRAIN_HOME": str(home), "HF_HOME": str(home / "hf"),
            "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}


@pytest.fixture
def config(tmp_path):
    cfg = tiny_config(data={"dataset": "org/stories"}, train={"max_steps": 2, "warmup_steps": 0,
                                                              "eval_every": 0})
    cfg["model"] = {"name_or_path": "org/tiny"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def download(env, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "download_data_model.sh"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120, **kw)


@pytest.mark.slow  # it trains: `llmtrain train` (a new process) on what it downloaded, offline
def test_fresh_download_then_skip_then_force(env, config, hub):
    first = download(env, "--config", config)
    assert first.returncode == 0, first.stderr
    home = Path(env["LLMTRAIN_HOME"])
    model, data = home / "models" / "org" / "tiny", home / "datasets" / "org" / "stories"
    marker = json.loads((model / ".llmtrain-download.json").read_text())
    assert marker["commit"] == hub.repos[("model", "org/tiny")].sha and marker["revision"] == "main"
    assert (data / "data" / "train-00000-of-00001.parquet").is_file()
    assert not list(home.glob("*/org/.*.tmp-*"))

    # Offline from here on: the config validates, prepares and trains from the downloaded files.
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    run = lambda *a: subprocess.run(["llmtrain", *map(str, a)], capture_output=True, text=True, env=offline)
    assert run("check-config", config, "--offline").returncode == 0
    assert run("prepare", "--config", config).returncode == 0
    trained = run("train", "--config", config)
    assert trained.returncode == 0, trained.stderr

    gets = {k: r.gets for k, r in hub.repos.items()}
    second = download(env, "--config", config)
    assert second.returncode == 0 and "model org/tiny: up to date" in second.stdout
    assert {k: r.gets for k, r in hub.repos.items()} == gets  # nothing fetched again

    forced = download({**env, "FORCE_REFRESH": "1"}, "--config", config)
    assert forced.returncode == 0
    assert hub.repos[("model", "org/tiny")].gets == 2 * gets[("model", "org/tiny")]


def test_interrupted_download_is_never_taken_for_complete(env, config, hub):
    repo = hub.repos[("model", "org/tiny")]
    repo.files["extra-weights.bin"] = os.urandom(4 << 20)  # 64 chunks, served in ~3 s
    repo.slow = 0.05
    proc = subprocess.Popen(["bash", str(REPO / "download_data_model.sh"), "--config", str(config)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    models = Path(env["LLMTRAIN_HOME"]) / "models" / "org"
    deadline = time.monotonic() + 60
    # huggingface_hub holds a lock beside each file it downloads: the slow one's is under way
    while not list(models.glob(".tiny.tmp-*/.cache/huggingface/download/extra-weights.bin.lock")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (models / "tiny").exists()  # only the temporary folder: not a model

    repo.slow = 0
    again = download(env, "--config", config)
    assert again.returncode == 0, again.stderr
    assert (models / "tiny" / "extra-weights.bin").read_bytes() == repo.files["extra-weights.bin"]


def test_two_concurrent_downloads_of_one_repo(env, config, hub):
    procs = [subprocess.Popen(["bash", str(REPO / "download_data_model.sh"), "--config", str(config)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("model org/tiny: up to date" in out for out, _ in outs) == 1  # the other waited
    repo = hub.repos[("model", "org/tiny")]
    assert repo.gets == len(repo.files)  # every file fetched once
    model = Path(env["LLMTRAIN_HOME"]) / "models" / "org" / "tiny"
    assert all((model / name).read_bytes() == data for name, data in repo.files.items())


def test_gated_model_uses_the_token_and_never_prints_it(env, config, hub):
    hub.repos[("model", "org/tiny")].token = SECRET
    denied = download(env, "--config", config)
    assert denied.returncode == 1
    assert denied.stderr.strip().splitlines()[-1].startswith("error: model org/tiny is gated")

    ok = download({**env, "HF_TOKEN": SECRET}, "--config", config)
    assert ok.returncode == 0, ok.stderr
    assert f"Bearer {SECRET}" in hub.repos[("model", "org/tiny")].seen_auth
    home = Path(env["LLMTRAIN_HOME"])
    for text in (ok.stdout, ok.stderr, denied.stdout, denied.stderr,
                 *(p.read_text(errors="ignore") for p in home.rglob("*.json"))):
        assert SECRET not in text


def test_flags_and_env_override_the_config(env, config, hub):
    hub.repos[("model", "other/model")] = Repo(hub.repos[("model", "org/tiny")].files)
    hub.repos[("dataset", "org/other")] = Repo(hub.repos[("dataset", "org/stories")].files)
    out = download({**env, "MODEL_NAME": "other/model", "ALLOW_PATTERNS": "*.json"}, "--config", config)
    assert out.returncode == 0, out.stderr
    got = Path(env["LLMTRAIN_HOME"]) / "models" / "other" / "model"
    assert sorted(p.name for p in got.iterdir() if not p.name.startswith(".")) == sorted(
        n for n in hub.repos[("model", "other/model")].files if n.endswith(".json"))
    assert not (Path(env["LLMTRAIN_HOME"]) / "models" / "org").exists()
    # The model's patterns leave the config's dataset whole; the dataset's own patterns filter it.
    data = Path(env["LLMTRAIN_HOME"]) / "datasets" / "org" / "stories"
    assert (data / "data" / "train-00000-of-00001.parquet").is_file() and (data / "README.md").is_file()
    out = download(env, "--config", config, "--dataset", "org/other", "--dataset-allow-pattern", "data/*")
    assert out.returncode == 0, out.stderr
    got = Path(env["LLMTRAIN_HOME"]) / "datasets" / "org" / "other"
    assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()
                  and not p.name.startswith(".")) == ["data/train-00000-of-00001.parquet"]


def test_no_network_is_one_line_and_leaves_no_empty_folder(env, tmp_path):
    """A hub that cannot be reached (a closed port on 127.0.0.1): one line naming it, exit 1."""
    import socket
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = download({**env, "HF_ENDPOINT": f"http://127.0.0.1:{port}"}, "--model", "org/tiny")
    assert proc.returncode == 1
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == [f"error: model org/tiny: cannot reach the hub at http://127.0.0.1:{port} "
                     f"(ConnectError); download on a machine with internet (the login node), or "
                     f"check HF_ENDPOINT and the proxy settings"], proc.stderr
    home = Path(env["LLMTRAIN_HOME"])
    assert not (home / "models" / "org").exists()
    assert not [p for p in home.rglob("*") if p.is_dir() and not any(p.iterdir())
                and p.name not in ("models", "datasets")]


def test_the_estimate_needs_only_the_config_files_and_names_their_download(env, config, hub):
    """`llmtrain estimate` reads the model's config.json, not its weights (~140 GB for Llama 3
    70B): with nothing on disk its one line names the download of the config and tokenizer
    files alone; that fetches those top-level files (no weights, not Meta's original/ copy, no
    dataset) and the estimate counts the parameters the weight file holds. Such a folder is not
    a model to train from, and a full download later fetches the weights."""
    from safetensors.torch import load
    repo = hub.repos[("model", "org/tiny")]
    repo.files["original/consolidated.00.pth"] = os.urandom(64 << 10)
    repo.files["original/tokenizer.model"] = b"spm"
    # tp 2 on the slurm section's 2 processes: the download checks the config for those, not
    # for 1 process (which refused configs/llama3-70b.yaml's tp 8 before anything was fetched)
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "parallel": {"tp": 2}}))
    home = Path(env["LLMTRAIN_HOME"])
    folder = home / "models" / "org" / "tiny"
    offline = {"LLMTRAIN_HOME": str(home), "HF_HUB_OFFLINE": "1"}

    missing = cli("estimate", "--config", config, env=offline)
    assert missing.returncode == 1
    command = f"bash download_data_model.sh --config {config} --config-only"
    assert missing.stderr.splitlines() == [
        f"error: model.name_or_path: org/tiny is not on disk (looked in {folder}); the estimate "
        f"needs only its config files, not the weights: {command}"]

    got = download(env, *command.split()[2:])
    assert got.returncode == 0, got.stderr
    fetched = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and p.name != ".llmtrain-download.json"}
    assert sorted(fetched) == ["config.json", "generation_config.json", "tokenizer.json",
                               "tokenizer_config.json"]
    assert repo.gets == len(fetched) and sum(fetched.values()) < 25_000  # the weights: 170 KB
    assert not (home / "datasets").exists()
    est = cli("estimate", "--config", config, env=offline)
    params = sum(t.numel() for t in load(repo.files["model.safetensors"]).values())
    assert est.returncode == 0, est.stderr
    assert est.stdout.startswith(f"llama: {params:,} parameters ({params:,} trainable)")

    # Not a model to train: check-config says so, submit (--offline's checks) refuses.
    no_weights = (f"model.name_or_path: org/tiny has no weights yet (no model.safetensors, "
                  f"pytorch_model.bin or index of either in {folder}); run: bash "
                  f"download_data_model.sh --config {config}")
    check = cli("check-config", config, env=offline)
    assert check.returncode == 0 and f"note: {no_weights}" in check.stderr.splitlines()
    check = cli("check-config", config, "--offline", env=offline)
    assert check.returncode == 2 and no_weights in check.stderr.splitlines()

    full = download(env, "--config", config)
    assert full.returncode == 0, full.stderr
    assert (folder / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
    assert no_weights not in cli("check-config", config, env=offline).stderr
    again = download(env, "--config", config, "--config-only")  # never replaces the weights by less
    assert again.returncode == 0 and "model org/tiny: up to date" in again.stdout
    assert (folder / "model.safetensors").is_file()
