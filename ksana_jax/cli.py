"""The `ksana-jax` command line: `convert`, `generate` and `serve`.

`serve` takes every EngineConfig field as a flag (`--max-num-seqs 16`, `--token-buckets
16,64,256`), derived from the dataclass so the two cannot drift apart.

User errors (bad paths, bad files, unsupported models) print one `ksana-jax COMMAND: error:`
line on stderr and exit with status 2 (bad flags too, after argparse's usage line);
tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Sequence
from typing import Any

from ksana_jax.config import ENGINE_DTYPES, QUANTIZATIONS, EngineConfig


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert an HF safetensors directory or a GGUF file to a ksana-jax checkpoint",
        description="Convert SOURCE (a Hugging Face checkpoint directory with safetensors, or a "
        ".gguf file) into a ksana-jax checkpoint directory (config.json, orbax params, "
        "tokenizer files), written atomically.",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="HF checkpoint directory, .gguf file, or `demo` (the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="checkpoint directory to create")
    p.add_argument(
        "--dtype",
        choices=[d for d in ENGINE_DTYPES if d != "auto"],
        default=None,
        help="parameter dtype (default: the source's; float32 for GGUF)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="store every matrix quantized: int8 (per output channel) or int4 (asymmetric "
        "groups of 32); a GGUF's Q4_0/Q4_1/Q8_0 blocks are kept as they are (default: float)",
    )
    p.add_argument("--force", action="store_true", help="overwrite OUTPUT_DIR if it exists")
    p.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from checkpoints_tools import convert
    from ksana_jax.demo import DEMO_NAME, convert_demo

    start = time.perf_counter()
    options = dict(dtype=args.dtype, force=args.force, quantization=args.quantization)
    if args.source == DEMO_NAME:
        out = convert_demo(args.output_dir, **options)
    else:
        out = convert(args.source, args.output_dir, **options)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Load MODEL (checkpoint directory, HF directory, .gguf or `demo`) and "
        "generate through the engine (continuous-batching scheduler, paged KV) a "
        "completion of PROMPT with jitted chunked prefill and decode on the paged KV.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="checkpoint directory, HF directory, .gguf file, or `demo` (the "
        "bundled SmolLM2-135M-Instruct, converted once into the user cache)",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT as a user message in the model's chat template",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"prompt_token_ids", "token_ids", "text"} as JSON',
    )
    p.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default="auto",
        help="parameter dtype (default: the checkpoint's)",
    )
    add_engine_flags(p, only=_GENERATE_ENGINE_FLAGS, defaults_none=True)
    p.set_defaults(run=_run_generate)


# The engine flags `generate` takes (defaults: one request, see _run_generate).
_GENERATE_ENGINE_FLAGS = (
    "max_model_len",
    "page_size",
    "num_pages",
    "kv_cache_memory_gib",
    "kv_cache_dtype",
    "max_num_batched_tokens",
    "attention_backend",
    "tensor_parallel_size",
    "quantization",
    "compilation_cache_dir",
)


# Shown with a progress bar on stderr: outputs this long take minutes on a CPU.
PROGRESS_TOKENS = 128


def _run_generate(args: argparse.Namespace) -> int:
    from ksana_jax import LLM, SamplingParams, load
    from ksana_jax.demo import resolve_model

    if args.chat and not args.prompt.strip():
        raise ValueError("PROMPT is empty; --chat sends it as the user's message")
    model = load(resolve_model(args.model), dtype=args.dtype, quantization=args.quantization)
    tok = model.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt_ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tok.encode(args.prompt)
    # One request: compile only the shapes it uses instead of warming up every bucket. The
    # engine flags given on the command line override these defaults.
    config = {
        "max_model_len": min(
            model.config.max_position_embeddings, max(2048, len(prompt_ids) + args.max_tokens)
        ),
        "max_num_seqs": 1,
        "max_num_batched_tokens": 64,
    }
    given = {name: getattr(args, name) for name in _GENERATE_ENGINE_FLAGS}
    config |= {name: value for name, value in given.items() if value is not None}
    llm = LLM(model, warm_up=False, **config)
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens
    )
    out = _generate_with_progress(llm, prompt_ids, params)
    if args.json:
        print(
            json.dumps(
                {"prompt_token_ids": prompt_ids, "token_ids": out.token_ids, "text": out.text},
                ensure_ascii=False,
            )
        )
    else:
        print(out.text)
    return 0


def _generate_with_progress(llm, prompt_ids: list[int], params):
    """The finished output; a token-count progress bar on stderr for long outputs (opened
    at the first output, so that a request the engine refuses prints only its error)."""
    from tqdm import tqdm

    long = (params.max_tokens or 0) >= PROGRESS_TOKENS
    bar = None
    try:
        for out in llm.stream(prompt_ids, params):
            if bar is None:
                bar = tqdm(
                    total=params.max_tokens,
                    unit="tok",
                    file=sys.stderr,
                    disable=not long,
                    leave=False,
                )
            bar.update(len(out.outputs[0].token_ids) - bar.n)
    finally:
        if bar is not None:
            bar.close()
    return out.outputs[0]


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_flags(
    parser: argparse.ArgumentParser,
    only: Sequence[str] | None = None,
    defaults_none: bool = False,
) -> None:
    """One flag per EngineConfig field: `--field-name`, typed and defaulted from the field.

    `only`: just these fields; `defaults_none`: every flag defaults to None (not given), for
    a command whose own defaults differ from EngineConfig's.
    """
    title = "engine (EngineConfig fields)"
    if defaults_none:
        title += "; defaults for one request: max_model_len = prompt + --max-tokens (at "
        title += "least 2048, at most the model's context), max_num_batched_tokens 64"
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if only is not None and field.name not in only:
            continue
        hint = hints[field.name]
        options: dict[str, Any] = {"default": field.default, "dest": field.name}
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        if base is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is dict:
            options["type"] = _json_object
            options["metavar"] = "JSON"
        elif typing.get_origin(base) is tuple:
            options["type"] = _int_tuple
            options["metavar"] = "N,N,..."
        else:
            options["type"] = base
        if field.metadata.get("choices"):
            options["choices"] = field.metadata["choices"]
        help_text = field.metadata.get("help", "")
        if defaults_none:
            options["default"] = None  # the command's own default, which its help gives
        elif field.default not in (None, ()):
            help_text += f" (default: {field.default})"
        options["help"] = help_text
        group.add_argument("--" + field.name.replace("_", "-"), **options)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (completions, chat, metrics)",
        description="Load MODEL and serve /v1/completions, /v1/chat/completions, /v1/models, "
        "/health (200 once every step shape is compiled), /metrics (Prometheus) and /schema "
        "(OpenAPI). Engine flags are the EngineConfig fields.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        default="demo",
        help="checkpoint directory, HF directory, .gguf file, or `demo` (default: the "
        "bundled SmolLM2-135M-Instruct, converted once into the user cache)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KSANA_API_KEY, "
        "else no key)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="accept any of the keys in FILE (one a line; blank lines and # comments "
        "skipped), besides --api-key",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: from MODEL)",
    )
    p.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="sequences (prompts x n) queued or running before new requests get 503 (default 1024)",
    )
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=16,
        help="stop strings a request may send (default 16; more is a 400)",
    )
    p.add_argument(
        "--max-stop-chars",
        type=int,
        default=4096,
        help="characters a request's stop strings may hold together (default 4096)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may finish before they are aborted "
        "(default 30; SIGINT or a second signal aborts at once)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request line and headers take longer (default 10)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how chat answers under tool_choice auto are read: hermes (<tool_call> JSON "
        "blocks: Qwen2.5, Qwen3, SmolLM2) or llama3_json (Llama 3.x); default: from the chat "
        "template's own format",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split <think>...</think> into message.reasoning_content: qwen3 or deepseek_r1 "
        "(default: none, the text stays content)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the "
        "prefix cache (off by default: it tells a client whether others sent its prefix)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default info)",
    )
    hosts = p.add_argument_group(
        "multi-host (one process per host; all get the same flags but --process-id)"
    )
    hosts.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed.initialize (default: one process)",
    )
    hosts.add_argument(
        "--num-processes", type=int, default=1, help="processes in the mesh (default 1)"
    )
    hosts.add_argument(
        "--process-id",
        type=int,
        default=0,
        help="this process's rank; 0 serves HTTP, the others run its steps (default 0)",
    )
    add_engine_flags(p)
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from server.serve import serve  # the server sits above the engine; imported on demand

    if args.num_processes > 1 or args.coordinator_address:
        if not args.coordinator_address:
            raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT")
        from ksana_jax import multihost

        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    from server.limits import RequestLimits

    limits = RequestLimits(
        max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars
    )
    serve(
        args.model,
        engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        limits=limits,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        served_model_name=args.served_model_name,
        max_pending_requests=args.max_pending_requests,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ksana-jax",
        description="LLM inference and serving on JAX/XLA.",
        epilog="`ksana-jax COMMAND --help` lists a command's options. MODEL may be `demo`, "
        "the bundled SmolLM2-135M-Instruct (`ksana-jax serve` with no MODEL serves it).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(sub)
    _add_generate(sub)
    _add_serve(sub)
    return parser


def _exit_on_interrupt(command: str) -> None:
    """Ctrl-C (or SIGTERM) from now on prints one line and exits at once: a
    KeyboardInterrupt raised while loading or compiling can land in a callback that swallows
    it, or leave threads of an unfinished load or compile that the exit would wait for.
    (`serve` replaces this with its own handling while uvicorn runs.)"""

    def handler(signum: int, frame: object) -> None:
        print(f"ksana-jax {command}: interrupted", file=sys.stderr, flush=True)
        os._exit(130 if signum == signal.SIGINT else 143)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "convert" and argv is None:  # a process of its own, not a test's call
        _exit_on_interrupt(args.command)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ksana-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C while loading or compiling: one line, and out at once, without waiting for
        # (or printing tracebacks from) the threads of an unfinished load or compile.
        print(f"ksana-jax {args.command}: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
