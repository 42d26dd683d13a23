"""The GPU kernels and the engine step compiled by XLA:GPU for real GPUs, on a machine without one.

jax compiles ahead of time for a GPU it only describes: the CUDA PJRT plugin takes a target
config (compute capability, SMs, shared memory, ...) in place of an attached device
(`jax.experimental.topologies`), and runs XLA's whole GPU compiler. The Pallas kernels go
through jaxlib's own Triton to PTX and on to machine code, so this is what a GPU would run,
not an approximation. A kernel that needs more shared memory than the GPU has fails here as
it would there ("RESOURCE_EXHAUSTED: Shared memory size limit exceeded"). Nothing runs.

For each GPU (an H200, an A100 and an L4 by default), model shape (SmolLM2's, a Llama-3-8B
like one, and a 256-wide head: Gemma-3-12B's 16 query / 8 KV heads) and KV dtype, this
compiles the attention kernel on each workload (benchmarks/attention.py's, and rows of 8 and
16 new tokens, so that every tile size the kernel picks is compiled), with the launches the
kernel plans itself (`plan_launches`), and both KV writes. The windowed workload
(`window_decode`: 32k contexts) compiles with its sliding window and a logit soft-cap (50,
Gemma 2's), the others with neither. For each compiled function it prints the kernels it
launches and its temporaries, and for each Pallas kernel in it:
  - the grid, and the shared memory per program that XLA reserves;
  - the `cp.async.wait_group N` values in the kernel's PTX. A loop whose wait is 0 waits for
    every copy it issued before it computes, so its loads are not overlapped. N > 0 keeps
    the next block's copies in flight;
  - registers per thread and spill bytes, when a `ptxas` is at hand (from the
    `nvidia-cuda-nvcc-cu12` package, installed as below), and then how many programs an SM
    holds at once (by registers, shared memory and threads).
`--launch 4x3,8x2` also compiles the attention kernel at those (num_warps x num_stages), and
`--reference` the jnp reference attention at the same shapes (XLA gathers a copy of every
row's K/V: hundreds of MB of temporaries, against the kernel's few).
`--engine-step` compiles the whole SmolLM2 engine step (the demo checkpoint, a 32-row decode
bucket) for each attention backend. For each it reports the whole-KV copies, the KV bytes
updated in place (aliased), the memory per GPU (arguments, temporaries, outputs), the
collectives in its HLO, and the kernels that one step launches. `--engine-model
qwen3_30b_a3b` compiles that model's step instead (abstract weights,
aot_engine_step.MODEL_SHAPES) at each of `--engine-placements` (e.g. 1,8,8ep: one GPU, 8 GPUs
of one host tensor-parallel, and with expert parallelism); `--engine-model llama3_8b
--quantization int4` an int4 Llama-3-8B's, with the memory left for KV beside it and the
whole dequantized matrices it materialises (outside fusions).

The plugin must match jaxlib exactly (jax 0.10.2: plugin 0.10.2). Install it beside the
project's environment, not into it: once it is importable, every jax process tries to start
CUDA. This script sets JAX_PLATFORMS=cpu itself, which skips that.

    v=$(python -c "import jaxlib; print(jaxlib.__version__)")
    pip install --no-deps --target .venv/gpu-aot "jax-cuda12-plugin==$v" \\
        "jax-cuda12-pjrt==$v" "nvidia-cuda-nvcc-cu12==12.9.86"
    PYTHONPATH=.venv/gpu-aot python benchmarks/gpu_aot_compile.py [--gpus h200,a100,l4]
        [--model llama3_8b,smollm2,head256] [--dtypes bfloat16,float32,int8,float8_e4m3fn]
        [--engine-step [--engine-model qwen3_30b_a3b --engine-placements 1,8,8ep]
        [--engine-model llama3_8b --quantization int4]] [--engine-backends pallas_gpu]
        [--launch 4x3,8x2] [--reference] [--json results.json]

tests/test_gpu_aot.py runs it in CI (.ci/run installs the plugin as above).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plugin's CUDA check would fail here

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attention
import jax
import jax.numpy as jnp
from aot_engine_step import (
    add_engine_model_arguments,
    describe_report,
    engine_models,
    lower_decode_step,
    memory_report,
    parse_placements,
    placed,
    step_report,
)
from jax.experimental import topologies

from ksana_jax.kv_cache import KVCache, float_kv_shapes, is_quantized
from ksana_jax.pallas_kernels import (
    paged_attention_gpu,
    paged_attention_gpu_launches,
    reference,
    write_kv_pages_gpu,
)
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA:GPU needs to know of a GPU to compile for it (a GpuTargetConfigProto)."""

    name: str
    compute_capability: tuple[int, int]
    sms: int
    shared_per_sm: int  # bytes
    shared_per_program: int  # bytes a program may opt in to
    threads_per_sm: int
    programs_per_sm: int  # the most resident at once
    bandwidth: float  # bytes/s
    l2_bytes: int
    clock_ghz: float
    memory_bytes: int

    def target_config(self) -> str:
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_per_sm}
  threads_per_core_limit: {self.threads_per_sm}
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {int(self.memory_bytes)}
  shared_memory_per_block_optin: {self.shared_per_program}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "{self.name}"
