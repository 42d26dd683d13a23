"""Tensor parallelism on CPU devices: tp = 1, 2 and 4 give the same greedy tokens (logits
within float tolerance), parameters are restored straight into their shards, the donated
KV stays in place, nothing compiles after warm-up, the Pallas kernels run under the mesh,
and two processes of two devices each generate what one process of four does.

The sharded runs need several devices, which XLA fakes on CPU with
XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts; so they run
tests/sharding_worker.py in subprocesses, and the rest of the suite keeps one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_hf
from servers import free_port, wait_healthy

from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.sampling import sampler_plans
from ksana_jax.sharding import attention_split, make_plan

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "sharding_worker.py"
LOGITS_RTOL = 1e-5  # of the largest |logit|: float32 sums in another order, nothing more


def run_worker(scenario: str, *paths: Path, args: tuple[str, ...] = (), timeout: int = 900):
    """Runs one scenario of sharding_worker.py (4 CPU devices); returns its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), scenario, *map(str, paths), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[int, Path]:
    """Converted checkpoints of two tiny models: 8 query heads over 8 and over 2 KV heads
    (head dim 16: the Pallas GPU kernel wants a power of two)."""
    from checkpoints_tools import convert

    dirs = {}
    for kv_heads in (8, 2):
        base = tmp_path_factory.mktemp(f"tiny_kv{kv_heads}")
        write_tiny_hf(
            base / "hf",
            initializer_range=0.2,  # peaked logits: no greedy ties
            eos_token_id=None,
            hidden_size=128,
            num_attention_heads=8,
            num_key_value_heads=kv_heads,
        )
        dirs[kv_heads] = convert(base / "hf", base / "ckpt")
    return dirs


@pytest.fixture(scope="module")
def tiny_runs(tiny_dirs) -> dict[int, dict]:
    result = run_worker("tiny", tiny_dirs[8], tiny_dirs[2])
    return {kv: result[str(path)] for kv, path in tiny_dirs.items()}


def test_attention_split_by_whole_heads():
    assert attention_split(8, 8, 4) == (4, 1)
    assert attention_split(32, 8, 8) == (8, 1)
    assert attention_split(8, 2, 4) == (2, 2)  # each KV head on 2 devices, 2 query heads each
    assert attention_split(32, 8, 16) == (8, 2)
    assert attention_split(9, 3, 2) is None  # SmolLM2: attention replicated
    assert attention_split(9, 3, 4) is None
    assert attention_split(6, 2, 4) is None  # 3 query heads per KV head do not split in 2
    assert attention_split(9, 3, 1) == (1, 1)


