"""File helpers with no knowledge of llmtrain: a config's YAML, a JSON file that may be missing,
an atomic write for the shared filesystem. A leaf: it imports nothing else of llmtrain."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """YAML as a config means it: 12:00:00 stays the string it looks like (YAML 1.1 reads digits
    with colons as a base-60 number, 43200, which slurm.time would then refuse)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"^(?![^:]*:)" + rx.pattern.lstrip("^"), rx.flags))
            if tag.endswith((":int", ":float")) else (tag, rx) for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def read_json(path: Path) -> dict | None:
    """A JSON file's object, or None if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Write then rename: readers on a shared filesystem never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