"""


# benchmarks/attention.py's model shapes (query heads, KV heads, head dim), and a 256-wide
# head (Gemma-2-9B- and Gemma-3-12B-like), where resolve_tuning shrinks key blocks and tiles.
MODELS = {**attention.MODELS, "head256": (16, 8, 256)}
# benchmarks/attention.py's device workloads (rows of (cached, new) tokens), and rows of 8 and
# of 16 new tokens (short chunks, speculative tokens): with them, every tile size the
# kernel picks by default is compiled.
WORKLOADS = {name: rows["device"] for name, rows in attention.WORKLOADS.items()}
WORKLOADS |= {"chunks8": [(1023, 8)] * 16, "chunks16": [(1023, 16)] * 16}
SOFTCAP = 50.0  # with the windowed workloads' window (attention.WINDOWS)


def attention_spec(workload: str, head_dim: int) -> AttentionSpec:
    """The layer description a workload compiles with: its window and a soft-cap, if it has
    a window (attention.WINDOWS); otherwise neither."""
    window = attention.WINDOWS.get(workload)
    softcap = None if window is None else SOFTCAP
    return AttentionSpec(head_dim**-0.5, sliding_window=window, logit_softcap=softcap)


MIB = 1 << 20
# Data-sheet figures. The L4 stands for the 99 KB-per-program parts (sm_86, sm_89): Colab's
# and most clouds' small GPUs.
GPUS = {
    "h200": Gpu(
        "NVIDIA H200", (9, 0), 132, 233472, 232448, 2048, 32, 4.8e12, 50 * MIB, 1.98, 141e9
    ),
    "a100": Gpu(
        "NVIDIA A100 80GB", (8, 0), 108, 167936, 166912, 2048, 32, 2e12, 40 * MIB, 1.41, 80e9
    ),
    "l4": Gpu("NVIDIA L4", (8, 9), 58, 102400, 101376, 1536, 24, 3e11, 48 * MIB, 2.04, 24e9),
}


@functools.cache
def gpu_devices(gpu: str, count: int = 1) -> tuple[jax.Device, ...]:
    """`count` GPUs of one host, only described (needs the CUDA PJRT plugin)."""
    config = GPUS[gpu].target_config()
    return tuple(
        topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{count}", target_config=config
        ).devices
    )


def gpu_sharding(gpu: str) -> jax.sharding.SingleDeviceSharding:
    """A sharding onto a GPU that is only described (needs the CUDA PJRT plugin)."""
    return jax.sharding.SingleDeviceSharding(gpu_devices(gpu)[0])


# ----------------------------------------------------------------------------- what XLA made

KernelLaunch = collections.namedtuple("KernelLaunch", "kernel grid threads shared_bytes")
_LAUNCH = re.compile(
    r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
    r"shared_memory: (\d+) bytes"
)


def launches(thunk_sequence: str) -> list[KernelLaunch]:
    """Every kernel launch in XLA's dumped thunk sequence, in order."""
    return [
        KernelLaunch(
            m[1], tuple(map(int, m.groups()[1:4])), tuple(map(int, m.groups()[4:7])), int(m[8])
        )
        for m in _LAUNCH.finditer(thunk_sequence)
    ]


def wait_groups(ptx: str) -> dict[int, int]:
    """How often each `cp.async.wait_group N` occurs in the PTX."""
    found = re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)
    return dict(sorted(collections.Counter(int(n) for n in found).items()))


@dataclasses.dataclass
class Compiled:
    """A compiled function and what XLA dumped while compiling it."""

    executable: jax.stages.Compiled
    launches: list[KernelLaunch]
    ptx: dict[str, str]  # kernel name -> its PTX module


