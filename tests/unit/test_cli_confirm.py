"""Destructive commands ask at a terminal: `evict` without `--yes`, stdin a real pty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli_store import Store, fill, make_store
from helpers.meta_builders import keys as make_keys

from hf3fsctl.meta.client import connect

NUM_KEYS = 4


def evict_at_terminal(store: Store, answer: str) -> subprocess.CompletedProcess[str]:
    """Run `hf3fsctl evict --all` with stdin on a pseudo-terminal that types `answer`."""
    leader, follower = os.openpty()
    try:
        os.write(leader, answer.encode())
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "hf3fsctl",
                "--config",
                str(store.config_file),
                "evict",
                "--all",
            ],
            stdin=follower,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(follower)
        os.close(leader)


def committed_keys(store: Store) -> int:
    client = connect(store.config())
    try:
        return sum(ns.keys for ns in client.stats().namespaces)
    finally:
        client.close()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    made = make_store(tmp_path)
    fill(made, make_keys(NUM_KEYS))
    return made


def test_evict_asks_and_yes_evicts(store: Store) -> None:
    result = evict_at_terminal(store, "y\n")
    assert result.returncode == 0, result.stderr
    assert "would evict 4 keys" in result.stdout
    assert "evicted 4 keys" in result.stdout
    assert committed_keys(store) == 0


def test_evict_asks_and_no_keeps_everything(store: Store) -> None:
    result = evict_at_terminal(store, "n\n")
    assert result.returncode == 1
    assert committed_keys(store) == NUM_KEYS


def test_evict_prompt_goes_to_stderr(store: Store) -> None:
    result = evict_at_terminal(store, "n\n")
    assert "Evict 4 keys?" in result.stderr
    assert "Evict" not in result.stdout
