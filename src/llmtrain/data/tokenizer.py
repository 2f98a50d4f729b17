"""The run's tokenizer, from its local folder (the model's, or model.tokenizer): what prepare
tokenizes with and what the model's vocabulary is sized from."""

from __future__ import annotations

from pathlib import Path

from ..config import Config, UserError
from .sources import local_path, tokenizer_source


class ModelNotFound(UserError):
    pass


def local_model_dir(value: str, what: str) -> Path:
    """The folder of a model (or tokenizer) key's value, which must be on disk: compute nodes
    download nothing."""
    path = local_path(value, "models")
    if not path.is_dir():
        raise ModelNotFound(
            f"{what}: {value} is not on disk (looked in {path}); download it on the login node "
            f"with: bash download_data_model.sh"
        )
    return path


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(local_model_dir(tokenizer_source(cfg), "model.tokenizer"))
