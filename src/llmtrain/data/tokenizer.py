"""The run's tokenizer, from its local folder (the model's, or model.tokenizer): what prepare
tokenizes with and what the model's vocabulary is sized from."""

from __future__ import annotations

from pathlib import Path

from ..config import Config, UserError
from .sources import local_path, tokenizer_source


class ModelNotFound(UserError):
    """A model key's folder is missing; `fix` says what to download (the estimate needs less
    than training: its config files alone)."""

    def __init__(self, what: str, value: str, path: Path,
                 fix: str = "download it on the login node with: bash download_data_model.sh"):
        self.what, self.value, self.path, self.fix = what, value, path, fix
        super().__init__(f"{what}: {value} is not on disk (looked in {path}); {fix}")

    def __reduce__(self):  # pickled whole (Exception's default passes only the message)
        return type(self), (self.what, self.value, self.path, self.fix)


def local_model_dir(value: str, what: str) -> Path:
    """The folder of a model (or tokenizer) key's value, which must be on disk: compute nodes
    download nothing."""
    path = local_path(value, "models")
    if not path.is_dir():
        raise ModelNotFound(what, value, path)
    return path


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(local_model_dir(tokenizer_source(cfg), "model.tokenizer"))
