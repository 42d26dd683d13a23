"""Builds and registers the C++ XLA FFI kernels for CPUs (ragged_paged_attention_cpu.cc,
linear_cpu.cc) at first use.

A kernel's source is compiled with the system C++ compiler (`$CXX`, default `g++`; flags
`-O3 -march=native -fopenmp-simd`, no OpenMP runtime) into ~/.cache/ksana-jax/kernels (or
$KSANA_JAX_KERNEL_CACHE), keyed by the source and the headers it includes from its folder,
the compiler command, jaxlib's version and the machine, so a machine builds each kernel once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "ksana-jax" / "kernels"
    return Path(os.environ.get("KSANA_JAX_KERNEL_CACHE", default))


def _compile_command(source: Path, output: Path) -> list[str]:
    compiler = shlex.split(os.environ.get("CXX", "g++"))
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]
    return [*compiler, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(output)]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; none elsewhere): part of a library's
    key, so a cache shared across machines rebuilds, and what a kernel's paths depend on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _source_bytes(source: Path) -> list[bytes]:
    """The bytes of `source` and of every header it includes from its own folder
    (`#include "name"`, followed through those headers), so editing a header rebuilds."""
    parts, seen, todo = [], set(), [source]
    while todo:
        path = todo.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        text = path.read_bytes()
        parts.append(text)
        todo += [source.parent / name.decode() for name in _LOCAL_INCLUDE.findall(text)]
    return parts


@functools.cache
def library_path(source: Path) -> Path:
    """The compiled library of the kernel source `source` (a .cc file), built now if this
    machine has not built it yet. Raises RuntimeError with the compiler's output when the
    build fails."""
    key = hashlib.sha256()
    for part in (*_source_bytes(source), " ".join(_compile_command(Path("x"), Path("y"))).encode()):
        key.update(part)
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    key.update(f"{jaxlib.__version__} {platform.machine()} {flags}".encode())
    path = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        try:
            result = subprocess.run(
                _compile_command(source, built), capture_output=True, text=True, check=False
            )
        except OSError as e:  # no compiler
            raise RuntimeError(f"cannot build {source.name}: {e}") from None
        if result.returncode:
            raise RuntimeError(
                f"cannot build {source.name} ({shlex.join(result.args)}):\n{result.stderr[-4000:]}"
            )
        os.replace(built, path)  # atomic: concurrent builders each publish a whole file
    return path


@functools.cache
def register(source: Path, symbol: str, target: str) -> None:
    """Builds `source` (once per machine), loads it and registers its handler `symbol` as
    the CPU FFI target `target`. Raises RuntimeError or OSError when that fails."""
    library = ctypes.cdll.LoadLibrary(str(library_path(source)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


def available(source: Path, symbol: str, target: str) -> bool:
    """Whether the kernel builds and loads on this machine."""
    try:
        register(source, symbol, target)
    except (RuntimeError, OSError):
        return False
    return True
