"""cpu_schedule.py: `import ksana_jax` asks XLA:CPU for a program order for one thread
(the same order XLA_FLAGS naming the option gives), unless told not to or XLA_FLAGS names
the option already. Each case runs in a fresh interpreter: XLA reads XLA_FLAGS when JAX
starts its CPU backend."""

import json
import os
import subprocess
import sys

from ksana_jax import cpu_schedule

# Three independent branches: XLA's concurrency-optimized order interleaves them.
SCRIPT = """
import json, os
import ksana_jax, jax, jax.numpy as jnp
def f(x, w1, w2, w3):
    a, b, c = jnp.tanh(x @ w1), jnp.sin(x @ w2), jnp.cos(x @ w3)
    return (a * b + c).sum(), a.max(), b.min()
args = [jax.ShapeDtypeStruct((8, 256), jnp.float32)]
args += [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 3
text = jax.jit(f).lower(*args).compile().as_text()
order = [line.split("=")[0].strip() for line in text.splitlines()
         if line.strip().startswith("%") and "fusion" in line]
print(json.dumps({"order": order, "flags": os.environ.get("XLA_FLAGS", "")}))
"""


def _run(**env_values: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", cpu_schedule.ENV)}
    env |= {"JAX_PLATFORMS": "cpu", **env_values}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_orders_cpu_programs_for_one_thread():
    default = _run(**{cpu_schedule.ENV: "0"})
    assert cpu_schedule.OPTION not in default["flags"]
    explicit = _run(**{cpu_schedule.ENV: "0", "XLA_FLAGS": f"--{cpu_schedule.OPTION}=false"})
    assert explicit["order"] != default["order"]  # the program tells the two orders apart
    imported = _run()
    assert imported["flags"] == f"--{cpu_schedule.OPTION}=false"
    assert imported["order"] == explicit["order"]
    # XLA_FLAGS naming the option wins; other flags are kept
    user = _run(XLA_FLAGS=f"--xla_cpu_enable_fast_math=false --{cpu_schedule.OPTION}=true")
    assert user["flags"] == f"--xla_cpu_enable_fast_math=false --{cpu_schedule.OPTION}=true"
    assert user["order"] == default["order"]


def test_only_on_cpu_with_a_jaxlib_that_knows_the_option():
    known = cpu_schedule.KNOWN[0]
    version = ".".join(map(str, known))
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert cpu_schedule.sequential_cpu_schedule(env, version)
    assert env["XLA_FLAGS"] == (f"--xla_cpu_enable_fast_math=false --{cpu_schedule.OPTION}=false")
    assert not cpu_schedule.sequential_cpu_schedule(env, version)  # named already: once
    for env in (
        {"JAX_PLATFORMS": "cuda"},
        {"JAX_PLATFORMS": "cpu", cpu_schedule.ENV: "off"},
    ):
        assert not cpu_schedule.sequential_cpu_schedule(env, version)
        assert "XLA_FLAGS" not in env
    high = ".".join(map(str, cpu_schedule.KNOWN[1]))
    for other in ("0.10.1", high, "1.0.0"):  # XLA ends the process on an unknown flag
        env = {"JAX_PLATFORMS": "cpu"}
        assert not cpu_schedule.sequential_cpu_schedule(env, other)
        assert "XLA_FLAGS" not in env
