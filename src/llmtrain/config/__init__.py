"""config.yaml -> typed, frozen dataclasses, with every problem reported at once.

    cfg = load_config("config.yaml", overrides=["train.lr=1e-4"])

No torch is imported, so `llmtrain check-config` answers on a login node in well under a second.
Problems are collected (unknown keys with a did-you-mean, wrong types, bad values, cross-field
rules, what the disk lacks) and raised together as one ConfigError whose lines read
`section.key: problem (got X)`. The parts: schema.py (the sections and their keys), load.py
(YAML, overrides, types, paths), rules.py (values and keys together, no file read),
environment.py (the disk and the installed packages).

Paths: `${VAR}` is expanded from the environment, `~` is the home directory, and a relative
path is relative to the config file's folder. A model or dataset that is not a path
(`HuggingFaceTB/SmolLM2-135M`) is a hub id, looked up where download_data_model.sh puts it:
`$LLMTRAIN_HOME/models/<id>` and `$LLMTRAIN_HOME/datasets/<id>`.
"""

from .load import load_config
from .rules import slurm_seconds
from .schema import (Config, ConfigError, DataConfig, LoraSpec, MetricsConfig, ModelConfig, ParallelConfig,
                     ProfileConfig, RunConfig, SlurmConfig, TrainConfig, UserError, WandbSpec, dump_yaml,
                     parse_ranks)

__all__ = ["Config", "ConfigError", "DataConfig", "LoraSpec", "MetricsConfig", "ModelConfig", "ParallelConfig",
           "ProfileConfig", "RunConfig", "SlurmConfig", "TrainConfig", "UserError", "WandbSpec", "dump_yaml",
           "load_config", "parse_ranks", "slurm_seconds"]
