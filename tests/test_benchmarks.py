"""The benchmark scripts still run against the engine's current API: each one's measuring
pieces, on a tiny random model or CPU-sized shapes (speed is not asserted, only that the
numbers come out and are sane)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import write_tiny_hf

import ksana_jax
from ksana_jax import LLM
from ksana_jax.pallas_kernels import reference
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    if str(BENCHMARKS) not in sys.path:  # the scripts import their siblings (vllm_peer)
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
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
    steps = throughput.StepLog(llm)
    assert throughput.run_ksana(llm, requests) > 0
    kinds = {row[0] for row in steps.rows}  # a 1-token chunk (here a prompt too) is "decode"
    assert "decode" in kinds and kinds <= {"prefill", "decode", "mixed"}
    assert all(row[4] is not None for row in steps.rows)
    # every request's prompt and all outputs but the last (sampled by the step before)
    assert sum(row[3] for row in steps.rows) == sum(len(p) + m - 1 for p, m in requests)
    steps.print_table()
    assert throughput.decode_step_seconds(llm, repeats=2) > 0
    assert throughput.decode_step_seconds(llm, repeats=3, pipelined=True) > 0
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


def test_attention_sweep_pieces_run_in_interpret_mode(monkeypatch):
    """The sweep's measuring core and its description of the kernel's defaults, on a CPU
    decode batch with the kernel interpreted: each config's output equals the oracle's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sweep = load_script("attention_sweep")
    attention = load_script("attention")
    num_heads, num_kv_heads, head_dim = attention.MODELS["smollm2"]
    rows = attention.WORKLOADS["decode"]["cpu"]
    batch = attention.build_batch(rows, num_heads, num_kv_heads, head_dim, jnp.float32)
    expected = reference.ragged_paged_attention(*batch, spec=AttentionSpec(head_dim**-0.5))
    configs = [sweep.DEFAULT, (2, 32, 8, 2)]
    assert sweep.DEFAULT in sweep.CONFIGS
    results = sweep.sweep(batch, expected, configs, repeats=1, calls=1, interpret=True)
    assert sorted((r[1:5] for r in results), key=str) == sorted(configs, key=str)
    for seconds, *_, err in results:
        assert seconds > 0 and err < 1e-4
    # 4 decode rows x 3 KV heads at 512 keys: too few programs, split to 256 keys each.
    assert sweep.describe_defaults(batch) == (
        "block_q 4, block_k 32, num_kv_splits 2, num_warps 4, num_stages 3"
    )


