"""The run's tokenizer, from its local folder (the model's, or model.tokenizer): what prepare
tokenizes with and what the model's vocabulary is sized from."""

from __future__ import annotations

import functools
import multiprocessing
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


class TextTokenizer:
    """What prepare needs of the run's tokenizer to tokenize plain text: the tokenizers
    library's Tokenizer exactly as transformers' AutoTokenizer builds it (its JSON and the one
    setting the JSON leaves out), and the special tokens. Built in a forked process
    (TokenizerLoad), which imports transformers without torch (without_torch), and prepare's
    own process then imports neither; the load runs while that process reads the source.
    Pickles as JSON whatever the start method of the processes it goes to."""

    def __init__(self, tokenizer):
        self.backend_json = tokenizer.backend_tokenizer.to_str()
        # not in the JSON (tokenizers 0.23): a pickled Tokenizer loses it
        self.encode_special_tokens = tokenizer.backend_tokenizer.encode_special_tokens
        self.is_fast, self.size = tokenizer.is_fast, len(tokenizer)
        self.bos_token, self.bos_token_id = tokenizer.bos_token, tokenizer.bos_token_id
        self.eos_token, self.eos_token_id = tokenizer.eos_token, tokenizer.eos_token_id

    def __len__(self) -> int:
        return self.size

    @functools.cached_property
    def backend_tokenizer(self):
        from tokenizers import Tokenizer
        backend = Tokenizer.from_str(self.backend_json)
        backend.encode_special_tokens = self.encode_special_tokens
        # A tokenizer.json may carry truncation or padding (a fine-tune's saved for its own
        # max_length): the backend would apply them to every document, cutting it silently.
        backend.no_truncation()
        backend.no_padding()
        return backend

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "backend_tokenizer"}


def without_torch() -> None:
    """Make this process's `import transformers` skip torch (~1 s of one core): transformers
    imports torch wherever it finds it, and a tokenizer needs it only to return tensors (which
    prepare never asks for). For a process that loads a tokenizer and nothing else
    (TokenizerLoad's); one that already imported torch keeps it."""
    import os
    import sys
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # importlib's find_spec: not installed
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its "PyTorch was not found" line


class TokenizerLoad:
    """The run's tokenizer as a TextTokenizer, loaded in a forked process while prepare reads the
    source: result() waits for it, cancel() ends the load (a prepare that failed meanwhile). A
    missing folder is reported at once, before the fork."""

    def __init__(self, cfg: Config):
        folder = local_model_dir(tokenizer_source(cfg), "model.tokenizer")
        ctx = multiprocessing.get_context("fork")  # this process's modules: no second import
        self._conn, child = ctx.Pipe(duplex=False)
        # daemon: a prepare that ends with an error does not wait for the load at its exit
        self._proc = ctx.Process(target=_send_text_tokenizer, args=(folder, child), daemon=True)
        self._proc.start()
        child.close()

    def result(self) -> TextTokenizer:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the process loading the tokenizer died (exit code "
                               f"{self._proc.join() or self._proc.exitcode})") from None
        self._proc.join()
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()


def _send_text_tokenizer(folder: Path, conn) -> None:
    without_torch()
    try:
        from transformers import AutoTokenizer
        conn.send((True, TextTokenizer(AutoTokenizer.from_pretrained(folder))))
    except Exception as e:  # the caller raises it: a user error as it is, a bug with its traceback
        import traceback
        conn.send((False, e if isinstance(e, UserError) else RuntimeError(
            "loading the tokenizer failed:\n" + "".join(traceback.format_exception(e)))))
