"""lm-evaluation-harness against a real `ksana-jax serve`: a small multiple-choice task the
test writes (local JSON data, a task YAML in a temp dir) scored by lm-eval's
`local-completions` model (token-id prompts, `echo`, `logprobs: 1`, batches of several
prompts) and by its `hf` model on the same checkpoint: identical acc and acc_norm, each
choice's loglikelihood within 2e-3. And a `generate_until` task through
`local-chat-completions`, whose answers equal transformers' greedy continuation of the same
chat-templated prompt.

The checkpoint is a tiny random-weight Llama with a word-level tokenizer (texts `w12 w40`),
which transformers loads as it is (lm-eval's hf model and its API models' tokenizer).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import write_tiny_hf
from tests.servers import start_server, stop_server

MODEL = "tiny"
FLAGS = ["--served-model-name", MODEL, "--max-model-len=64", "--max-num-seqs=8"]
FLAGS += ["--max-num-batched-tokens=64", "--max-logprobs=2"]
NUM_DOCS = 24
NUM_GEN_DOCS = 4
MAX_GEN_TOKS = 6

MC_TASK = """
task: ksana_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """
task: ksana_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w3"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 160)}" for _ in range(n))


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing is fetched: the data, the task and the checkpoint are local files."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers' model of it)."""
    path = tmp_path_factory.mktemp("tiny-lm-eval") / "ckpt"
    hf = write_tiny_hf(path, initializer_range=0.2)
    return path, hf


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A task directory for lm-eval's --include_path: the two tasks and their JSONL data."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    rng = random.Random(23)
    mc = [
        {
            "question": words(rng, rng.randrange(3, 12)),
            # Choices of different lengths in words and characters, so acc_norm differs.
            "choices": [words(rng, rng.randrange(1, 4)) for _ in range(4)],
            "answer": rng.randrange(4),
        }
        for _ in range(NUM_DOCS)
    ]
    gen = [{"question": words(rng, 5), "answer": words(rng, 2)} for _ in range(NUM_GEN_DOCS)]
    for name, docs, template in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = template.format(data=data, max_gen_toks=MAX_GEN_TOKS)
        (root / f"ksana_tiny_{name}.yaml").write_text(task)
    return root


@pytest.fixture(scope="module")
def server(tiny):
    proc, url = start_server(tiny[0], *FLAGS)
    yield url
    log = stop_server(proc)
    assert "Traceback" not in log, log


def evaluate(tasks, task: str, model: str, model_args: str, **kw) -> dict:
    import lm_eval  # imported here, under `offline`
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        **kw,
    )


def per_choice_loglikelihoods(result: dict, task: str) -> dict[int, list[float]]:
    """doc id -> each choice's loglikelihood, from the logged samples."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in result["samples"][task]}


def test_multiple_choice_local_completions_equals_hf(server, tiny, tasks):
    path, _ = tiny
    task = "ksana_tiny_mc"
    ours = evaluate(
        tasks,
        task,
        "local-completions",
        f"model={MODEL},base_url={server}/v1/completions,tokenizer={path},"
        "tokenizer_backend=huggingface,max_retries=1",
        batch_size=4,  # four prompts (token-id lists) a request
    )
    hf = evaluate(tasks, task, "hf", f"pretrained={path},dtype=float32", device="cpu")
    got, want = ours["results"][task], hf["results"][task]
    assert got["acc,none"] == want["acc,none"]
    assert got["acc_norm,none"] == want["acc_norm,none"]
    lls, hf_lls = per_choice_loglikelihoods(ours, task), per_choice_loglikelihoods(hf, task)
    assert sorted(lls) == list(range(NUM_DOCS))
    for doc_id, values in hf_lls.items():
        assert len(lls[doc_id]) == 4
        for got_ll, want_ll in zip(lls[doc_id], values, strict=True):
            assert abs(got_ll - want_ll) < 2e-3, (doc_id, lls[doc_id], values)


def test_generate_until_local_chat_completions(server, tiny, tasks):
    """Each answer lm-eval got is transformers' greedy continuation of the chat-templated
    question, cut where the stop string `w3` or EOS comes, at most MAX_GEN_TOKS tokens."""
    import transformers

    path, hf = tiny
    task = "ksana_tiny_gen"
    result = evaluate(
        tasks,
        task,
        "local-chat-completions",
        f"model={MODEL},base_url={server}/v1/chat/completions,max_retries=1",
        apply_chat_template=True,
    )
    samples = result["samples"][task]
    assert len(samples) == NUM_GEN_DOCS
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for sample in samples:
        messages = [{"role": "user", "content": sample["doc"]["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False, eos_token_id=2)
        want = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        want = want.split("w3")[0]  # a stop string: "w38" stops there too
        (answer,) = sample["resps"][0]
        assert answer.split() == want.split(), (sample["doc"], answer, want)
        assert answer.strip()  # something was generated
