"""The GPU kernels and the engine step, compiled by XLA:GPU for an H200, an A100 and an L4 on
this CPU-only machine (benchmarks/gpu_aot_compile.py, with the CUDA PJRT plugin installed
beside the venv as `.ci/run` does). The compiler is the one a GPU runs: jaxlib's Triton, and
XLA's shared-memory limit for each GPU. So these check what the CPU tests cannot: every
kernel at its default launch compiles and fits each GPU, decode keeps the next key block's
copies in flight, nothing spills much, and the engine step updates the KV in place with one
attention and one KV-write launch per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "gpu_aot_compile.py"
PLUGIN_DIR = ROOT / ".venv" / "gpu-aot"  # where .ci/run installs it

pytestmark = [
    pytest.mark.skipif(
        not (PLUGIN_DIR / "jax_plugins").is_dir(),
        reason=f"no CUDA PJRT plugin in {PLUGIN_DIR}: install it as .ci/run does",
    ),
    pytest.mark.timeout(600),
]


def test_the_plugin_matches_jaxlib():
    """The plugin must be jaxlib's own version; another one fails in obscure ways."""
    import jaxlib

    found = sorted(p.name for p in PLUGIN_DIR.glob("jax_cuda12_pjrt-*.dist-info"))
    assert found == [f"jax_cuda12_pjrt-{jaxlib.__version__}.dist-info"], found


