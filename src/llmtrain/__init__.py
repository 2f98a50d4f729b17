"""llmtrain: train and fine-tune Hugging Face causal LMs with DDP, FSDP2 or HSDP, times tensor and
context parallel, from a laptop to a Slurm cluster. The package imports no torch at the top level (see cli.py)."""

__version__ = "0.1.0"


def submit(config, overrides=(), **options):
    """Validate a run and queue it on Slurm, as `bash submit.sh` does; returns a Job (job_id,
    run_dir, log, state(), metrics(), wait()). Options: dependency, sbatch_args, dry_run, script.
    Needs the environment setup.sh wrote (LLMTRAIN_HOME, LLMTRAIN_REPO). See login/submit.py."""
    from .login.submit import submit as queue
    return queue(config, overrides, **options)
