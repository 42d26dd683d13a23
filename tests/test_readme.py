"""The README's two commands, as a newcomer runs them: the first one, in a fresh clone of the
repository, installs everything into a new virtual environment and serves the demo model
(checked up to a 200 from /health and one completion); the second one is what CI runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)[:2]


def test_ci_runs_the_readme_test_command():
    _, test_command = readme_commands()
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.slow
def test_readme_first_command_in_a_fresh_clone(tmp_path):
    first, _ = readme_commands()
    assert first.rstrip().endswith("ksana-jax serve")
    clone = tmp_path / "ksana-jax"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"{first} --port {port}"],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the whole group (bash, pip, the server) is stopped below
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, start + 1500 - time.monotonic(), log.read_text, interval=1)
        healthy = time.monotonic() - start
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].strip()
        print(f"README first command: healthy after {healthy:.0f}s")
        text = log.read_text()
        assert f"curl {url}/v1/completions" in text  # the ready-to-paste example
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (clone / ".venv" / "bin" / "ksana-jax").exists()
