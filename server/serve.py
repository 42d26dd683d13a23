"""`ksana-jax serve`: load a model, start the engine thread, serve the app with uvicorn.

The server listens at once; the engine thread compiles every step bucket first, and
`/health` answers 503 (completions too, with Retry-After) until it is done.

With several processes (`--num-processes`, see multihost.py) only process 0 serves HTTP; the
others load their shards of the model and run the steps process 0 sends them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import jax
import uvicorn

from ksana_jax import multihost
from ksana_jax.async_engine import AsyncEngine
from ksana_jax.config import EngineConfig
from ksana_jax.demo import DEMO_NAME, cache_dir, resolve_model
from ksana_jax.engine import LLMEngine
from ksana_jax.model import load
from server.app import create_app

log = logging.getLogger("ksana_jax.server")


def serve(
    model: str,
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_pending_requests: int = 1024,
    log_level: str = "info",
) -> None:
    start = time.perf_counter()
    # A persistent compilation cache by default: a restart skips most of the warm-up.
    compile_cache = config.compilation_cache_dir or str(cache_dir() / "jax")
    jax.config.update("jax_compilation_cache_dir", compile_cache)
    name = served_model_name or (
        "SmolLM2-135M-Instruct" if model == DEMO_NAME else Path(model).name or model
    )
    loaded = load(
        resolve_model(model), dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size
    )
    engine = LLMEngine(loaded, config)
    if multihost.is_follower():
        print(
            f"ksana-jax: process {jax.process_index()} of {jax.process_count()} runs the steps "
            "of process 0, which serves HTTP",
            file=sys.stderr,
            flush=True,
        )
        multihost.follow(engine.runner)
        multihost.shutdown()
        return
    shapes = len(engine.runner.bucket_shapes())
    print(
        f"ksana-jax: loaded {name} in {time.perf_counter() - start:.1f}s, "
        f"{loaded.plan.describe()}, attention backend {engine.runner.backend}; compiling "
        f"{shapes} step shapes before /health turns 200",
        file=sys.stderr,
        flush=True,
    )
    async_engine = AsyncEngine(engine, warm_up=True)
    key_source = "flag" if api_key else "env" if os.environ.get("KSANA_API_KEY") else None
    api_key = api_key or os.environ.get("KSANA_API_KEY")
    app = create_app(async_engine, name, api_key, max_pending_requests)
    app.on_startup.append(lambda: _announce(async_engine, host, port, name, start, key_source))

    def stop_engine() -> None:  # idempotent
        async_engine.shutdown()
        if engine.runner.channel is not None:
            engine.runner.channel.close()  # the followers exit
            multihost.shutdown()  # waits until they have

    # On SIGTERM uvicorn shuts the app down and then re-raises the signal, so the followers
    # are released from the app's shutdown, not after uvicorn.run returns.
    app.on_shutdown.append(stop_engine)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        stop_engine()


def _announce(
    engine: AsyncEngine, host: str, port: int, name: str, start: float, key_source: str | None
) -> None:
    """Once warm-up is done, prints a curl line to paste. With an API key ("flag" or "env")
    the line reads it from $KSANA_API_KEY, so the key itself never reaches the log."""
    url = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $KSANA_API_KEY"' if key_source else ""
    hint = "  (first: export KSANA_API_KEY=<your --api-key>)" if key_source == "flag" else ""

    def wait() -> None:
        engine.ready.wait()
        if engine.is_dead:
            return
        print(
            f"ksana-jax: ready in {time.perf_counter() - start:.1f}s, serving {name} at {url}\n"
            f"  curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
            f'-d \'{{"prompt": "The capital of France is", "max_tokens": 16}}\'{hint}',
            file=sys.stderr,
            flush=True,
        )

    threading.Thread(target=wait, daemon=True).start()
