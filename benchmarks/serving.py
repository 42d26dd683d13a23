"""Online serving benchmark: an async load generator against a running ksana-jax server.

Sends streaming `/v1/completions` requests (random token-id prompts, `ignore_eos` so output
lengths are exact) at a fixed concurrency, or with Poisson arrivals at `--request-rate`, and
prints vLLM's serving-benchmark metrics (TTFT, TPOT, ITL, end-to-end latency: mean, median,
p90, p99; request and token throughput), one column per concurrency. Without `--url` it
starts `ksana-jax serve MODEL` itself and also reports the startup time to a healthy server.

    python benchmarks/serving.py --concurrency 1 8 32 [--url http://127.0.0.1:8000]
    python benchmarks/serving.py --model demo --request-rate 4 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import subprocess
import sys
import time

import httpx
import numpy as np


@dataclasses.dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last, result = start, Result(ok=False)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                return result
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens == max_tokens
    if not result.ok and not result.error:
        result.error = f"got {result.output_tokens} tokens, asked for {max_tokens}"
    return result


async def run_load(args, url: str, model: str, concurrency: int) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, args.vocab) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    limit = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(600, connect=30)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def limited(prompt):
            async with limit:
                return await one_request(client, url, model, prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    ms = lambda xs: np.array(xs or [np.nan]) * 1000  # noqa: E731
    ttft = ms([r.ttft for r in done])
    tpot = ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1])
    itl = ms([x for r in done for x in r.itl])
    e2e = ms([r.e2e for r in done])
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    row = {
        "Successful requests": len(done),
        "Failed requests": len(results) - len(done),
        "Benchmark duration (s)": duration,
        "Total input tokens": in_tokens,
        "Total generated tokens": out_tokens,
        "Request throughput (req/s)": len(done) / duration,
        "Output token throughput (tok/s)": out_tokens / duration,
        "Total token throughput (tok/s)": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2EL", e2e)):
        row[f"Mean {name} (ms)"] = float(np.mean(values))
        row[f"Median {name} (ms)"] = float(np.median(values))
        row[f"P90 {name} (ms)"] = float(np.percentile(values, 90))
        row[f"P99 {name} (ms)"] = float(np.percentile(values, 99))
    return row


def print_table(columns: dict[str, dict[str, float]]) -> None:
    names = list(next(iter(columns.values())))
    width = max(len(n) for n in names) + 2
    print("=" * (width + 12 * len(columns)))
    print("Serving Benchmark Result".ljust(width) + "".join(f"{c:>12}" for c in columns))
    print("-" * (width + 12 * len(columns)))
    for name in names:
        cells = []
        for col in columns.values():
            value = col[name]
            cells.append(f"{value:>12.0f}" if float(value).is_integer() else f"{value:>12.2f}")
        print(name.ljust(width) + "".join(cells))
    print("=" * (width + 12 * len(columns)))


def start_server(args) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "ksana_jax.cli", "serve", args.model, "--port", str(port)]
    cmd += ["--log-level", "warning", *args.serve_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one for --model)")
    parser.add_argument("--model", default="demo", help="MODEL for `ksana-jax serve` (demo)")
    parser.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest of the line goes to `ksana-jax serve` (e.g. --max-num-seqs 32)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=None, help="default 4 x concurrency")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson, req/s")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt ids drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url, startup = start_server(args)
        print(f"server healthy after {startup:.1f}s (load + warm-up)")
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        columns = {}
        for concurrency in args.concurrency:
            run_args = argparse.Namespace(**vars(args))
            run_args.num_prompts = args.num_prompts or 4 * concurrency
            results, duration = asyncio.run(run_load(run_args, url, model, concurrency))
            for r in results:
                if r.error:
                    print(f"failed request: {r.error}", file=sys.stderr)
                    break
            columns[f"c={concurrency}"] = summarize(results, duration)
        print(f"model {model}, input {args.input_len} tokens, output {args.output_len} tokens, ")
        print(f"request rate {args.request_rate}")
        print_table(columns)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
