"""`llmtrain download`: hub models and datasets into the shared layout, once, atomically.

    llmtrain download [--config FILE] [--model ID] [--dataset ID] [--revision REV]
                      [--dataset-revision REV] [--allow-pattern GLOB ...] [--config-only] [--force]

Uses huggingface_hub's own client (`snapshot_download`; HF_ENDPOINT, HF_TOKEN and the token
file are honoured by it). Each repo lands in `$LLMTRAIN_HOME/{models,datasets}/<id>`:
downloaded into `.<name>.tmp-<pid>`, a marker (repo id, requested revision, commit) written
into it, then renamed, so an interrupted download is never mistaken for a finished one. A lock
file per repo serialises concurrent invocations; the second finds the marker and skips.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from ..config import Config, UserError
from ..data.sources import HOME_VAR, is_hub_id, tokenizer_source

MARKER = ".llmtrain-download.json"
# --config-only: what `llmtrain estimate` reads of a model (config.json) and what makes its folder
# a tokenizer (prepare, check-config's vocabulary check), top-level files only: ~10 MB where the
# weights are ~140 GB (Llama 3 70B). Nothing under original/, where Meta's repos keep another copy
# of the weights. Globs match the whole path (huggingface_hub's fnmatch).
CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.*"]


def targets(cfg: Config | None, model: str | None, dataset: str | None,
            datasets: bool = True) -> list[tuple[str, str]]:
    """(repo_type, repo_id) to fetch: the flags, else the hub ids the config names (its
    datasets only with `datasets`)."""
    found = []
    if model:
        found.append(("model", model))
    if dataset:
        found.append(("dataset", dataset))
    if cfg is not None:
        if not model:
            for source in (cfg.model.name_or_path, tokenizer_source(cfg)):
                if source and is_hub_id(source):
                    found.append(("model", source))
        for one in cfg.source_configs() if datasets and not dataset else []:  # a mixture's sources, all
            if is_hub_id(one.data.dataset):
                found.append(("dataset", one.data.dataset))
    return list(dict.fromkeys(found))


def download(repo_type: str, repo_id: str, revision: str | None, allow_patterns: list[str] | None,
             force: bool, log=print, config_only: bool = False) -> Path:
    """config_only: CONFIG_FILES alone. The marker records the patterns, so a full download
    later fetches the weights; and a finished download of the revision already holds more than
    CONFIG_FILES, so config_only keeps it rather than replace its weights by less."""
    home = os.environ.get(HOME_VAR)
    if not home:
        raise UserError(f"{HOME_VAR} is not set: source the env.sh that setup.sh wrote")
    dest = Path(home) / f"{repo_type}s" / repo_id
    dest.parent.mkdir(parents=True, exist_ok=True)
    allow_patterns = CONFIG_FILES if config_only else allow_patterns or None
    wanted = {"repo_id": repo_id, "repo_type": repo_type, "revision": revision or "main",
              "allow_patterns": allow_patterns}
    with _lock(Path(home) / f"{repo_type}s" / ".locks" / (repo_id.replace("/", "--") + ".lock")):
        marker = _read_marker(dest)
        same = ("repo_id", "repo_type", "revision") if config_only else wanted
        if not force and marker and {k: marker.get(k) for k in same} == {k: wanted[k] for k in same}:
            log(f"{repo_type} {repo_id}: up to date (commit {marker['commit']}) in {dest}")
            return dest
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        try:
            info = HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"{repo_type} {repo_id}: downloading commit {info.sha} into {dest}")
            snapshot_download(repo_id, repo_type=repo_type, revision=info.sha, local_dir=tmp,
                              allow_patterns=allow_patterns)
        except GatedRepoError:
            raise UserError(f"{repo_type} {repo_id} is gated: accept its terms on the hub, then set "
                            f"HF_TOKEN or run `hf auth login`") from None
        except RepositoryNotFoundError:
            raise UserError(f"{repo_type} {repo_id}: not found on the hub (or private: set HF_TOKEN)") from None
        except Exception as e:
            if not _unreachable(e):
                raise
            shutil.rmtree(dest.with_name(f".{dest.name}.tmp-{os.getpid()}"), ignore_errors=True)
            _remove_empty_parents(dest.parent, Path(home))
            from huggingface_hub import constants
            raise UserError(f"{repo_type} {repo_id}: cannot reach the hub at {constants.ENDPOINT} "
                            f"({type(e).__name__}); download on a machine with internet (the "
                            f"login node), or check HF_ENDPOINT and the proxy settings") from None
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # the client's resume metadata
        (tmp / MARKER).write_text(json.dumps({**wanted, "commit": info.sha,
                                              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
        log(f"{repo_type} {repo_id}: done (commit {info.sha})")
        return dest


def _unreachable(e: BaseException) -> bool:
    """A connection that could not be made or timed out, whichever HTTP client raised it."""
    for err in (e, e.__cause__, e.__context__):
        if err is not None and (isinstance(err, (ConnectionError, TimeoutError))
                                or any(w in type(err).__name__ for w in ("Connect", "Timeout"))):
            return True
    return False


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    """The org folder a failed download created, if nothing else is in it."""
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


class _lock:
    """An exclusive flock on a file: a second invocation for the same repo waits its turn."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
