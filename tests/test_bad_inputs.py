"""Bad input never hurts: one line naming the problem and the fix, a non-zero exit, no
traceback, and nothing half-written (or a run that stays resumable). One row per mistake."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import cli, llmtrain, losses, prepared_home, read_metrics, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A home with the tiny config's data prepared and one finished 4-step run to resume. Each
    xdist worker has its own; once the module's tests on a worker are done, whichever of the
    rows below it ran, the run they were aimed at must still resume (finished_run_resumes)."""
    cfg = tiny_config(train={"max_steps": 4, "warmup_steps": 1, "checkpoint_every": 2})
    with prepared_home(tmp_path_factory, "bad", cfg) as (root, config):
        cli("train", "--config", config, "--set", "run.name=done", check=True)
        yield root, config
        finished_run_resumes(root, config)


def finished_run_resumes(root, good) -> None:
    """After the rows (however many of them this worker ran) the run they were aimed at resumes:
    the trainer loads its step-4 checkpoint, has nothing left to train, and its curve is unchanged."""
    run_dir = root / "home" / "runs" / "done"
    curve = losses(run_dir)
    proc = cli("train", "--config", good, "--set", "run.name=done")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {run_dir}/checkpoints/step-00000004 (step 4, saved by 1 ranks" in proc.stdout
    assert "done: 4 steps" in proc.stdout
    assert losses(run_dir) == curve and [s for k, s, _ in curve if k == "train"] == [1, 2, 3, 4]


# (id, command builder, exit code, the exact stderr line: a regex, fully matched)
# The builder gets (root, good config, tmp_path) and returns the llmtrain arguments.
def cfg_with(tmp_path, **sections) -> Path:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny_config(**sections)))
    return path


