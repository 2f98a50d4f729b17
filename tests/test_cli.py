"""The llmtrain command as a whole: --version, and help that gives every option's default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import llmtrain
from llmtrain.cli import parser


def test_version_names_the_package_and_torch_without_importing_torch():
    proc = llmtrain("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"llmtrain {metadata.version('llmtrain')} (")
    assert f"torch {metadata.version('torch')}" in proc.stdout
    code = ("import sys; from llmtrain.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    rc = e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def commands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_option_of_every_command_says_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = commands()[command].format_help()  # what `llmtrain COMMAND --help` prints
    entries = re.findall(r"^  (-[^\n]*(?:\n {4,}[^\n]*)*)", text, flags=re.M)
    assert entries, text
    for entry in entries:
        if entry.startswith("-h, --help"):
            continue
        words = " ".join(entry.split())
        assert "default" in words or "required" in words, f"llmtrain {command} --help: {words}"
