"""Checkpoint writes are atomic and exclusive (checkpoints_tools/staging.py): a convert killed
(SIGKILL) at any point leaves OUTPUT_DIR loadable as the old or the new checkpoint, a second
convert into the same place fails at once, and the next convert removes what a dead one left.

The converts run in subprocesses (tests/convert_worker.py) that report each step of the write,
so a kill lands at a named step, or at a random delay once writing has begun."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_hf

import ksana_jax
from checkpoints_tools import convert, read_source, staging
from ksana_jax import cli
from ksana_jax.models import registry

WORKER = Path(__file__).resolve().parent / "convert_worker.py"
LOCK_MESSAGE = "another convert is writing"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny checkpoints of one config with different weights: (old, new)."""
    root = tmp_path_factory.mktemp("sources")
    old, new = root / "old", root / "new"
    write_tiny_hf(old, seed=0)
    write_tiny_hf(new, seed=1)
    return old, new


@pytest.fixture(scope="module")
def flats(sources):
    """Each source's params as numpy arrays by flat name: {"old": ..., "new": ...}."""
    read = {n: read_source(p) for n, p in zip(("old", "new"), sources, strict=True)}
    flat = {n: registry.params_to_flat(s.params, s.config) for n, s in read.items()}
    return {name: {k: np.asarray(v) for k, v in params.items()} for name, params in flat.items()}


def which(out: Path, flats) -> str:
    """ "old" or "new": which complete checkpoint `out` loads as (fails if neither)."""
    model = ksana_jax.load(out)
    got = {k: np.asarray(v) for k, v in registry.params_to_flat(model.params, model.config).items()}
    for name, want in flats.items():
        if got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want):
            return name
    raise AssertionError(f"{out} loads, but as neither the old nor the new checkpoint")


def start_worker(source: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(source), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(proc: subprocess.Popen, step: str) -> None:
    for line in proc.stdout:
        if line.strip() == f"step {step}":
            return
    raise AssertionError(f"the worker ended before step {step}: {proc.stderr.read()}")


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def leftovers(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out.parent) if n != out.name)


# The write's steps and what OUTPUT_DIR holds when a kill lands there.
STEPS = {"staging": "old", "written": "old", "swapped": "new", "done": "new"}


def test_kill_at_every_step_leaves_old_or_new(tmp_path, sources, flats):
    old, new = sources
    out = tmp_path / "models" / "ckpt"
    trials = [(step, None) for step in STEPS] + [("staging", d) for d in (0.05, 0.2, 0.4, 0.8)]
    rng = random.Random(0)
    for step, delay in trials:
        convert(old, out, force=True)  # also removes what the last killed convert left
        assert leftovers(out) == [] and which(out, flats) == "old"
        hold = [] if delay is not None else ["--hold", step, "--go", str(tmp_path / "never")]
        proc = start_worker(new, out, "--force", *hold)
        wait_for_step(proc, step)
        if delay is not None:
            time.sleep(rng.uniform(0, delay))
        kill(proc)
        state = which(out, flats)
        if delay is None:
            assert state == STEPS[step], (step, state)
    # What the dead converts left (the lock file, a staging directory) goes with the next one.
    convert(new, out, force=True)
    assert leftovers(out) == []
    model, reference = ksana_jax.load(out), ksana_jax.load(new)
    prompt = [5, 6, 7, 8]
    assert ksana_jax.generate(model, prompt, max_tokens=4) == ksana_jax.generate(
        reference, prompt, max_tokens=4
    )


def test_stale_staging_is_removed_by_the_next_convert_only(tmp_path, sources, flats):
    old, new = sources
    out = tmp_path / "ckpt"
    convert(old, out)
    proc = start_worker(new, out, "--force", "--hold", "written", "--go", str(tmp_path / "never"))
    wait_for_step(proc, "written")
    kill(proc)
    left = leftovers(out)
    assert len(left) == 2 and staging.lock_path(out).name in left, left
    (stale,) = [n for n in left if n.startswith(".ckpt.staging-")]
    assert (tmp_path / stale / "params").is_dir()  # a complete, never swapped-in checkpoint
    # Staging directories of other targets, and a user's own files, are not touched.
    (tmp_path / ".other.staging-abcdefgh").mkdir()
    (tmp_path / ".ckpt.backup01").mkdir()
    (tmp_path / ".ckpt.notes").write_text("mine")
    convert(new, out, force=True)
    mine = [".ckpt.backup01", ".ckpt.notes", ".other.staging-abcdefgh", "ckpt"]
    assert sorted(os.listdir(tmp_path)) == mine
    assert which(out, flats) == "new"


@pytest.mark.parametrize("force", [True, False], ids=["force", "no_force"])
def test_a_second_concurrent_convert_fails_at_once(tmp_path, sources, flats, capsys, force):
    old, new = sources
    out = tmp_path / "ckpt"
    go = tmp_path / "go"
    first = start_worker(old, out, "--hold", "staging", "--go", str(go))
    try:
        wait_for_step(first, "staging")
        flag = ["--force"] if force else []
        start = time.perf_counter()
        assert cli.main(["convert", str(new), str(out), *flag]) == 2
        assert time.perf_counter() - start < 5
        err = capsys.readouterr().err
        assert "Traceback" not in err
        (line,) = err.strip().splitlines()
        assert line.startswith("ksana-jax convert: error: ") and LOCK_MESSAGE in line
        assert str(out) in line
        go.touch()
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            kill(first)
    assert which(out, flats) == "old"  # the first convert's output, intact
    assert leftovers(out) == ["go"]
    # Afterwards, without --force, the existing checkpoint is refused as before.
    assert cli.main(["convert", str(new), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