def test_gpu_aot_compile_pieces_work_without_the_plugin(monkeypatch):
    """benchmarks/gpu_aot_compile.py compiles only with the CUDA PJRT plugin beside the venv
    (tests/test_gpu_aot.py runs it whole); its kernel list lowers for CUDA with the kernels'
    current signatures, and its readers parse what XLA dumps."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    tool = load_script("gpu_aot_compile")
    found = tool.kernels("smollm2", jnp.dtype(jnp.bfloat16), ["decode"], [(8, 2)])
    assert [name for name, *_ in found] == [
        "attention/decode",
        "attention/decode",
        "write_kv_pages",
        "write_layer_kv",
    ]
    assert [plan[-1].tuning.num_warps for _, plan, *_ in found[:2]] == [4, 8]
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for _, _, fn, shapes in found:
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[triton])(*shapes)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    thunks = (
        "005: kCustomKernel [prev=004 (1) | next=006 (1)] ragged_paged_attention_gpu grid: "
        "[40, 8, 4] threads: [128, 1, 1]  shared_memory: 71680 bytes\n"
        "006: kCustomKernel [prev=005 (1) | sink] loop_select_fusion grid: [1024, 1, 1] "
        "threads: [128, 1, 1]  shared_memory: 0 bytes\n"
    )
    assert tool.launches(thunks) == [
        tool.KernelLaunch("ragged_paged_attention_gpu", (40, 8, 4), (128, 1, 1), 71680),
        tool.KernelLaunch("loop_select_fusion", (1024, 1, 1), (128, 1, 1), 0),
    ]
    ptx = "cp.async.wait_group 0;\n\tcp.async.wait_group 2;\ncp.async.wait_group\t2;"
    assert tool.wait_groups(ptx) == {0: 1, 2: 2}
    config = tool.GPUS["l4"].target_config()
    assert "cuda_compute_capability { major: 8 minor: 9 }" in config
    assert "shared_memory_per_block_optin: 101376" in config


def test_aot_engine_step_describes_a_published_moe_model(monkeypatch):
    """benchmarks/aot_engine_step.py (the GPU and TPU tools' engine step): Qwen3-30B-A3B's
    shapes as abstract weights (30.5 B parameters, nothing allocated) lower to an engine step
    that sorts each layer's tokens by expert (the grouped products a GPU runs with
    ragged_dot); its HLO reader counts collectives, an async pair once by its result."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    aot = load_script("aot_engine_step")
    assert aot.parse_placements("1,8,8ep") == [(1, False), (8, False), (8, True)]
    with pytest.raises(ValueError, match="8x"):
        aot.parse_placements("8x")
    model = aot.abstract_model("qwen3_30b_a3b", jax.devices(), 1)
    leaves = jax.tree.leaves(model.params)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert 30.4e9 < sum(leaf.size for leaf in leaves) < 30.6e9
    lowered, kv = aot.lower_decode_step(model, "reference", "gpu", kv_cache_dtype="bfloat16")
    assert kv.shape == (48, 2, 4, 1024, 16, 128)
    assert lowered.as_text().count("call @argsort") == 48  # one sort per MoE layer
    hlo = (
        "  %all-reduce.1 = f32[32,2048]{1,0} all-reduce(f32[32,2048]{1,0} %x), to_apply=%add\n"
        "  %ags = ((f32[16,20]{1,0}, s32[16,20]{1,0}), (f32[128,20]{1,0}, s32[128,20]{1,0})) "
        "all-gather-start(%a, %b), dimensions={0}\n"
        "  %agd = (f32[128,20]{1,0}, s32[128,20]{1,0}) all-gather-done(%ags)\n"
    )
    assert aot.collectives(hlo) == {
        "all-gather": (1, 2 * 128 * 20 * 4),
        "all-reduce": (1, 32 * 2048 * 4),
    }


