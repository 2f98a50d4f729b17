"""llmtrain: train and fine-tune Hugging Face causal LMs with DDP, FSDP2 or HSDP, from a laptop to a
Slurm cluster. The package imports no torch at the top level (see cli.py)."""

__version__ = "0.1.0"