def compile_dumped(lowered: jax.stages.Lowered) -> Compiled:
    """Compiles `lowered`, keeping XLA's thunk sequence (the launches) and PTX."""
    with tempfile.TemporaryDirectory() as dump:
        executable = lowered.compile({"xla_dump_to": dump})
        files = sorted(Path(dump).iterdir())
        (thunks,) = [f for f in files if f.name.endswith(".thunk_sequence.txt")]
        ptx = {}
        for f in files:
            if f.suffix == ".ptx":
                text = f.read_text()
                ptx.update({name: text for name in re.findall(r"\.entry (\w+)\(", text)})
        return Compiled(executable, launches(thunks.read_text()), ptx)


def find_ptxas() -> str | None:
    """A ptxas: from nvidia-cuda-nvcc-cu12 on the path, then from triton, then $PATH."""
    for entry in sys.path:
        for where in ("nvidia/cuda_nvcc/bin/ptxas", "triton/backends/nvidia/bin/ptxas"):
            candidate = Path(entry) / where
            if candidate.is_file():
                return str(candidate)
    return shutil.which("ptxas")


def ptxas_report(ptx: str, ptxas: str) -> dict[str, int]:
    """Registers per thread and spill bytes of the (single-kernel) PTX module `ptx`."""
    arch = re.search(r"^\.target (sm_\w+)", ptx, re.M)[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        proc = subprocess.run(
            [ptxas, "-v", "--gpu-name", arch, str(path), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    log = proc.stderr + proc.stdout
    return {
        "registers": int(re.search(r"Used (\d+) registers", log)[1]),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log)[1]),
    }


def programs_per_sm(gpu: Gpu, threads: int, registers: int, shared_bytes: int) -> int:
    """Programs of one launch resident on an SM at once, by CUDA's occupancy rules: 64K
    registers an SM, allocated 256 a warp at a time; 1 KB of shared memory reserved per
    program; the GPU's most programs an SM."""
    warps = -(-threads // 32)
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (warps * registers_per_warp)
    by_shared = gpu.shared_per_sm // (shared_bytes + 1024)
    by_threads = gpu.threads_per_sm // (warps * 32)
    return min(by_threads, by_registers, by_shared, gpu.programs_per_sm)


# ----------------------------------------------------------------------------- the kernels


def attention_shapes(rows, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    """Shapes of benchmarks/attention.py's batch for `rows` [(cached, new)]; no data."""
    batch = functools.partial(attention.build_batch, rows, num_heads, num_kv_heads, head_dim, dtype)
    return jax.eval_shape(batch)


def quantized_kv_shapes(kv, kv_dtype):
    """The abstract KVCache of `kv`'s page shape with `kv_dtype` (int8 / fp8) pages and their
    float32 row scales."""
    pages = kv.pages.shape
    return KVCache(
        jax.ShapeDtypeStruct(pages, kv_dtype), jax.ShapeDtypeStruct(pages[:5], jnp.float32)
    )


def kernels(model: str, dtype, workloads, extra_launches=(), reference_too=False):
    """(name, launch plan, jitted function, argument shapes) of each GPU kernel at a model's
    shapes: attention per workload (its default launches, then with each of
    `extra_launches` (warps, stages), then, with `reference_too`, the jnp reference through
    XLA), and both KV writes at the mixed workload's tokens (no plan: one launch). A
    `dtype` of int8 / float8_e4m3fn is a quantized KV of it, with float32 queries and new K/V
    (as the model passes them: the kernel then dots in float32)."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    kv_dtype = dtype
    if is_quantized(dtype):
        dtype = jnp.dtype(jnp.float32)
    found = []
    for workload in workloads:
        shapes = attention_shapes(WORKLOADS[workload], num_heads, num_kv_heads, head_dim, dtype)
        if kv_dtype != dtype:
            shapes = (*shapes[:3], quantized_kv_shapes(shapes[3], kv_dtype), *shapes[4:])
        spec = attention_spec(workload, head_dim)
        for warps, stages in [(None, None), *extra_launches]:
            named = {} if warps is None else dict(num_warps=warps, num_stages=stages)
            plan = paged_attention_gpu_launches.plan_launches(
                shapes[0].shape,
                shapes[3].pages.shape,
                dtype,
                shapes[5].shape,
                sliding_window=spec.sliding_window,
                **named,
            )
            fn = functools.partial(paged_attention_gpu.ragged_paged_attention, spec=spec, **named)
            found.append((f"attention/{workload}", plan, jax.jit(fn), shapes))
        if reference_too:
            fn = jax.jit(functools.partial(reference.ragged_paged_attention, spec=spec))
            found.append((f"reference/{workload}", None, fn, shapes))
    sds = jax.ShapeDtypeStruct
    num_tokens = sum(n for _, n in WORKLOADS["mixed"])
    kv = attention_shapes(WORKLOADS["mixed"], num_heads, num_kv_heads, head_dim, dtype)[3]
    kv = float_kv_shapes(sds((4, *kv.pages.shape[1:]), dtype))  # 4 layers: the every-layer write
    if kv_dtype != dtype:
        kv = quantized_kv_shapes(kv, kv_dtype)
    new = sds((num_tokens, num_kv_heads, head_dim), dtype)
    slots = sds((num_tokens,), jnp.int32)
    write_all = jax.jit(write_kv_pages_gpu.write_kv_pages, donate_argnums=0)
    write_layer = jax.jit(write_kv_pages_gpu.write_layer_kv, donate_argnums=0)
    all_layers = sds((4, 2, num_tokens, num_kv_heads, head_dim), dtype)
    found.append(("write_kv_pages", None, write_all, (kv, all_layers, slots)))
    found.append(("write_layer_kv", None, write_layer, (kv, sds((), jnp.int32), new, new, slots)))
    return found


def kernel_record(gpu: str, fn, shapes, ptxas: str | None, plan=None) -> dict:
    """Compiles one function for `gpu`: its kernel launches and temporaries, and each of its
    Pallas kernels (those XLA did not generate) with its `plan` tuning; or the error."""
    try:
        compiled = compile_dumped(fn.lower(*placed(list(shapes), gpu_sharding(gpu))))
    except Exception as e:  # report every kernel; the caller fails at the end
        return {"compiled": False, "error": str(e).splitlines()[0][:300]}
    tunings = {launch.name: launch.tuning._asdict() for launch in plan or ()}
    pallas = []
    for launch in compiled.launches:
        if not (launch.kernel.endswith("_gpu") and launch.kernel in compiled.ptx):
            continue
        ptx = compiled.ptx[launch.kernel]
        kernel = {
            "name": launch.kernel,
            "tuning": tunings.get(launch.kernel),
            "grid": launch.grid,
            "warps": launch.threads[0] // 32,
            "shared_bytes": launch.shared_bytes,
            "wait_groups": wait_groups(ptx),
        }
        if ptxas:
            kernel.update(ptxas_report(ptx, ptxas))
            threads = launch.threads[0] * launch.threads[1] * launch.threads[2]
            kernel["per_sm"] = programs_per_sm(
                GPUS[gpu], threads, kernel["registers"], launch.shared_bytes
            )
        pallas.append(kernel)
    return {
        "compiled": True,
        "launches": len(compiled.launches),
        "temp_bytes": compiled.executable.memory_analysis().temp_size_in_bytes,
        "kernels": pallas,
    }


# ----------------------------------------------------------------------------- the engine step


def engine_step_record(model, backend: str, sharding=None) -> dict:
    """Compiles the whole engine step (a 32-row decode bucket, contexts up to 1024) with
    `backend`, every argument on `sharding` (one described GPU) or, None, as the model's plan
    places it over described GPUs; counts its whole-KV copies, the KV bytes it updates in
    place (donated and aliased), its memory per device (arguments: params, KV, state;
    outputs, temporaries), collectives, the dequantized whole matrices it materialises (a
    quantized model) and its kernel launches."""
    lowered, kv = lower_decode_step(
        model, backend, "gpu", sharding, kv_cache_dtype="bfloat16"
    )  # bfloat16: what "auto" picks on a GPU for this bfloat16 model
    start = time.perf_counter()
    compiled = compile_dumped(lowered)
    seconds = time.perf_counter() - start
    # XLA names the kernels of one pallas_call at several shapes name, name__1, name__2, ...
    kernel_counts = collections.Counter(
        re.sub(r"__\d+$", "", launch.kernel) for launch in compiled.launches
    )
    return {
        "backend": backend,
        "compile_seconds": round(seconds, 1),
        **step_report(compiled.executable, kv, model),
        "launches": len(compiled.launches),
        "pallas_launches": {
            name: count for name, count in kernel_counts.items() if name.endswith("_gpu")
        },
    }


# ----------------------------------------------------------------------------- main


def _describe(record: dict) -> str:
    """Table rows for a compiled function: one for each Pallas kernel in it."""
    row = f"{record['gpu']:5s} {record['model']:10s} {record['dtype']:8s} {record['name']:21s} "
    if not record["compiled"]:
        return row + f"FAILED: {record['error']}"
    row += f"{record['launches']:8d} {record['temp_bytes'] / 1e6:8.1f}"
    lines = [row] if not record["kernels"] else []
    for kernel in record["kernels"]:
        tuning = kernel["tuning"]
        blocks = "-"
        if tuning:
            blocks = f"{tuning['block_q']}/{tuning['block_k']}/{tuning['num_kv_splits']}"
        launch = f"{kernel['warps']}x{tuning['num_stages'] if tuning else '-'}"
        grid = "x".join(map(str, kernel["grid"]))
        if "registers" in kernel:
            registers = f"{kernel['registers']:5d} {kernel['spill_bytes']:7d} {kernel['per_sm']:6d}"
        else:
            registers = f"{'-':>5s} {'-':>7s} {'-':>6s}"
        waits = ", ".join(f"{n}: {c}" for n, c in kernel["wait_groups"].items()) or "-"
        short = " (short rows)" if kernel["name"].endswith("short_rows_gpu") else ""
        lines.append(
            f"{row if not lines else ' ' * len(row)} {blocks:>12s} {launch:>5s} {grid:>11s} "
            f"{kernel['shared_bytes'] / 1024:7.1f} {registers}  {waits}{short}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument("--model", default=",".join(MODELS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--launch", default="", help="extra warps x stages, e.g. 4x3,8x2")
    parser.add_argument(
        "--reference", action="store_true", help="also the jnp reference attention via XLA"
    )
    parser.add_argument("--engine-step", action="store_true")
    add_engine_model_arguments(parser, "described GPUs of one host")
    parser.add_argument("--engine-backends", default="reference,pallas_gpu")
    parser.add_argument("--json", help="also write every record to this file")
    args = parser.parse_args()

    try:
        for gpu in args.gpus.split(","):
            gpu_sharding(gpu)
    except NotImplementedError:  # jax has no CUDA plugin to describe a GPU with
        raise SystemExit(
            "no CUDA PJRT plugin: install it beside the venv and put it on PYTHONPATH, as this "
            "script's docstring says"
        ) from None
    extra = [tuple(int(x) for x in s.split("x")) for s in args.launch.split(",") if s]
    ptxas = find_ptxas()
    print(f"jax {jax.__version__}; ptxas: {ptxas or 'none (no registers or spills)'}")
    print(
        f"{'gpu':5s} {'model':10s} {'KV':8s} {'function':21s} {'launches':>8s} {'temp MB':>8s} "
        f"{'bq/bk/splits':>12s} {'wxs':>5s} {'grid':>11s} {'smem KB':>7s} {'regs':>5s} "
        f"{'spill B':>7s} {'per SM':>6s}  cp.async waits (N: count)"
    )
    records, failures = [], 0
    for gpu, model, dtype_name in itertools.product(
        args.gpus.split(","), args.model.split(","), args.dtypes.split(",")
    ):
        dtype = jnp.dtype(dtype_name)
        for name, plan, fn, shapes in kernels(
            model, dtype, args.workloads.split(","), extra, args.reference
        ):
            record = dict(gpu=gpu, model=model, dtype=dtype.name, name=name)
            record.update(kernel_record(gpu, fn, shapes, ptxas, plan))
            failures += not record["compiled"]
            print(_describe(record))
            records.append(record)
    if args.engine_step:
        count = max(tp for tp, _ in parse_placements(args.engine_placements))
        for gpu in args.gpus.split(","):
            devices = gpu_devices(gpu, count)
            for label, model, sharding in engine_models(
                args.engine_model, args.engine_placements, devices, args.quantization
            ):
                for backend in args.engine_backends.split(","):
                    record = engine_step_record(model, backend, sharding)
                    print(
                        f"{gpu:5s} {label} engine step, {backend}: compiled in "
                        f"{record['compile_seconds']} s; {record['kv_copies']} whole-KV copies; "
                        f"KV {record['kv_bytes'] / 1e6:.0f} MB; {describe_report(record)}; "
                        f"{record['launches']} kernel launches {record['pallas_launches'] or ''}"
                    )
                    print(f"      {memory_report(record, GPUS[gpu].memory_bytes)}")
                    records.append(dict(gpu=gpu, name="engine_step", model=label, **record))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if failures:
        raise SystemExit(f"{failures} kernel(s) failed to compile")


if __name__ == "__main__":
    main()
