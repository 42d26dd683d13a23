"""The cost of prompt logprobs: prefill time of the same prompts with and without
`SamplingParams.prompt_logprobs` (max_tokens=1, so the time is the prefill plus one sample).

    python benchmarks/prompt_logprobs.py [--model demo] [--num-prompts 8] [--prompt-len 200]

Prompts are slices of Python's own documentation (`pydoc_data`, no download). The prefix
cache is off, so every run computes every prompt token (a request with prompt logprobs
recomputes its prompt anyway). Prints the median time per setting over --repeats runs
(settings interleaved).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pydoc_data.topics import topics

from ksana_jax import LLM, SamplingParams


def prompts(llm: LLM, num: int, length: int) -> list[list[int]]:
    text = " ".join(topics[k] for k in sorted(topics))
    ids = llm.tokenizer.encode(text)
    return [ids[i * length : (i + 1) * length] for i in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    print(f"load + warm-up {time.perf_counter() - start:.1f} s")
    batch = prompts(llm, args.num_prompts, args.prompt_len)
    tokens = sum(map(len, batch))
    settings = (None, 0, 1, 5)
    times: dict[int | None, list[float]] = {k: [] for k in settings}
    for _ in range(args.repeats):  # settings interleaved, so a busy machine hits them alike
        for k in settings:
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            times[k].append(time.perf_counter() - start)
            assert all((out.prompt_logprobs is None) == (k is None) for out in outs)
    for k, runs in times.items():
        t = statistics.median(runs)
        print(
            f"prompt_logprobs={k!s:>4}: {t * 1000:8.0f} ms for {len(batch)} x {args.prompt_len} "
            f"tokens ({tokens / t:6.0f} prompt tok/s; runs {[round(x, 2) for x in runs]})"
        )


if __name__ == "__main__":
    main()
