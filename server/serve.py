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
from litestar import Litestar

from ksana_jax import multihost
from ksana_jax.async_engine import AsyncEngine
from ksana_jax.config import EngineConfig
from ksana_jax.demo import DEMO_NAME, cache_dir, resolve_model
from ksana_jax.engine import LLMEngine
from ksana_jax.model import load
from ksana_jax.sampling_defaults import described, sampling_defaults
from server.app import check_parsers, create_app, start_workers, stop_accepting
from server.limits import RequestLimits
from server.shutdown import Server, with_header_timeout

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
    api_key_file: str | None = None,
    limits: RequestLimits | None = None,
    shutdown_timeout: float = 30,
    header_timeout: float = 10,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    enable_prompt_tokens_details: bool = False,
) -> None:
    start = time.perf_counter()
    check_parsers(tool_call_parser, reasoning_parser)  # a bad name: fail before loading
    file_keys = read_api_keys(api_key_file) if api_key_file else []  # a bad file: fail first
    # A persistent compilation cache by default: a restart skips most of the warm-up.
    compile_cache = config.compilation_cache_dir or str(cache_dir() / "jax")
    jax.config.update("jax_compilation_cache_dir", compile_cache)
    name = served_model_name or (
        "SmolLM2-135M-Instruct" if model == DEMO_NAME else Path(model).name or model
    )
    path = resolve_model(model)  # `demo`: converted on first use (or its install hint)
    print(f"ksana-jax: loading {model}", file=sys.stderr, flush=True)
    loaded = load(
        path,
        dtype=config.dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel,
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
        f"{shapes} step shapes before /health turns 200; sampling defaults: "
        f"{described(sampling_defaults(loaded.generation_config))}",
        file=sys.stderr,
        flush=True,
    )
    async_engine = AsyncEngine(engine, warm_up=True)
    key_source = "flag" if api_key else "env" if os.environ.get("KSANA_API_KEY") else None
    key_source = key_source or ("file" if file_keys else None)
    api_key = api_key or os.environ.get("KSANA_API_KEY")
    keys = ([api_key] if api_key else []) + file_keys
    app = create_app(
        async_engine,
        name,
        keys,
        max_pending_requests,
        limits=limits,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    app.on_startup.append(lambda: start_workers(app))
    stopping: list[threading.Event] = []  # the server's, once it exists
    app.on_startup.append(
        lambda: _announce(async_engine, host, port, name, start, key_source, stopping[0])
    )

    def stop_engine() -> None:  # idempotent
        # A warm-up compile cannot be interrupted: do not wait for it.
        async_engine.shutdown(timeout=30 if async_engine.ready.is_set() else 0)
        if engine.runner.channel is not None:
            engine.runner.channel.close()  # the followers exit
            multihost.shutdown()  # waits until they have

    # The followers are released from the app's shutdown too, so that they go even if
    # something after uvicorn's return fails.
    app.on_shutdown.append(stop_engine)
    server = _server(app, async_engine, host, port, log_level, shutdown_timeout, header_timeout)
    stopping.append(server.stopping)
    try:
        server.run()
    finally:
        stop_engine()
    if server.stopping.is_set():
        print(
            f"ksana-jax: stopped; {server.num_aborted} request(s) aborted, KV cache usage "
            f"{async_engine.snapshot().kv_cache_usage:.0%}",
            file=sys.stderr,
            flush=True,
        )
    if not async_engine.ready.is_set():  # still compiling: nothing to wait for
        sys.stdout.flush()
        os._exit(0)


def _server(
    app: Litestar,
    engine: AsyncEngine,
    host: str,
    port: int,
    log_level: str,
    shutdown_timeout: float,
    header_timeout: float,
) -> Server:
    """uvicorn, stopped as shutdown.py says."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=with_header_timeout(header_timeout),
        # A backstop only: at shutdown_timeout every request is aborted, which ends them.
        timeout_graceful_shutdown=int(shutdown_timeout) + 10,
    )

    def abort_all() -> int:
        return engine.abort_all("the server is shutting down")

    return Server(config, lambda: stop_accepting(app), abort_all, shutdown_timeout)


def read_api_keys(path: str) -> list[str]:
    """The keys in an --api-key-file: one a line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --api-key-file {path}: {e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def _announce(
    engine: AsyncEngine,
    host: str,
    port: int,
    name: str,
    start: float,
    key_source: str | None,
    stopping: threading.Event,
) -> None:
    """Once warm-up is done, prints a curl line to paste. With an API key ("flag", "env", "file")
    the line reads it from $KSANA_API_KEY, so the key itself never reaches the log."""
    url = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $KSANA_API_KEY"' if key_source else ""
    hint = {
        "flag": "  (first: export KSANA_API_KEY=<your --api-key>)",
        "file": "  (first: export KSANA_API_KEY=<a key from --api-key-file>)",
    }.get(key_source or "", "")

    def wait() -> None:
        engine.ready.wait()
        if engine.is_dead or stopping.is_set():  # never "ready" for a server that is going
            return
        print(
            f"ksana-jax: ready in {time.perf_counter() - start:.1f}s, serving {name} at {url}\n"
            f"  curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
            f'-d \'{{"prompt": "The capital of France is", "max_tokens": 16}}\'{hint}',
            file=sys.stderr,
            flush=True,
        )

    threading.Thread(target=wait, daemon=True).start()
