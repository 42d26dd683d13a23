"""Speculative decoding (n-gram prompt lookup, a draft model) on and off, on the demo model
(SmolLM2-135M).

Engines on the same model and buckets: one without speculation, one with n-gram
`speculative_config` (k proposals a step) and, with `--draft PATH` (`--draft demo`: SmolLM2
as its own draft), one with that draft model. There is no smaller SmolLM2-family model here,
so the draft row shows the draft path's cost and a self-draft's acceptance (every proposal
is right), not a speed-up: a useful draft is several times cheaper than its target.
Workloads, greedy:
  - copy/edit: chat requests to repeat, correct or reformat a text shipped below (the
    answer repeats the prompt: proposals are found and accepted);
  - open: open-ended chat prompts (few proposals).
Batch 1: each request alone, in turn; tokens/s = output tokens / wall time. 16 rows: the
open prompts x 4 submitted at once (continuous batching). Each setting runs once untimed
first (compiles its shapes), then timed. Prints tokens/s per setting and method, the ratio
to off, the mean accepted length (tokens a verifying row emits per step, 1 + accepted
proposals), and whether the greedy outputs were equal.

    python benchmarks/spec_decode.py [--k 4] [--dtype bfloat16] [--max-tokens 128]
        [--draft demo|PATH]
"""

from __future__ import annotations

import argparse
import time

from ksana_jax import LLM, SamplingParams, load
from ksana_jax.demo import demo_checkpoint

TEXT = (
    "Dear team, the quarterly review is moved from Monday to Wednesday at 10am in room 4B. "
    "Please bring the updated sales figures, the customer survey results and your project "
    "timelines. Lunch will be provided after the meeting. If you cannot attend, send a short "
    "written update to Maria before Tuesday evening so that she can present it for you."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal = subtotal + item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
COPY_EDIT = [
    "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "Rewrite this email, changing Wednesday to Thursday and room 4B to room 2A, keeping "
    "everything else the same:\n\n" + TEXT,
    "Add a docstring to this Python function and return the whole function:\n\n" + CODE,
    "Fix the spelling in this text and return it: " + TEXT.replace("the", "teh"),
]
OPEN = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "What are some good habits for learning a new language?",
    "Describe your ideal weekend.",
]


def chat(tokenizer, content: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: bool):
    """(tokens/s, outputs): all prompts at once (batch) or one after another."""
    start = time.perf_counter()
    if batch:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].token_ids for o in outs]


def accepted_length(llm: LLM, before: tuple[int, int]) -> float:
    spec = llm.engine.speculator
    rows = spec.drafted_per_position[0] - before[0]
    return 1 + (spec.num_accepted - before[1]) / rows if rows else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft", help="also a draft model (`demo`: SmolLM2 as its own)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed runs per setting, engines interleaved; the best counts",
    )
    parser.add_argument(
        "--workloads",
        default="copy,open,rows16",
        help="comma-separated subset of copy, open, rows16",
    )
    args = parser.parse_args()
    model = load(demo_checkpoint(), dtype=args.dtype)
    config = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                  warm_up=False, dtype=args.dtype)  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip
    engines = {"off": LLM(model, **config), "ngram": LLM(model, speculative_config=spec, **config)}
    if args.draft:
        path = str(demo_checkpoint()) if args.draft == "demo" else args.draft
        draft = {"model": path, "num_speculative_tokens": args.k}
        engines["draft"] = LLM(model, speculative_config=draft, **config)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tok = model.tokenizer
    workloads = {
        "copy/edit, batch 1": ("copy", [chat(tok, p) for p in COPY_EDIT], False),
        "open, batch 1": ("open", [chat(tok, p) for p in OPEN], False),
        "open, 16 rows": ("rows16", [chat(tok, p) for p in OPEN] * 4, True),
    }
    chosen = set(args.workloads.split(","))
    workloads = {k: v[1:] for k, v in workloads.items() if v[0] in chosen}
    print(
        f"SmolLM2-135M {args.dtype}, k={args.k}, greedy, {args.max_tokens} tokens, "
        f"best of {args.repeat}"
    )
    print(
        f"{'workload':<22}{'method':<8}{'off tok/s':>10}{'on tok/s':>10}{'on/off':>8}"
        f"{'acc. len':>10}  same"
    )
    for name, (prompts, batch) in workloads.items():
        rates, outputs, before = {}, {}, {}
        for which, llm in engines.items():
            run(llm, prompts, params, batch)  # compiles this workload's shapes
            if which != "off":
                sp = llm.engine.speculator
                before[which] = (sp.drafted_per_position[0], sp.num_accepted)
        for _ in range(args.repeat):  # interleaved, so a busy spell hits every engine alike
            for which, llm in engines.items():
                rate, outputs[which] = run(llm, prompts, params, batch)
                rates[which] = max(rate, rates.get(which, 0.0))
        for which in before:
            same = outputs[which] == outputs["off"]
            ratio = rates[which] / rates["off"]
            length = accepted_length(engines[which], before[which])
            print(
                f"{name:<22}{which:<8}{rates['off']:>10.1f}{rates[which]:>10.1f}{ratio:>7.2f}x"
                f"{length:>10.2f}  {same}"
            )


if __name__ == "__main__":
    main()