def text_cfg(tmp_path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def adapter_dir(tmp_path) -> Path:
    """What a LoRA run's export writes (peft's adapter files), without the base's config.json."""
    folder = tmp_path / "adapters"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return folder


def nonempty_dir(tmp_path) -> Path:
    """A folder of the user's that already holds a file: export must not write into it."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine\n")
    return taken


def dataset_cfg(tmp_path, name: str, content: str, **data) -> Path:
    src = tmp_path / name
    src.write_text(content)
    return cfg_with(tmp_path, data={"dataset": str(src), **data})


ROWS = [
    ("unknown-key", lambda r, g, t: ["check-config", cfg_with(t, train={"max_step": 4})], 2,
     r"train\.max_step: unknown key \(did you mean 'max_steps'\?\)"),
    ("unknown-section", lambda r, g, t: ["check-config", text_cfg(t, g.read_text() + "modle: {}\n")], 2,
     r"modle: unknown section \(did you mean 'model'\?\)"),
    ("malformed-yaml", lambda r, g, t: ["check-config", text_cfg(t, "train: {max_steps: 4\n")], 2,
     r".*bad\.yaml: line \d+ is not valid YAML \(.+\)"),
    ("not-a-mapping", lambda r, g, t: ["check-config", text_cfg(t, "- 1\n- 2\n")], 2,
     r".*bad\.yaml: must be a mapping of sections \(got list\)"),
    ("wrong-int", lambda r, g, t: ["check-config", cfg_with(t, train={"max_steps": "4k"})], 2,
     r"train\.max_steps: must be an integer \(got '4k'\)"),
    ("wrong-bool", lambda r, g, t: ["check-config", cfg_with(t, train={"async_checkpoint": "yes please"})], 2,
     r"train\.async_checkpoint: must be true or false \(got 'yes please'\)"),
    ("bad-choice", lambda r, g, t: ["check-config", cfg_with(t, parallel={"strategy": "deepspeed"})], 2,
     r"parallel\.strategy: must be one of ddp, fsdp, hsdp \(got 'deepspeed'\)"),
    ("batch-split", lambda r, g, t: ["check-config", cfg_with(t, train={"global_batch_size": 6})], 2,
     r"train\.global_batch_size: must be divisible by micro_batch_size x world size = 4 x 2 = 8 \(got 6\)"),
    ("warmup", lambda r, g, t: ["check-config", cfg_with(t, train={"warmup_steps": 9, "max_steps": 9})], 2,
     r"train\.warmup_steps: must be < train\.max_steps \(got 9 >= 9\)"),
    ("seq-len", lambda r, g, t: ["check-config", cfg_with(t, data={"seq_len": 1024})], 2,
     r"data\.seq_len: must be <= the model's max_position_embeddings \(got 1024 > 128\)"),
    ("tokenizer-vocab", lambda r, g, t: ["check-config", cfg_with(t, model={"architecture": {
        **tiny_config()["model"]["architecture"], "vocab_size": 256}})], 2,
     r"model\.tokenizer: vocabulary of 479 tokens does not fit the model's vocab_size 256"),
    ("unknown-optimizer-of-a-run", lambda r, g, t: ["check-config", "--config", g, "--set", "run.name=done",
                                                    "--set", "train.optimizer=adam"], 2,
     r"train\.optimizer: unknown 'adam'; one of: adamw, lion, muon, adamw_schedulefree"),  # no resume mismatch
    ("tp-zero", lambda r, g, t: ["check-config", cfg_with(t, parallel={"strategy": "fsdp", "tp": 0})], 2,
     r"parallel\.tp: must divide the world size 2 \(got 0\)"),
    ("heads-split-hidden", lambda r, g, t: ["check-config", cfg_with(t, model={"architecture": {
        **tiny_config()["model"]["architecture"], "num_attention_heads": 3, "num_key_value_heads": 1}})], 2,
     r"model\.architecture: hidden_size must be a multiple of num_attention_heads \(got 64 and 3\); each head "
     r"takes hidden_size / num_attention_heads features, or set head_dim"),
    ("no-heads", lambda r, g, t: ["check-config", cfg_with(t, model={"architecture": {
        **tiny_config()["model"]["architecture"], "num_attention_heads": 0}})], 2,
     r"model\.architecture: num_attention_heads must be >= 1 \(got 0\)"),
    ("layer-kind", lambda r, g, t: ["check-config", cfg_with(t, model={"architecture": {
        **tiny_config()["model"]["architecture"], "model_type": "qwen2",
        "layer_types": ["chunked_attention", "full_attention"]}})], 2,
     r"model\.architecture\.layer_types: layers of kind chunked_attention, which llmtrain's attention cannot "
     r"honour \(it attends as full_attention and sliding_attention layers do\); choose a model without them"),
    ("missing-dataset", lambda r, g, t: ["check-config", cfg_with(t, data={"dataset": "./gone.txt"})], 2,
     r"data\.dataset: no such file or folder \(got '\./gone\.txt', resolved to /.*/gone\.txt\)"),
    ("keep-one", lambda r, g, t: ["check-config", cfg_with(t, train={"keep_checkpoints": 1})], 2,
     r"train\.keep_checkpoints: must be >= 2, so a damaged newest checkpoint has a fallback \(got 1\)"),
    ("resume-path", lambda r, g, t: ["check-config", cfg_with(t, train={"resume": "/nonexistent/ckpt"})], 2,
     r"train\.resume: must be auto, none, or a checkpoint folder \(got '/nonexistent/ckpt'\)"),
    ("bad-override", lambda r, g, t: ["check-config", g, "--set", "train.max_steps"], 2,
     r"--set train\.max_steps: expected section\.key=value"),
    ("no-config", lambda r, g, t: ["check-config", t / "nope.yaml"], 2,
     r".*nope\.yaml: no such config file"),
    ("model-not-downloaded", lambda r, g, t: ["prepare", "--config", text_cfg(t, yaml.safe_dump(
        {**tiny_config(), "model": {"name_or_path": "org/absent"}}))], 1,
     r"error: model\.tokenizer: org/absent is not on disk \(looked in .*\); download it on the "
     r"login node with: bash download_data_model\.sh"),
    ("empty-dataset", lambda r, g, t: ["prepare", "--config", dataset_cfg(t, "empty.txt", "")], 1,
     r"error: data\.dataset: .*/empty\.txt is empty; point it at a file with documents"),
    ("no-text-column", lambda r, g, t: ["prepare", "--config", dataset_cfg(
        t, "docs.jsonl", "\n".join(json.dumps({"body": f"story {i}"}) for i in range(200)))], 2,
     r"data\.text_field: no column 'text' in .*/docs\.jsonl \(columns: body\)"),  # before any job
    ("unknown-format", lambda r, g, t: ["prepare", "--config", dataset_cfg(t, "docs.xyz", "a b c\n")], 1,
     r"error: data\.dataset: unknown file type '\.xyz'; use one of \.txt, \.jsonl, \.json, \.parquet, \.csv, \.arrow"),
    ("unreadable-jsonl", lambda r, g, t: ["prepare", "--config", dataset_cfg(t, "broken.jsonl", "{not json\n")], 2,
     r"data\.dataset: cannot read .*/broken\.jsonl as jsonl \(JSONDecodeError\)"),
    ("unwritable-prepared-dir", lambda r, g, t: ["prepare", "--config", cfg_with(
        t, data={"prepared_dir": "/proc/llmtrain-prepared"})], 1,
     r"error: data\.prepared_dir: cannot create /proc/llmtrain-prepared \(.+\); choose a writable folder"),
    ("unprepared", lambda r, g, t: ["train", "--config", cfg_with(t, data={"validation_fraction": 0.05})], 1,
     r"error: data: .* is not prepared for this tokenizer and settings \(expected .*\); run: llmtrain "
     r"prepare --config .*bad\.yaml \(with the same --set options\)"),
    ("unwritable-run-dir", lambda r, g, t: ["train", "--config", g, "--set", "run.dir=/proc/llmtrain-runs"], 1,
     r"error: run\.dir: cannot create /proc/llmtrain-runs/test \(.+\); choose a writable folder on the "
     r"shared filesystem"),
    ("other-architecture", lambda r, g, t: ["train", "--config", g, "--set", "run.name=done",
                                            "--set", "model.architecture.num_hidden_layers=3"], 1,
     r"error: checkpoint .*/step-00000004 does not match this config: model differs \(num_hidden_layers: "
     r"2 -> 3\); use a new run\.name, or set train\.resume: none to start over"),
    ("other-seq-len", lambda r, g, t: ["train", "--config", g, "--set", "run.name=done",
                                       "--set", "data.seq_len=32"], 2,  # known before any job starts
     r"train\.resume: checkpoint .*/step-00000004 does not match this config: seq_len differs "
     r"\(64 -> 32\); use a new run\.name, or set train\.resume: none to start over"),
    ("other-optimizer", lambda r, g, t: ["train", "--config", g, "--set", "run.name=done",
                                         "--set", "train.optimizer=lion"], 2,  # AdamW's state is not Lion's
     r"train\.resume: checkpoint .*/step-00000004 does not match this config: optimizer differs "
     r"\('adamw' -> 'lion'\); use a new run\.name, or set train\.resume: none to start over"),
    ("export-over-files", lambda r, g, t: ["export", "--run-dir", r / "home" / "runs" / "done",
                                           "--out", nonempty_dir(t)], 1,
     r"error: --out: .* exists and is not empty; choose a new folder"),
    ("export-no-checkpoint", lambda r, g, t: ["export", "--run-dir", t, "--out", t / "o", "--step", "7"], 1,
     r"error: no step 7 in .*/checkpoints"),
    ("generate-not-a-model", lambda r, g, t: ["generate", "--model", t, "--prompt", "hi"], 1,
     r"error: --model: .* is not a Hugging Face model folder \(no config\.json\)"),
    ("generate-an-adapter", lambda r, g, t: ["generate", "--model", adapter_dir(t), "--prompt", "hi"], 1,
     r"error: --model: .* holds LoRA adapters, not a model; generate from the run \(--run-dir RUN_DIR\), or pass "
     r"a merged export \(llmtrain export --run-dir RUN_DIR --merge\)"),
    ("status-no-such-run", lambda r, g, t: ["status", t / "nope"], 1,
     r"error: .*/nope: no such run directory, not a job id; give the run directory, "
     r"<run.dir>/<run.name>, or --config FILE for its run.dir"),
    ("control-not-running", lambda r, g, t: ["control", t, "stop"], 1,
     r"error: .*: not running \(not started: no job and no step logged yet\); nothing to stop"),
    ("plot-nothing-yet", lambda r, g, t: ["plot", t], 1,
     r"error: .*: nothing to plot yet \(no step in .*/metrics\.jsonl\); wait for the first logged step "
     r"\(train\.log_every\)"),
    ("bench-indivisible", lambda r, g, t: ["bench", "--config", g, "--nprocs", "1,3"], 2,
     r"train\.global_batch_size: must be divisible by micro_batch_size x world size = \d+ x 3 = \d+ \(got \d+\)"),
    ("estimate-bad-gpu", lambda r, g, t: ["estimate", "--config", g, "--gpu-mem", "0"], 1,
     r"error: --gpu-mem: must be a GPU's memory in GiB, > 0 \(got 0\.0\)"),
    ("plan-unknown-gpu", lambda r, g, t: ["plan", "--config", g, "--gpu", "k80"], 1,
     r"error: --gpu: 'k80' is not a GPU the planner knows \(H100 NVL, .*, MI300X\); name one of those"),
    ("submit-no-process", lambda r, g, t: ["submit", "--config", g, "--local", "--nproc", "0"], 1,
     r"error: --nproc: must be a positive integer \(got 0\)"),
    ("sweep-slurm-key", lambda r, g, t: ["sweep", "--config", g, "--local", "--grid", "slurm.nodes=1,2"], 2,
     r"--grid slurm\.nodes: a sweep's points share one job array .*; sweep this key as separate sweeps"),
    ("sweep-status-not-a-sweep", lambda r, g, t: ["sweep-status", t], 1,
     r"error: .*: not a sweep directory \(no sweep\.json\); it is <run\.dir>/<run\.name>-sweep, which "
     r"llmtrain sweep prints"),
    ("download-nothing", lambda r, g, t: ["download", "--config", g], 1,  # local paths only
     r"error: nothing to download: the config names no hub ids \(only local paths\); or pass "
     r"--model / --dataset"),
]


@pytest.mark.parametrize("build,code,line", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_and_harmless(world, tmp_path, build, code, line):
    """Each command in this process (cli): the exit code, the lines on the terminal and the
    files are the user's; a new interpreter per row would only add its torch import."""
    root, good = world
    runs = root / "home" / "runs"
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file()}
    args = build(root, good, tmp_path)
    mine = {p: p.is_file() and p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    proc = cli(*args)
    assert proc.returncode == code, proc.stderr
    progress = re.compile(r".*(examples/s|it/s|ba/s)\]\s*$|\s*$")  # tqdm bars: progress, not errors
    errors = [x for x in proc.stderr.splitlines() if not progress.fullmatch(x)]
    assert len(errors) == 1 and re.fullmatch(line, errors[0]), proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing new or changed in any run directory but the logs of a refused start.
    after = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file()}
    changed = {p for p in after if before.get(p) != after[p] and "logs" not in p.parts}
    assert not changed, changed
    assert not list((root / "home").rglob("*.tmp-*"))
    # The user's own files (configs, datasets, a folder export refused) as they were, none added.
    assert {p: p.is_file() and p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == mine


def test_every_command_in_the_help_has_a_row(tmp_path):
    """The commands `llmtrain --help` shows a user each have a mistake above (sbatch-command and
    requeue, submit.sh's and train.slurm's plumbing, are not shown: tests/test_sbatch.py,
    test_scripts.py)."""
    helped = cli("--help", check=True).stdout
    listed = set(re.findall(r"^ {4}([a-z][a-z-]+)(?: |$)", helped, re.MULTILINE))
    assert {"check-config", "train"} <= listed and not {"sbatch-command", "requeue"} & listed, helped
    good = cfg_with(tmp_path / "good")  # what the builders read; their files go to row folders
    covered = set()
    for i, (_, build, _, _) in enumerate(ROWS):
        (tmp_path / f"row{i}").mkdir()
        covered.add(str(build(tmp_path, good, tmp_path / f"row{i}")[0]))
    assert covered == listed | {"sweep-status"}  # `llmtrain sweep status`, shown under sweep


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(world, tmp_path):
    """A 3 MiB filesystem: the first checkpoint (1.6 MB) fits, the second does not."""
    root, good = world
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)]).returncode:
        pytest.fail("cannot mount a tmpfs (this test needs root)")
    try:
        # Separate processes: none of this one's files stays open on the mount (umount below).
        proc = llmtrain("train", "--config", good, "--set", f"run.dir={mount}", "--set", "run.name=full",
                        "--set", "train.max_steps=6", "--set", "train.eval_every=0")
        assert proc.returncode == 1
        [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert line == (f"error: checkpoint step-00000004 could not be written (No space left on device); "
                        f"step-00000002 is intact; free space in {mount}/full/checkpoints and start the "
                        f"run again")
        ckpts = mount / "full" / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002"]
        assert (ckpts / "latest").read_text().strip() == "step-00000002"
        # The surviving checkpoint is whole: it loads (and exports, off the full disk).
        llmtrain("export", "--run-dir", mount / "full", "--out", tmp_path / "hf", check=True)
        assert [r["step"] for r in read_metrics(mount / "full")][-1] <= 4
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
