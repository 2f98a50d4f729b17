"""llmtrain: train and fine-tune Hugging Face causal LMs with DDP, FSDP2 or HSDP, times tensor and
context parallel, from a laptop to a Slurm cluster. The package imports no torch at the top level (see cli.py)."""

__version__ = "0.1.0"


def submit(config, overrides=(), **options):
    """Validate a run and queue it on Slurm, as `bash submit.sh` does; returns a Job (job_id,
    run_dir, log, state(), metrics(), wait()). Options: dependency, sbatch_args, dry_run, script.
    Needs the environment setup.sh wrote (LLMTRAIN_HOME, LLMTRAIN_REPO). See login/submit.py."""
    from .login.submit import submit as queue
    return queue(config, overrides, **options)


def preset(name: str):
    """The path of a ready config, configs/presets/NAME.yaml of the repo setup.sh recorded
    (LLMTRAIN_REPO), else of this checkout: `llmtrain.submit(llmtrain.preset("llama3-8b"),
    ["slurm.nodes=2"])` is `bash submit.sh --preset llama3-8b --nodes 2`."""
    import os
    from pathlib import Path

    from .config import UserError
    folder = Path(os.environ.get("LLMTRAIN_REPO") or Path(__file__).resolve().parents[2]) / "configs" / "presets"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise UserError(f"preset: no preset named {name} ({folder}: {names})")
    return path
