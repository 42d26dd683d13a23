"""Scoring a prompt through /v1/completions (`echo` with `logprobs`, `max_tokens: 0`), as
lm-evaluation-harness and other evaluation tools do, against a real `ksana-jax serve`
process driven by the official openai client: the echoed prompt's logprobs equal
transformers' log_softmax at every position (the first null), with n > 1, several prompts,
token-id prompts and streaming; bad input is a 400 naming the field.

The model is a tiny random-weight Llama with a word-level tokenizer (texts are `w12 w40`).
tests/test_lm_eval.py runs lm-evaluation-harness itself against the same kind of server.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from tests.conftest import hf_logits, write_tiny_hf
from tests.servers import post, start_server, stop_server

TOL = 1e-3  # the bound; float32 on both sides agrees far closer
MODEL = "tiny"
FLAGS = [
    "--served-model-name",
    MODEL,
    "--max-model-len=64",
    "--max-num-seqs=8",
    "--max-num-batched-tokens=32",
]
FLAGS += ["--max-logprobs=4", "--max-num-scored-tokens=16"]  # a long prompt scores in chunks
PROMPT = "w5 w17 w80 w33 w9 w120 w44 w7 w101 w3 w66 w12"
NO_EOS = {"ignore_eos": True}  # generate as many tokens as asked
LONG = " ".join(f"w{3 + (7 * i) % 150}" for i in range(40))  # chunked: 40 > 32 > 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers' model of it); no EOS, so nothing stops early."""
    path = tmp_path_factory.mktemp("tiny-echo")
    hf = write_tiny_hf(path, initializer_range=0.2, eos_token_id=None)
    return path, hf


@pytest.fixture(scope="module")
def server(tiny):
    proc, url = start_server(tiny[0], *FLAGS)
    yield url
    log = stop_server(proc)
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


SPECIAL = ["<unk>", "<s>", "</s>"]  # the word-level tokenizer: ids 0-2, then wN is id N


def ids_of(text: str) -> list[int]:
    return [token_id(word) for word in text.split()]


def token_id(word: str) -> int:
    return SPECIAL.index(word) if word in SPECIAL else int(word[1:])


def word(token_id: int) -> str:
    return SPECIAL[token_id] if token_id < len(SPECIAL) else f"w{token_id}"


def offsets(text: str) -> list[int]:
    """Where each word's token starts in `text`: after the previous word (a token's text
    includes the space the decoder puts before it), as generated tokens' offsets are."""
    words = text.split()
    return [len(" ".join(words[:j])) for j in range(len(words))]


def reference(hf, ids) -> np.ndarray:
    """transformers' log_softmax f64[len(ids), V]: row j predicts token j + 1."""
    logits = torch.tensor(hf_logits(hf, ids), dtype=torch.float64)
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_echo_scores(lp, ids: list[int], want: np.ndarray, n_top: int) -> None:
    """The first len(ids) entries of legacy logprobs `lp` score prompt `ids` like `want`."""
    assert lp.tokens[: len(ids)] == [word(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        ref = want[j - 1]
        assert abs(lp.token_logprobs[j] - ref[ids[j]]) < TOL, (j, lp.token_logprobs[j])
        top = lp.top_logprobs[j]
        # The token itself and the top n_top (OpenAI's legacy shape: up to n_top + 1).
        best = np.argsort(ref)[::-1][:n_top]
        assert set(top) == {word(t) for t in {ids[j], *best.tolist()}}, (j, top)
        for text, value in top.items():
            assert abs(value - ref[token_id(text)]) < TOL


def test_openai_client_scores_the_prompt_with_max_tokens_0(client, tiny):
    """`completions.create(echo=True, logprobs=1, max_tokens=0)`: the prompt back, scored,
    nothing generated."""
    _, hf = tiny
    for prompt in (PROMPT, LONG):
        got = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0
        )
        (choice,) = got.choices
        assert choice.text == prompt and choice.finish_reason == "length"
        ids = ids_of(prompt)
        assert_echo_scores(choice.logprobs, ids, reference(hf, ids), 1)
        assert len(choice.logprobs.tokens) == len(ids)  # nothing after the prompt
        assert choice.logprobs.text_offset == offsets(prompt)
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 0


def test_echo_then_generated_tokens(client, tiny):
    """Echo with generation: the prompt's scores, then exactly what the same request without
    echo returns (tokens, logprobs, top logprobs), its offsets moved past the prompt."""
    _, hf = tiny
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2)
    kw |= dict(extra_body=NO_EOS)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.finish_reason == plain.finish_reason
    ids = ids_of(PROMPT)
    lp, gen = echoed.logprobs, plain.logprobs
    assert_echo_scores(lp, ids, reference(hf, ids), 2)
    k = len(ids)
    assert lp.tokens[k:] == gen.tokens and len(gen.tokens) == 5
    assert lp.token_logprobs[k:] == gen.token_logprobs
    assert lp.top_logprobs[k:] == gen.top_logprobs
    assert lp.text_offset[k:] == [len(PROMPT) + o for o in gen.text_offset]
    # The generated tokens continue the prompt: scored as a prompt, they score the same.
    whole = ids + [token_id(t) for t in gen.tokens]
    assert_echo_scores(lp, whole, reference(hf, whole), 2)