def run_tool(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "records.json"
    # This checkout's ksana_jax, whichever one the environment has installed.
    path = os.pathsep.join([str(PLUGIN_DIR), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--json", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def kernel_records(tmp_path_factory) -> list[dict]:
    return run_tool(tmp_path_factory.mktemp("gpu_aot"), "--gpus", "h200,a100,l4")


def test_every_kernel_compiles_for_each_gpu(kernel_records):
    gpus, dtypes = {"h200", "a100", "l4"}, {"bfloat16", "float32"}
    models = {"llama3_8b", "smollm2", "head256"}
    names = {"attention/decode", "attention/long_decode", "attention/prefill", "attention/mixed"}
    names |= {"attention/chunks8", "attention/chunks16"}
    names |= {"attention/window_decode"}  # a 4096-token window and a soft-cap, 32k contexts
    names |= {"write_kv_pages", "write_layer_kv"}
    assert len(kernel_records) == len(gpus) * len(models) * len(dtypes) * len(names)
    assert {(r["gpu"], r["model"], r["dtype"], r["name"]) for r in kernel_records} == {
        (g, m, d, n) for g in gpus for m in models for d in dtypes for n in names
    }
    failed = [r for r in kernel_records if not r["compiled"]]
    assert not failed, failed


GROUP_PAD = {"llama3_8b": 4, "smollm2": 4, "head256": 2}  # query heads a KV head, padded
ROWS = {"attention/mixed": 25, "attention/chunks8": 16, "attention/chunks16": 16}


def decode_tile(record, kernel) -> bool:
    """A tile of 16 query rows: decode-sized."""
    return kernel["tuning"]["block_q"] * GROUP_PAD[record["model"]] == 16


def pallas_kernels(records, prefix=""):
    """(record, kernel) for every Pallas kernel launch of the records named `prefix`..."""
    return [(r, k) for r in records if r["name"].startswith(prefix) for k in r["kernels"]]


def test_attention_launches_as_planned(kernel_records):
    """The launches the kernel planned reach the GPU: a decode bucket (one token a row) or
    a one-row prefill one launch; the mixed bucket two (the short rows in decode-sized
    tiles, then the long ones) unless its tiles are decode-sized already (float32 at head
    dim 256); each with its warps and its grid of (query tiles, KV heads, key splits)."""
    kv_heads = {"llama3_8b": 8, "smollm2": 3, "head256": 8}
    short, whole = "ragged_paged_attention_short_rows_gpu", "ragged_paged_attention_gpu"
    for r in kernel_records:
        if not r["name"].startswith("attention/"):
            continue
        names = [k["name"] for k in r["kernels"]]
        one_launch = r["name"] in ("attention/decode", "attention/long_decode", "attention/prefill")
        if one_launch or decode_tile(r, r["kernels"][-1]):  # or every tile decode-sized
            assert names == [whole], r
        else:
            assert names == [short, whole] and decode_tile(r, r["kernels"][0]), r
            assert r["kernels"][0]["grid"][0] == ROWS[r["name"]], r  # a tile a row
        for k in r["kernels"]:
            assert k["warps"] == k["tuning"]["num_warps"], r
            assert k["grid"][1:] == [kv_heads[r["model"]], k["tuning"]["num_kv_splits"]], r


def test_streaming_launches_keep_the_next_key_block_in_flight(kernel_records):
    """Decode is a stream of K/V copies: at its default 3 stages both key loops must wait
    for all but the next block's copies (`cp.async.wait_group N`, N > 0), on every GPU. With
    the page ids loaded inside the cached-key loop, that loop waited for every copy (N = 0).
    16-bit tiles up to head dim 128 run 3 stages whatever their size."""
    for r, k in pallas_kernels(kernel_records, "attention/"):
        stages = k["tuning"]["num_stages"]
        narrow_16_bit = r["dtype"] == "bfloat16" and r["model"] != "head256"
        if decode_tile(r, k) or narrow_16_bit:
            assert stages == 3, (r, k)
        in_flight = sum(count for n, count in k["wait_groups"].items() if int(n) > 0)
        if stages >= 3:
            assert in_flight >= 2, (r, k)  # the cached-key loop and the new-key loop


def test_kernels_fit_registers_and_shared_memory(kernel_records):
    """No default launch spills more than 128 bytes (an IEEE float32 dot spilled 43 KB), and
    each fits its GPU's shared memory per program."""
    limits = {"h200": 232448, "a100": 166912, "l4": 101376}
    assert all(r["kernels"] for r in kernel_records)
    kernels = pallas_kernels(kernel_records)
    for r, k in kernels:
        assert k["shared_bytes"] <= limits[r["gpu"]], (r, k)
        if "spill_bytes" in k:  # ptxas from nvidia-cuda-nvcc-cu12 (installed beside)
            assert k["spill_bytes"] <= 128, (r, k)


@pytest.fixture(scope="module")
def h200_records(tmp_path_factory) -> list[dict]:
    """Decode attention beside the jnp reference, and the whole engine step, for an H200."""
    only = ["--gpus", "h200", "--dtypes", "bfloat16", "--workloads", "decode,long_decode"]
    return run_tool(tmp_path_factory.mktemp("gpu_aot"), *only, "--reference", "--engine-step")


def test_decode_gathers_no_kv_copy_unlike_the_reference(h200_records):
    """The kernel reads each row's K/V where it lies in the pages: its temporaries are the
    small per-split partial outputs. XLA's reference gathers a copy of every row's K/V
    first (hundreds of MB at Llama shapes), which is why the kernel should beat it."""
    by_name = {(r["model"], r["name"]): r for r in h200_records if "model" in r}
    for model in ("llama3_8b", "smollm2"):
        for workload in ("decode", "long_decode"):
            kernel = by_name[model, f"attention/{workload}"]
            reference = by_name[model, f"reference/{workload}"]
            assert kernel["compiled"] and reference["compiled"]
            assert reference["kernels"] == []  # XLA's own kernels only
            assert kernel["temp_bytes"] * 20 < reference["temp_bytes"], (kernel, reference)


def test_engine_step_updates_the_kv_in_place(h200_records):
    """The whole SmolLM2 decode step for an H200, with each backend: the donated KV is the
    result (aliased), no KV-sized temporary, and with pallas_gpu exactly one attention and
    one KV-write launch per layer (30)."""
    steps = {r["backend"]: r for r in h200_records if r["name"] == "engine_step"}
    assert set(steps) == {"reference", "pallas_gpu"}
    for step in steps.values():
        assert step["kv_copies"] == 0, step
        assert step["alias_bytes"] >= step["kv_bytes"], step
        assert step["temp_bytes"] < step["kv_bytes"] / 4, step
    assert steps["pallas_gpu"]["pallas_launches"] == {
        "ragged_paged_attention_gpu": 30,
        "write_kv_pages_gpu": 30,
    }
    assert steps["reference"]["pallas_launches"] == {}


def test_int4_llama3_8b_step_fits_an_l4_with_room_for_kv(tmp_path):
    """The whole decode step of a Llama-3-8B-shaped model with int4 weights (shapes only, no
    checkpoint), compiled for one L4 and for two (tensor-parallel): params, KV, batch state,
    outputs not aliased and temporaries leave most of its 24 GB for KV, and every int4
    product runs in the Pallas kernel (pallas_kernels/quant_matmul.py; under tensor
    parallelism per device on its shard, in shard_map): no dequantized matrix (nor a
    device's shard of one) is materialised, the temporaries stay far below one (the
    largest, the LM head), and the two L4s add only the collectives of the bfloat16 step:
    no weight is gathered for a kernel."""
    only = ["--gpus", "l4", "--model", "smollm2", "--dtypes", "bfloat16", "--workloads", "decode"]
    records = run_tool(
        tmp_path,
        *only,
        "--engine-step",
        "--engine-model",
        "llama3_8b",
        "--quantization",
        "int4",
        "--engine-placements",
        "1,2",
        "--engine-backends",
        "pallas_gpu",
    )
    steps = {r["model"].split()[-1]: r for r in records if r["name"] == "engine_step"}
    assert set(steps) == {"tp1", "tp2"}
    for step in steps.values():
        assert step["kv_copies"] == 0, step
        assert step["params_bytes"] < 5.5e9  # 8.0e9 weights at 0.625 bytes (+ norms)
        held = step["argument_bytes"] + step["output_bytes"] - step["alias_bytes"]
        held += step["temp_bytes"]
        assert 24e9 - held + step["kv_bytes"] > 12e9, step  # KV for ~90k tokens in bf16
        assert step["weight_copies"] == 0, step
        # 72 MB on one L4, 73 MB on each of two.
        assert step["temp_bytes"] < 0.2 * step["largest_dequantized"], step
        # 4 matrices a layer (wqkv, wo, w_gate_up, w_down: models/fusion.py) and the LM
        # head, at least.
        assert step["pallas_launches"]["int4_matmul_gpu"] >= 32 * 4 + 1, step
    # tp2: the bfloat16 step's all-reduces (one f32[32, 4096] after each row-parallel
    # product, 64, and sampling's small ones) and all-gathers (logits); XLA's
    # dequantize-then-dot path adds 64 more, a kernel that gathered its weights one each.
    collectives = steps["tp2"]["collectives"]
    assert collectives["all-reduce"][0] <= 32 * 2 + 20, collectives
    assert collectives["all-gather"][0] <= 6, collectives
    assert steps["tp2"]["argument_bytes"] < 0.6 * steps["tp1"]["argument_bytes"]


def test_quantized_products_compile_for_each_gpu_without_a_dequantized_weight(tmp_path):
    """benchmarks/quant_matmul_compile.py: the int4 Pallas matmul alone, and int8 (one scale
    per output channel) through `layers.linear` as a GPU traces it ((x . q^T) * s), at
    Llama-3-8B's MLP matrices, decode and prefill rows, for an H200 and an L4: each compiles
    and holds no buffer of the dequantized matrix's shape; the kernel spills nothing, and
    XLA fuses int8's convert into one GEMM (dequantize-then-dot materialises the matrix:
    117 MB at up/gate)."""
    out = tmp_path / "records.json"
    path = os.pathsep.join([str(PLUGIN_DIR), str(ROOT)])
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "quant_matmul_compile.py"),
            "--json",
            str(out),
            "--gpus",
            "h200,l4",
            "--formats",
            "int4,int8",
            "--matrices",
            "up/gate,down",
            "--rows",
            "1,256",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"},
        cwd=ROOT,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert sorted(r["format"] for r in records) == ["int4"] * 8 + ["int8"] * 8
    for record in records:
        assert record["compiled"] and record["dequantized_buffers"] == 0, record
        # int4: x split in halves, float32 partial products of the input-dim splits: 12 MB at
        # most; int8: XLA's split-K partial products, 4 MB at 32 rows.
        assert record["temp_bytes"] < 0.2 * record["dequantized_bytes"], record
        if record["format"] == "int4":
            (kernel,) = record["kernels"]
            assert kernel["name"] == "int4_matmul_gpu" and kernel.get("spill_bytes", 0) == 0