def test_tpu_kernel_compile_lists_the_current_kernels(monkeypatch):
    """benchmarks/tpu_kernel_compile.py needs libtpu to compile (not installed here); its
    kernel list still lowers for TPU with the kernels' current signatures."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tool = load_script("tpu_kernel_compile")
    found = tool.kernels(30, 9, 3, 64, jnp.bfloat16)
    assert [name for name, *_ in found] == [
        "attention/mixed",
        "attention/decode",
        "write_kv_pages",
        "write_layer_kv",
    ]
    for _, fn, shapes in found:
        exported = jax.export.export(fn, platforms=["tpu"])(*shapes)
        assert "tpu_custom_call" in exported.mlir_module()


def test_host_overhead_pieces_run_on_the_engine(tmp_path, capsys):
    host_overhead = load_script("host_overhead")
    write_tiny_hf(tmp_path / "hf", eos_token_id=None)
    model = ksana_jax.load(tmp_path / "hf")
    results = []
    best = host_overhead.measure(model, 2, [64, 128], 3, [False, True], repeat=2)
    assert sorted(best) == [(64, False), (64, True), (128, False), (128, True)]
    for (max_model_len, asynchronous), row in best.items():
        assert row["tok_s"] > 0 and row["host_ms"] > 0 and 0 <= row["idle"] <= 1
        assert 0 < row["spread"] <= 1
        results.append(("tiny", max_model_len, 2, asynchronous, row))
    host_overhead.print_header()
    for result in results:
        host_overhead.print_row(*result)
    host_overhead.print_ratios(results)
    out = capsys.readouterr().out
    assert "async on/off" in out and "max_len 128/64" in out
    # --sampling penalties: every request's tokens come (measure asserts their number)
    penalties = host_overhead.SAMPLING["penalties"]
    best = host_overhead.measure(model, 2, [64], 3, [True], sampling=penalties)
    assert best[64, True]["tok_s"] > 0


def test_random_model_has_the_demo_checkpoints_shapes():
    """host_overhead.random_model (random bfloat16 weights made on the device, for a GPU
    machine that has no checkpoint): for "smollm2" the demo checkpoint's params tree and
    shapes, and the engine decodes with it."""
    from ksana_jax.demo import demo_checkpoint

    host_overhead = load_script("host_overhead")
    model = host_overhead.random_model("smollm2")
    demo = ksana_jax.load(demo_checkpoint(), dtype="bfloat16")

    def shapes(m):
        return jax.tree.map(lambda a: (a.shape, str(a.dtype)), m.params)

    assert shapes(model) == shapes(demo)
    assert model.config.num_hidden_layers == demo.config.num_hidden_layers == 30
    best = host_overhead.measure(model, 1, [64], 3, [True])
    assert best[64, True]["tok_s"] > 0


def test_linear_cpu_pieces_run():
    """benchmarks/linear_cpu.py's chain of products: kernel and XLA agree on small shapes."""
    bench = load_script("linear_cpu")
    rng = np.random.default_rng(0)
    for dtype in ("bfloat16", "int8", "int4", "float32"):
        weights = tuple(bench.make_weight(rng, dtype, o, i) for o, i in ((40, 64), (24, 96)))
        x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
        kernel = bench.chain(bench.linear_cpu.linear)(x, weights)
        xla = bench.chain(bench.xla_linear)(x, weights)
        # Where the kernel takes integer dots (int8 and int4 in a bfloat16 product): XLA's side
        # rounds the weights to bfloat16 (2^-9 of a weight), the kernel x to 8-bit integers
        # per 32 columns (up to 1/254 of their largest: 4% of these random int4 weights'
        # products, all of one sign), through two products; test_linear_cpu.py holds each
        # path to its own oracle.
        exact = any(bench.linear_cpu.integer_dots(w) for w in weights)
        rtol = 0.1 if exact else 1e-4
        np.testing.assert_allclose(kernel, xla, rtol=rtol, atol=1e-3, err_msg=dtype)
        assert bench.time_chain(bench.chain(bench.linear_cpu.linear), x, weights, 1) > 0
        # --layers: a decode step's layers around the kernel's calls, with and without silu,
        # the norms and residual adds in the kernel's calls or around them (XLA's side: around)
        shapes = ((96, 32), (32, 32), (128, 32), (32, 64))  # wqkv, wo, w_gate_up, w_down
        layers = bench.decode_layers(rng, dtype, shapes, 1)
        head = bench.make_weight(rng, dtype, 20, 32)
        x = jnp.asarray(rng.standard_normal((1, 32)), jnp.float32) / 10
        for activation, fused in ((True, True), (False, True), (True, False)):
            kernel = bench.decode_products(activation, fused=fused)(x, layers, head)
            xla = bench.decode_products(activation, bench.xla_linear, fused=False)(x, layers, head)
            scale = float(np.max(np.abs(xla)))  # random weights: products of ~1e4 here
            np.testing.assert_allclose(kernel, xla, rtol=0, atol=rtol * scale / 2, err_msg=dtype)


def test_quant_pieces_run_on_the_engine(tmp_path, capsys):
    """benchmarks/quant.py on a tiny random Llama: every format at batch 1, the floor table
    and the ratios; at 1 row every matrix goes through the C++ kernel (when it builds)."""
    from ksana_jax.pallas_kernels import linear_cpu

    quant_bench = load_script("quant")
    write_tiny_hf(tmp_path / "hf", intermediate_size=128, eos_token_id=None)
    results = quant_bench.measure(tmp_path / "hf", ["bfloat16", "int8", "int4"], [1], 24, 1, 128, 1)
    assert [r["format"] for r in results] == ["bfloat16", "int8", "int4"]
    assert all(r["tok_s"] > 0 and 0 < r["step_s"] < 10 for r in results)
    bf16, int8, int4 = (r["weight_bytes"] for r in results)
    assert int4 < int8 < bf16
    if linear_cpu.available():
        assert all(r["kernel"] for r in results)
    quant_bench.report(results, 1e10, 24)
    out = capsys.readouterr().out
    assert "batch 1: int4 / bfloat16" in out and "below its floor" in out


def test_sampler_benchmark_runs_every_plan(monkeypatch, capsys):
    """benchmarks/sampler.py on a vocabulary past sampling.FILTER_PREFIXES[0]: each plan's rows
    are ones plan_for gives that plan (rows_for asserts it), and every line prints."""
    sampler = load_script("sampler")
    argv = ["sampler.py", "--rows", "2", "--vocab", "600", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    sampler.main()
    out = capsys.readouterr().out
    from ksana_jax.sampling import sampler_plans

    for plan in sampler_plans():
        assert f"plan {plan.value} " in out, out
    assert "plan random, flat" in out and "jnp.argmax (peer)" in out
