"""The benchmark scripts still run against the engine's current API: each one's measuring
pieces, on a tiny random model or CPU-sized shapes (speed is not asserted, only that the
numbers come out and are sane)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_hf

import ksana_jax
from ksana_jax import LLM

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_pieces_run_on_the_engine(tmp_path):
    throughput = load_script("throughput")
    write_tiny_hf(tmp_path / "hf", eos_token_id=None)
    llm = LLM(
        ksana_jax.load(tmp_path / "hf"),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(4, 32),
        seq_buckets=(4,),
        context_buckets=(32, 128),
    )
    requests = [([5, 6, 7, 8, 9][:n], m) for n, m in ((3, 4), (5, 2), (1, 6))]
    assert throughput.run_ksana(llm, requests) > 0
    assert throughput.decode_step_seconds(llm, repeats=2) > 0
    assert throughput.read_bandwidth() > 1e8  # bytes/s: any machine reads 100 MB/s


@pytest.mark.parametrize("script", ["attention.py", "attention_sweep.py"])
def test_attention_scripts_run(script):
    """attention.py on CPU shapes (interpret mode for the Pallas backends); the GPU-only
    sweep refuses a CPU with a clear message rather than a traceback."""
    args = ["--model", "smollm2", "--repeats", "1"]
    if script == "attention.py":
        args += ["--backends", "reference,xla,pallas_gpu", "--workloads", "decode,mixed"]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if script == "attention_sweep.py":
        assert proc.returncode != 0 and "needs a GPU" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in ("reference", "xla", "pallas_gpu"):
        assert proc.stdout.count(f"  {backend} ") == 2, proc.stdout  # one line per workload
    assert "x reference" in proc.stdout
