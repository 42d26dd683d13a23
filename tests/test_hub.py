"""Models named by Hugging Face id, resolved offline from a local HF cache (no hub here).

The cache is laid out as huggingface_hub writes it (models--org--name/refs/main naming a
commit, snapshots/<commit>/ holding the files), with a tiny checkpoint that transformers
saved. The CLI runs in a subprocess with HF_HUB_OFFLINE=1, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_hf

from ksana_jax import hub

REPO = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "acme/tiny-llama"
MAX = ("--max-tokens", "6")


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    """(environment for the CLI, the HF directory the cached snapshot was copied from)."""
    root = tmp_path_factory.mktemp("hub")
    source = root / "source"
    write_tiny_hf(source, seed=3)
    (source / "unwanted.bin").write_bytes(b"x" * 16)  # not fetched: only what conversion reads
    repo = root / "hf-cache" / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(root / "hf-cache"),
        "XDG_CACHE_HOME": str(root / "xdg"),
        "PYTHONPATH": str(REPO),
    }
    env.pop("HF_TOKEN", None)
    return env, source, root


def generate(env, model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ksana_jax.cli", "generate", model, "w5 w6 w7", "--json", *MAX],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hub_id_resolves_offline_and_generates_like_the_directory(hub_env):
    env, source, root = hub_env
    by_id = generate(env, REPO_ID)
    assert by_id.returncode == 0, by_id.stderr
    converted = root / "xdg" / "ksana-jax" / "hub" / "acme--tiny-llama" / COMMIT
    assert (converted / "config.json").is_file()
    assert f"converting {REPO_ID}" in by_id.stderr
    by_dir = generate(env, str(source))
    assert by_dir.returncode == 0, by_dir.stderr
    got, want = json.loads(by_id.stdout), json.loads(by_dir.stdout)
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 6
    # The second use converts nothing.
    again = generate(env, REPO_ID)
    assert again.returncode == 0, again.stderr
    assert "converting" not in again.stderr
    assert json.loads(again.stdout)["token_ids"] == want["token_ids"]


def test_missing_id_offline_is_one_line_naming_it(hub_env):
    env, _, _ = hub_env
    result = generate(env, "acme/no-such-model")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "'acme/no-such-model'" in result.stderr and "HF_HUB_OFFLINE" in result.stderr


@pytest.mark.parametrize(
    "name, is_id", [("org/name", True), ("Org-1/na.me_2", True), ("demo", False), ("a/b/c", False)]
)
def test_is_hub_id(name, is_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id(name) is is_id
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert hub.is_hub_id("org/name") is False  # an existing local path wins