@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token_ids"])
def test_echo_with_several_prompts_and_n(client, tiny, as_ids):
    """Two prompts x n=2: choice prompt * n + sample, each with its own prompt's scores."""
    _, hf = tiny
    prompts = [PROMPT, LONG]
    sent = [ids_of(p) for p in prompts] if as_ids else prompts
    got = client.completions.create(
        model=MODEL,
        prompt=sent,
        n=2,
        temperature=0,
        max_tokens=3,
        echo=True,
        logprobs=1,
        extra_body=NO_EOS,
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:
        prompt = prompts[c.index // 2]
        ids = ids_of(prompt)
        assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 3
        assert_echo_scores(c.logprobs, ids, reference(hf, ids), 1)
    assert got.choices[0].logprobs == got.choices[1].logprobs  # greedy: the samples agree


def stream_by_choice(client, **kw) -> dict[int, dict]:
    """A streamed completion's chunks joined per choice index."""
    joined: dict[int, dict] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            mine = joined.setdefault(c.index, {"text": "", "first": c.text, "lp": None})
            mine["text"] += c.text
            mine["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                lp = c.logprobs.model_dump()
                mine["lp"] = lp if mine["lp"] is None else {k: mine["lp"][k] + lp[k] for k in lp}
    return joined


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_equals_the_whole_response(client, max_tokens):
    """The echo and the prompt's scores come in each choice's first chunk; joined, the chunks
    equal the whole response."""
    kw = dict(model=MODEL, prompt=[PROMPT, LONG], n=2, temperature=0, max_tokens=max_tokens)
    kw |= dict(echo=True, logprobs=2, extra_body=NO_EOS)
    whole = client.completions.create(**kw)
    streamed = stream_by_choice(client, **kw)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in whole.choices:
        mine = streamed[c.index]
        assert mine["text"] == c.text and mine["finish_reason"] == c.finish_reason
        assert mine["lp"] == c.logprobs.model_dump()
        prompt = [PROMPT, LONG][c.index // 2]
        assert mine["first"].startswith(prompt) and (max_tokens or mine["first"] == prompt)
        assert c.finish_reason == "length"


def test_score_only_echo_without_logprobs(client):
    """Token-id prompts come back as their decoded text, with no logprobs asked or given."""
    got = client.completions.create(
        model=MODEL, prompt=[ids_of(PROMPT), ids_of(LONG)], echo=True, max_tokens=0
    )
    assert [c.text for c in got.choices] == [PROMPT, LONG]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in got.choices)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),  # vLLM: max_tokens must be at least 1 without echo
        ({"max_tokens": 0, "echo": True, "logprobs": 5}, "logprobs"),  # --max-logprobs=4
        ({"max_tokens": 0, "echo": True, "logprobs": 1, "prompt": "w5 " * 64}, "prompt"),
        ({"max_tokens": 8, "echo": True, "logprobs": 1, "prompt": "w5 " * 60}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_scoring_requests_are_400_naming_the_field(server, body, param):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_prompt_one_short_of_the_context_is_scored_whole(client):
    prompt = " ".join(["w5"] * 63)  # max_model_len 64: room for the one sampled token
    got = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert len(got.choices[0].logprobs.token_logprobs) == 63
