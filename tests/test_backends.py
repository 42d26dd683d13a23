"""Engine integration of the attention backends: greedy tokens from the real SmolLM2 with the
cpu and xla backends and the Pallas ones (interpret mode on CPU) equal the reference
backend's; "auto" picks the cpu kernel here and falls back to xla where it cannot build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ksana_jax import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]
CONFIG = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(32,),
    seq_buckets=(4,),
    context_buckets=(32, 128),
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    llm = LLM(smollm2, warm_up=False, attention_backend="reference", **CONFIG)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_backend_greedy_equals_reference(smollm2, reference_tokens, backend):
    llm = LLM(smollm2, warm_up=False, attention_backend=backend, **CONFIG)
    assert llm.engine.runner.backend.name == backend
    with pytest.warns(UserWarning, match="interpret mode"):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_cpu_backends_greedy_equal_reference(smollm2, reference_tokens, backend):
    llm = LLM(smollm2, warm_up=False, attention_backend=backend, **CONFIG)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens


def test_auto_backend_is_the_cpu_kernel_on_cpu(smollm2):
    llm = LLM(smollm2, warm_up=False, **CONFIG)
    assert llm.engine.runner.backend.name == "cpu"
    assert llm.engine.runner.context_buckets == (128,)  # the page-table width costs it nothing


def test_auto_falls_back_to_xla_without_a_compiler(tmp_path):
    """A machine that cannot build the cpu kernel still serves: "auto" warns and picks xla."""
    script = (
        "import warnings, jax\n"
        "from ksana_jax.pallas_kernels import ragged_paged_attention_cpu as cpu, resolve_backend\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    backend = resolve_backend('auto', 'cpu')\n"
        "print(backend, cpu.available(), [str(w.message) for w in caught])\n"
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "KSANA_JAX_KERNEL_CACHE": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("xla False ["), out
    assert "could not be built" in out


@pytest.mark.gpu
@pytest.mark.tpu
def test_compiled_kernel_backend_greedy_equals_reference(tmp_path):
    """On a GPU or TPU, the engine with the compiled kernel backend ("auto") generates the
    reference backend's greedy tokens, on a random model with SmolLM2's attention shape
    (9 query heads over 3 KV heads of 64) -- the checkpoint cannot travel to the device."""
    import jax
    from conftest import write_tiny_hf

    import ksana_jax

    if jax.default_backend() not in ("gpu", "tpu"):
        pytest.skip(f"needs a TPU or GPU, running on {jax.default_backend()}")
    write_tiny_hf(
        tmp_path,
        hidden_size=576,
        intermediate_size=256,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=2,
    )
    model = ksana_jax.load(tmp_path)
    tokens = {}
    with jax.default_matmul_precision("highest"):  # f32 dots on both paths, not TF32
        for backend in ("reference", "auto"):
            llm = LLM(model, warm_up=False, attention_backend=backend, **CONFIG)
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            tokens[llm.engine.runner.backend.name] = [o.outputs[0].token_ids for o in outs]
    assert set(tokens) == {
        "reference",
        {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}[jax.default_backend()],
    }
    assert len(set(map(str, tokens.values()))) == 1, tokens


@pytest.mark.parametrize(
    "backend,model_overrides,engine_overrides,message",
    [
        # float32 KV: Mosaic tiles 8 rows, so a page of 4 cannot be one DMA tile.
        ("pallas_tpu", {}, {"page_size": 4}, "page_size=4 must be a multiple of 8"),
        # Mosaic compiles no float16 vector load (benchmarks/tpu_kernel_compile.py).
        ("pallas_tpu", {}, {"kv_cache_dtype": "float16"}, "float16 cannot be read on TPU"),
        # head_dim 24 (144 / 6 heads): Triton tensors need a power of two.
        ("pallas_gpu", {"hidden_size": 144}, {}, "head_dim=24 must be a power of two"),
    ],
)
def test_pallas_backend_rejects_a_model_it_cannot_run_before_compiling(
    tmp_path, backend, model_overrides, engine_overrides, message
):
    from conftest import write_tiny_hf

    import ksana_jax

    write_tiny_hf(tmp_path, **model_overrides)
    model = ksana_jax.load(tmp_path)
    with pytest.raises(ValueError, match=f"attention_backend='{backend}'.*{message}"):
        LLM(model, warm_up=False, attention_backend=backend, max_model_len=64, **engine_overrides)
    LLM(model, warm_up=False, attention_backend="xla", max_model_len=64, **engine_overrides)