def test_one_device_is_the_1x1_mesh():
    cfg = ModelConfig("llama", 160, 64, 96, 2, 8, 2, 8)
    plan = make_plan(cfg, 1)
    assert dict(plan.mesh.shape) == {"data": 1, "model": 1, "kv_replica": 1}
    assert plan.param_sharding("layers.wq", (2, 64, 64)).is_fully_replicated
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=2"):
        make_plan(cfg, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_tp_1_2_4_same_greedy_tokens_and_logits(tiny_runs, kv_heads):
    runs = tiny_runs[kv_heads]
    want = runs["1"]["tokens"]
    for tp in ("2", "4"):
        run = runs[tp]
        assert "split by heads" in run["plan"], run["plan"]
        assert run["tokens"] == want, f"tp={tp}"
        assert run["logits_max_diff"] <= LOGITS_RTOL * run["logits_max_abs"], run
    if kv_heads == 2:
        assert "model 2 x kv_replica 2" in runs["4"]["plan"]


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_params_restored_into_their_shards(tiny_runs, kv_heads):
    runs = tiny_runs[kv_heads]
    for tp in ("1", "2", "4"):
        assert runs[tp]["shardings_match_plan"], f"tp={tp}"
    assert runs["2"]["bytes"]["max_fraction"] <= 0.55
    assert runs["4"]["bytes"]["max_fraction"] <= 0.40


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_kernels_under_the_mesh(tiny_runs, kv_heads, backend):
    runs = tiny_runs[kv_heads]
    assert runs["4"][backend] == runs["1"]["tokens"][:2]


def test_no_compilation_after_warm_up_with_tp4(tiny_dirs):
    # The 2-KV-head model: its KV is split 2 ways and replicated 2 ways.
    out = run_worker("recompile", tiny_dirs[2])
    # per bucket a forward and a sampling program per plan this platform uses, a scoring
    # program per scored size, and the page writes run before a step
    plans = len(sampler_plans())
    assert out["warm"] == (1 + plans) * out["buckets"] + out["scored_sizes"] + 1
    assert out["after"] == out["warm"]
    assert out["compiles_after_warm_up"] == 0
    assert out["preemptions"] > 0
    assert out["kv_matches_plan"], out["kv_spec"]


def test_sharded_step_donates_kv_and_holds_no_second_copy(tiny_dirs):
    out = run_worker("donation", tiny_dirs[8])
    assert out["kv_shard_bytes"] * 4 == out["kv_bytes"]  # KV split by heads over 4 devices
    assert out["alias"] >= out["kv_shard_bytes"]  # each device's shard updated in place
    assert out["temp"] < out["kv_shard_bytes"] // 4, out
    assert out["extra_output"] < out["kv_shard_bytes"] // 4, out
    assert out["donated"] and out["same_sharding"]


@pytest.mark.slow
def test_smollm2_tp_1_2_4(smollm2_dir):
    runs = run_worker("smollm2", smollm2_dir)
    want = runs["1"]["tokens"]
    for tp in ("2", "4"):
        run = runs[tp]
        assert "attention replicated" in run["plan"]  # 9 query / 3 KV heads
        assert run["shardings_match_plan"]
        assert run["tokens"] == want, f"tp={tp}"
        assert run["logits_max_diff"] <= LOGITS_RTOL * run["logits_max_abs"], run
    assert runs["4"]["bytes"]["max_fraction"] <= 0.40


def test_two_processes_generate_what_one_does(tiny_dirs, tiny_runs):
    """jax.distributed on 127.0.0.1: 2 processes x 2 CPU devices = one 4-device mesh."""
    address = f"127.0.0.1:{free_port()}"
    common = ["--devices", "2", "--coordinator", address, "--num-processes", "2"]
    command = [sys.executable, str(WORKER), "multihost", str(tiny_dirs[8]), *common]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    follower = subprocess.Popen(
        [*command, "--process-id", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        leader = run_worker("multihost", tiny_dirs[8], args=(*common, "--process-id", "0"))
        _, follower_err = follower.communicate(timeout=120)
    finally:
        follower.kill()
    assert follower.returncode == 0, follower_err[-4000:]
    assert (leader["processes"], leader["devices"], leader["local_devices"]) == (2, 4, 2)
    assert leader["tokens"] == tiny_runs[8]["4"]["tokens"]  # one process, 4 devices
    assert leader["tokens"] == tiny_runs[8]["1"]["tokens"]
    # the followers wrote a prefix-cache hit's pages before the step too
    assert leader["cached_tokens"] >= 80
    assert leader["repeated"][0] == leader["repeated"][1]


def _serve(model: Path, port: int, process_id: int, address: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ksana_jax.cli", "serve", str(model), "--port", str(port)]
    command += ["--log-level", "warning", "--tensor-parallel-size", "4", *SERVE_FLAGS]
    command += ["--coordinator-address", address, "--num-processes", "2"]
    command += ["--process-id", str(process_id)]
    env = os.environ | {
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


SERVE_FLAGS = [
    "--max-model-len=128",
    "--page-size=8",
    "--max-num-seqs=4",
    "--max-num-batched-tokens=32",
    "--token-buckets=32",
    "--seq-buckets=4",
    "--context-buckets=128",
]


def test_two_process_serve_only_process_0_serves_http(tiny_dirs, tmp_path):
    """`ksana-jax serve` on 2 processes x 2 CPU devices: process 0 answers HTTP with the
    tokens one device gives; process 1 opens no port and exits when process 0 stops."""
    import httpx

    from ksana_jax import LLM, SamplingParams

    address, ports = f"127.0.0.1:{free_port()}", (free_port(), free_port())
    procs = [_serve(tiny_dirs[8], ports[i], i, address) for i in (1, 0)][::-1]
    url = f"http://127.0.0.1:{ports[0]}"
    try:

        def log() -> str:
            procs[0].kill()
            return procs[0].communicate()[0]

        wait_healthy(url, procs[0], 600, log)
        prompt = [5, 9, 17, 33, 4, 5, 9, 17, 33, 4]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
        with pytest.raises(httpx.TransportError):  # the follower serves nothing
            httpx.get(f"http://127.0.0.1:{ports[1]}/health", timeout=5)
    finally:
        procs[0].terminate()
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    # uvicorn re-raises SIGTERM after its graceful shutdown; the follower exits normally.
    assert procs[0].returncode in (0, -15) and procs[1].returncode == 0, outputs[1][-3000:]
    one_device = LLM(tiny_dirs[8], warm_up=False, max_model_len=128, page_size=8)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = one_device.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert got["choices"][0]["text"] == want
