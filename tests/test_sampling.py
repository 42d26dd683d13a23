"""The on-device sampler against the numpy oracles of sampling_oracle.py: penalties, filters,
greedy, batch invariance, logprobs, banned ids, logit bias, prompt scoring and the host's
sampler plans."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_oracle import (
    DEFAULTS,
    DTYPES,
    N_LOGPROBS,
    M,
    V,
    make_inputs,
    np_allowed,
    np_log_softmax,
    np_penalties,
    penalties_jit,
    random_histories,
    run,
    take_rows,
)

from ksana_jax import sampling
from ksana_jax.sampling import (
    SamplerPlan,
    plan_for,
    sampler_plans,
    score_prompt,
    scored_size,
    scored_sizes,
)

# ----------------------------------------------------------------------------- 1. penalties


def test_apply_penalties_handcrafted():
    logits = np.zeros((2, V), np.float32)
    logits[:, :4] = [2.0, -2.0, 3.0, 1.0]
    history = np.full((2, M), -1)
    history[0, :6] = [0, 1, 2, 2, 2, 3]  # prompt 0, 1; output 2, 2, 2, 3
    history[1, :3] = [0, 1, 2]  # all prompt: only the repetition penalty applies
    s = make_inputs(
        2,
        history,
        num_prompt_tokens=[2, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    out = np.asarray(penalties_jit(jnp.asarray(logits), s.s, s.counts))
    expected0 = [1.0, -4.0, 1.5 - 3 * 0.5 - 0.25, 0.5 - 0.5 - 0.25]
    np.testing.assert_allclose(out[0, :4], expected0, rtol=1e-6)
    np.testing.assert_allclose(out[1, :4], [1.0, -4.0, 1.5, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(out[:, 4:], 0.0)  # tokens never seen are untouched


@pytest.mark.parametrize("trial", range(3))
def test_apply_penalties_matches_numpy(trial):
    rng = np.random.default_rng(100 + trial)
    S = 16
    logits = (rng.normal(size=(S, V)) * 3).astype(np.float32)
    logits[0, :3] = 0.0  # exactly zero: unchanged by the repetition penalty either way
    history, num_prompt = random_histories(rng, S)
    history[1] = -1  # no history at all
    num_prompt[2] = M  # everything is prompt: no frequency / presence
    history[2] = rng.integers(0, 4, M)
    num_prompt[3] = 0  # everything is output
    history[3] = rng.integers(0, 4, M)
    rep = rng.uniform(0.5, 2.0, S).astype(np.float32)
    rep[4] = 1.0
    pres = rng.uniform(-2, 2, S).astype(np.float32)
    freq = rng.uniform(-2, 2, S).astype(np.float32)
    s = make_inputs(
        S,
        history,
        num_prompt_tokens=num_prompt,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
    )
    out = np.asarray(penalties_jit(jnp.asarray(logits), s.s, s.counts))
    expected = np_penalties(logits, history, num_prompt, rep, pres, freq)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, logits)  # the penalties did something


# ----------------------------------------------------------------------------- 2. filters


def dense(values, ids):
    """A _filtered consumer: the candidates' filtered logits f32[S, V] (-inf elsewhere)."""
    if ids is None:
        return values
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.full((ids.shape[0], V), -jnp.inf).at[rows, ids].set(values)


@pytest.fixture(params=[None, (4, 8)], ids=["sorted", "largest4-8"])
def filter_fn(request, monkeypatch):
    """The filtered logits, jitted afresh: as they are found for V = 16 (the whole vocabulary
    sorted), or as XLA:CPU finds them for a large vocabulary, the cut-offs sought among the
    4 largest logits first (sampling.FILTER_PREFIXES), a row needing more alone among its 8
    largest, else sorted; only those 4 passed where they hold every kept token."""
    if request.param is not None:
        monkeypatch.setattr(sampling, "FILTER_PREFIXES", request.param)
    return jax.jit(lambda logits, s: sampling._filtered(logits, s, dense))


def random_filter_row(rng, combo):
    """Random logits and filter settings for one row, away from every float boundary."""
    while True:
        logits = (rng.normal(size=V) * rng.uniform(0.5, 3.0)).astype(np.float32)
        temperature = float(np.float32(rng.uniform(0.3, 2.0)))
        filters = dict(
            top_k=int(rng.integers(1, V + 1)) if "k" in combo else 0,
            top_p=float(np.float32(rng.uniform(0.05, 0.99))) if "p" in combo else 1.0,
            min_p=float(np.float32(rng.uniform(0.01, 0.9))) if "m" in combo else 0.0,
        )
        keep, near = np_allowed(logits, temperature, **filters)
        if not near:
            return logits, temperature, filters, keep


@pytest.mark.parametrize("combo", ["", "k", "p", "m", "km", "pm", "kp", "kpm"])
def test_filter_keeps_the_oracle_set(combo, filter_fn):
    """The filtered logits' finite entries are exactly the oracle's allowed tokens (k/p/m =
    top-k/p/min-p)."""
    rng = np.random.default_rng(sum(map(ord, combo)) + 7)
    S = 16
    rows = [random_filter_row(rng, combo) for _ in range(S)]
    logits = np.stack([r[0] for r in rows])
    s = make_inputs(
        S,
        temperature=[r[1] for r in rows],
        top_k=[r[2]["top_k"] for r in rows],
        top_p=[r[2]["top_p"] for r in rows],
        min_p=[r[2]["min_p"] for r in rows],
    )
    out = np.asarray(filter_fn(jnp.asarray(logits), s))
    for i, (row_logits, temperature, filters, keep) in enumerate(rows):
        assert np.array_equal(np.isfinite(out[i]), keep), (i, row_logits, temperature, filters)
        np.testing.assert_allclose(out[i][keep], row_logits[keep] / temperature, rtol=1e-5)


@pytest.mark.parametrize("combo", ["k", "p", "kpm"])
def test_cutoffs_among_the_largest_logits_are_the_sorted_ones(combo):
    """_cutoff read from each row's 4 largest logits (where _filtered looks first on CPU and
    TPU) gives the whole sorted row's threshold for every row it says it found its cut-offs
    among them; it says so of some rows and not of others here."""
    rng = np.random.default_rng(sum(map(ord, combo)) + 11)
    S = 64
    rows = [random_filter_row(rng, combo) for _ in range(S)]
    s = make_inputs(
        S,
        top_k=[r[2]["top_k"] for r in rows],
        top_p=[r[2]["top_p"] for r in rows],
        min_p=[r[2]["min_p"] for r in rows],
    ).s
    x = jnp.asarray(np.stack([r[0] / np.float32(r[1]) for r in rows]))
    want, everywhere = sampling._cutoff(x, -jnp.sort(-x, axis=-1), s)
    got, found = sampling._cutoff(x, jax.lax.top_k(x, 4)[0], s)
    found = np.asarray(found)
    assert np.asarray(everywhere).all()
    assert found.any() and not found.all(), found
    np.testing.assert_array_equal(np.asarray(got)[found], np.asarray(want)[found])


def test_filter_edge_settings(filter_fn):
    base = np.array([3.0, 2.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0] * 2, np.float32)
    base[8:] -= 4.0
    cases = [  # (settings, expected kept ids)
        (dict(), range(V)),
        (dict(top_k=-1), range(V)),
        (dict(top_k=V + 5), range(V)),
        (dict(top_p=1.0), range(V)),
        (dict(min_p=0.0), range(V)),
        (dict(top_k=1), [0]),
        (dict(top_p=1e-6), [0]),
        (dict(min_p=1.0), [0]),
        (dict(top_k=2), [0, 1, 2]),  # 2nd largest is tied with the 3rd: both kept
        (dict(top_k=3), [0, 1, 2]),
    ]
    S = 16
    assert len(cases) <= S
    cases += [(dict(), range(V))] * (S - len(cases))
    s = make_inputs(S, **{k: [c[0].get(k, DEFAULTS[k]) for c in cases] for k in DTYPES})
    out = np.asarray(filter_fn(jnp.asarray(np.tile(base, (S, 1))), s))
    for row, (settings, kept) in zip(out, cases, strict=True):
        assert np.flatnonzero(np.isfinite(row)).tolist() == list(kept), settings


def test_filter_top_p_one_drops_nothing(filter_fn):
    """top_p=1 is "disabled" (vLLM, HF): no token is dropped, however unlikely. Here the top
    token's float32 probability rounds to 1, so "mass before < top_p" alone drops the rest."""
    S = 16
    logits = np.full((S, V), -25.0, np.float32)
    logits[:, 0] = 0.0
    logits[1::2] /= 5  # gaps of -5 at temperature 0.2
    temperature = np.where(np.arange(S) % 2, 0.2, 1.0)
    s = make_inputs(S, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    out = np.asarray(filter_fn(jnp.asarray(logits), s))
    assert np.isfinite(out).all(), np.isfinite(out).sum(axis=1)


def test_filter_min_p_zero_drops_nothing(filter_fn):
    """min_p=0 is "disabled": a token 80 nats below the max is not dropped (top-p keeps it)."""
    S = 16
    logits = np.zeros((S, V), np.float32)
    logits[:, -1] = -80.0
    s = make_inputs(S, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    out = np.asarray(filter_fn(jnp.asarray(logits), s))
    assert np.isfinite(out).all(), np.isfinite(out).sum(axis=1)


def test_noise_is_jax_gumbel_at_any_ids():
    """A row's noise at a token is jax.random.gumbel's for its key fold_in(key(seed), step) at
    that token (seeded outputs are what they were when every token's noise was drawn),
    whichever ids are drawn beside it."""
    vocab = 3000
    seeds = jnp.asarray([0, 1, 7, 2**31, 2**32 - 1, 12345], jnp.uint32)
    steps = jnp.asarray([0, 1, 5, 99, 4096, 7], jnp.int32)
    full = np.asarray(sampling._noise(seeds, steps, None, vocab))
    for i, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        np.testing.assert_array_equal(full[i], jax.random.gumbel(key, (vocab,)))
    ids = np.random.default_rng(3).integers(0, vocab, (len(seeds), 40)).astype(np.int32)
    some = sampling._noise(seeds, steps, jnp.asarray(ids), vocab)
    np.testing.assert_array_equal(np.asarray(some), np.take_along_axis(full, ids, 1))


def test_drawing_among_the_largest_is_drawing_among_all(monkeypatch):
    """Where every sampling row keeps few tokens the noise is drawn for its largest logits
    alone, and the tokens are those drawn over the whole vocabulary (sorted). The batches
    take every way: among the 4 largest; all V, the cut-offs of rows keeping more than 4
    sought one row at a time among its 8 largest or from its sorted row; all V for a row
    keeping every token."""
    rng = np.random.default_rng(5)
    S = 6

    def batch(kind):
        top_k = rng.integers(1, 5, S) if kind in ("k4", "k4+all", "k4+greedy", "k4+sorted") else 0
        top_k = rng.integers(5, 9, S) if kind == "k8" else top_k
        top_p = rng.uniform(0.05, 0.99, S) if kind == "p" else 1.0
        if kind == "k4+sorted":  # some rows' nuclei pass the 8 largest: those rows sort
            top_k, top_p = np.where(np.arange(S) < 3, top_k, 0), np.where(np.arange(S) < 3, 1, 0.99)
        temperature = rng.uniform(0.3, 2.0, S)
        if kind == "k4+all":  # a row with a temperature alone keeps every token
            top_k = np.where(np.arange(S) == 2, 0, top_k)
        if kind == "k4+greedy":  # a greedy row keeps every token too, but draws nothing
            top_k, temperature = (
                np.where(np.arange(S) == 2, 0, top_k),
                temperature * (np.arange(S) != 2),
            )
        fields = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        fields |= dict(seeds=rng.integers(0, 2**32, S, dtype=np.uint64))
        fields |= dict(num_generated=rng.integers(0, 10000, S))
        return rng.normal(size=(S, V)).astype(np.float32) * 2, make_inputs(S, **fields).s

    def jitted(sizes, fn):  # traced at its first call, under its own prefix sizes
        compiled = jax.jit(lambda *args: fn(*args))  # (jit shares one function's traces)

        def call(*args):
            monkeypatch.setattr(sampling, "FILTER_PREFIXES", sizes)
            return compiled(*args)

        return call

    def draw(x, s):
        return sampling._choose(x, s)

    def width(x, s):
        return sampling._filtered(x, s, lambda values, _: jnp.int32(values.shape[1]))

    largest, everything = jitted((4, 8), draw), jitted((), draw)
    width = jitted((4, 8), width)

    widths = []
    for kind in ["k4", "k8", "p", "k4+all", "k4+greedy", "k4+sorted"] * 8:
        logits, s = batch(kind)
        np.testing.assert_array_equal(largest(logits, s), everything(logits, s), kind)
        widths.append((kind, int(width(logits, s))))
    assert {w for kind, w in widths if kind in ("k4", "k4+greedy")} == {4}
    assert {w for kind, w in widths if kind in ("k8", "k4+all", "k4+sorted")} == {V}
    assert {w for kind, w in widths if kind == "p"} <= {4, V}


# ----------------------------------------------------------------------------- 3. greedy


def random_rows(rng, S, greedy_fraction=0.0):
    logits = (rng.normal(size=(S, V)) * 2).astype(np.float32)
    history, num_prompt = random_histories(rng, S)
    fields = dict(
        temperature=np.where(rng.random(S) < greedy_fraction, 0.0, rng.uniform(0.3, 1.5, S)),
        top_k=rng.integers(-1, V + 2, S),
        top_p=rng.uniform(0.1, 1.0, S),
        min_p=rng.uniform(0.0, 0.5, S),
        repetition_penalty=rng.uniform(0.5, 2.0, S),
        presence_penalty=rng.uniform(-2, 2, S),
        frequency_penalty=rng.uniform(-2, 2, S),
        seeds=rng.integers(0, 2**32, S, dtype=np.uint64),
        num_generated=rng.integers(0, 10000, S),
        num_prompt_tokens=num_prompt,
    )
    return logits, make_inputs(S, history, **fields), fields, history


def test_greedy_is_argmax_of_penalized_logits_and_ignores_seeds():
    rng = np.random.default_rng(5)
    S = 16
    logits, s, f, history = random_rows(rng, S, greedy_fraction=1.0)
    penalized = np_penalties(
        logits,
        history,
        f["num_prompt_tokens"],
        f["repetition_penalty"],
        f["presence_penalty"],
        f["frequency_penalty"],
    )
    expected = penalized.argmax(axis=1)
    assert not np.array_equal(expected, logits.argmax(axis=1))  # penalties matter here
    out = run(logits, s)
    np.testing.assert_array_equal(out.token_ids, expected)
    reseeded = s.replace(
        seeds=jnp.asarray(rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32)),
        num_generated=s.num_generated + 17,
    )
    np.testing.assert_array_equal(run(logits, reseeded).token_ids, expected)


def test_greedy_rows_unaffected_by_random_rows_in_the_batch():
    rng = np.random.default_rng(6)
    S = 16
    logits, s, f, history = random_rows(rng, S, greedy_fraction=0.5)
    greedy = f["temperature"] == 0
    assert 3 <= greedy.sum() <= S - 3
    mixed = run(logits, s)
    all_greedy = run(logits, s.replace(temperature=jnp.zeros(S, jnp.float32)))
    np.testing.assert_array_equal(mixed.token_ids[greedy], all_greedy.token_ids[greedy])
    penalized = np_penalties(
        logits,
        history,
        f["num_prompt_tokens"],
        f["repetition_penalty"],
        f["presence_penalty"],
        f["frequency_penalty"],
    )
    np.testing.assert_array_equal(mixed.token_ids[greedy], penalized.argmax(axis=1)[greedy])


@pytest.mark.parametrize("setting", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_deterministic_filters_equal_greedy(setting):
    rng = np.random.default_rng(7)
    S = 16
    logits = (rng.normal(size=(S, V)) * 2).astype(np.float32)
    seeds = rng.integers(0, 2**32, S, dtype=np.uint64)
    s = make_inputs(S, temperature=rng.uniform(0.5, 2.0, S), seeds=seeds, **setting)
    np.testing.assert_array_equal(run(logits, s).token_ids, logits.argmax(axis=1))


# ----------------------------------------------------------------------------- 4. invariance


def test_rows_are_batch_invariant():
    """Each row of a 16-row batch (random settings, some greedy) gives the same token, logprob
    and top logprobs alone, inside the first 4 rows, and in the full batch (also reversed)."""
    rng = np.random.default_rng(8)
    S = 16
    logits, s, _, _ = random_rows(rng, S, greedy_fraction=0.25)
    full = run(logits, s)
    rev = run(logits[::-1], take_rows(s, np.arange(S)[::-1]))
    four = run(logits[4:8], take_rows(s, [4, 5, 6, 7]))
    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(rev, name)[::-1], getattr(full, name))
        np.testing.assert_array_equal(getattr(four, name), getattr(full, name)[4:8])
    for i in range(S):
        alone = run(logits[i : i + 1], take_rows(s, [i]))
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(alone, name)[0], getattr(full, name)[i])
    assert len(set(full.token_ids.tolist())) > 3  # not degenerate


def test_noise_depends_on_seed_and_step_only():
    S = 64
    flat = np.zeros((S, V), np.float32)  # uniform: the token is decided by the noise alone
    steps = np.arange(S)
    by_step = run(flat, make_inputs(S, seeds=12345, num_generated=steps)).token_ids
    assert len(set(by_step.tolist())) >= 8  # the step changes the noise
    by_seed = run(flat, make_inputs(S, seeds=np.arange(S) * 7919, num_generated=3)).token_ids
    assert len(set(by_seed.tolist())) >= 8  # the seed changes the noise
    same = run(flat, make_inputs(S, seeds=12345, num_generated=5)).token_ids
    assert len(set(same.tolist())) == 1  # same seed and step: same token
    assert same[0] == by_step[5]
    again = run(flat, make_inputs(S, seeds=12345, num_generated=steps)).token_ids
    np.testing.assert_array_equal(again, by_step)
    other = run(flat, make_inputs(S, seeds=12346, num_generated=steps)).token_ids
    assert not np.array_equal(other, by_step)
    big = run(flat, make_inputs(S, seeds=[2**32 - 1, 2**31] * (S // 2), num_generated=steps))
    assert len(set(big.token_ids.tolist())) >= 8  # seeds above 2**31 are fine


# ----------------------------------------------------------------------------- 5. logprobs


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(9)
    S = 16
    logits, s, _, _ = random_rows(rng, S, greedy_fraction=0.25)
    logits[::3] *= 4  # some rows far from uniform
    out = run(logits, s)
    raw = np_log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), out.token_ids], rtol=1e-5, atol=1e-5)
    top_ids = np.argsort(-raw, axis=1, kind="stable")[:, :N_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, top_ids)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(raw, top_ids, axis=1), rtol=1e-5, atol=1e-5
    )
    assert out.top_ids.dtype == np.int32 and out.token_ids.dtype == np.int32
    # The penalties and temperature changed what was sampled, not the reported logprobs.
    assert not np.array_equal(out.token_ids, logits.argmax(axis=1))


def test_suppressed_ids_are_never_sampled():
    """min_tokens: EOS / stop ids are banned on device while a request is below min_tokens."""
    logits = np.tile(np.array([[0.0, 5.0, 4.0, 1.0, -1.0, 3.0]], np.float32), (3, 1))
    suppressed = np.array([[1, -1, -1, -1], [1, 2, -1, -1], [-1, -1, -1, -1]], np.int32)
    greedy = run(logits, make_inputs(3, suppressed=suppressed, vocab=6, temperature=0.0))
    assert greedy.token_ids.tolist() == [2, 5, 1]
    # Sampling never picks them either; logprobs stay those of the raw distribution.
    many = np.tile(logits[:1], (256, 1))
    banned = np.tile(np.array([[1, 2, -1, -1]], np.int32), (256, 1))
    out = run(
        many, make_inputs(256, suppressed=banned, vocab=6, temperature=1.0, seeds=np.arange(256))
    )
    assert not set(out.token_ids.tolist()) & {1, 2}
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    np.testing.assert_allclose(out.logprobs, raw[out.token_ids], atol=1e-5)


def test_logit_bias_is_added_before_sampling():
    """+100 forces a token and -100 bans it, greedy or sampled; rows without bias are
    untouched; the logprobs stay those of the raw distribution."""
    logits = np.tile(np.array([[0.0, 5.0, 4.0, 1.0, -1.0, 3.0]], np.float32), (4, 1))
    bias = [{4: 100.0}, {1: -100.0, 2: -100.0}, {}, {3: 4.5}]
    for temperature in (0.0, 1.0):
        out = run(logits, make_inputs(4, vocab=6, bias=bias, temperature=temperature, seeds=7))
        assert out.token_ids[0] == 4 and out.token_ids[1] not in (1, 2)
        if temperature == 0.0:
            assert out.token_ids.tolist() == [4, 5, 1, 3]
    greedy = run(logits, make_inputs(4, vocab=6, bias=bias, temperature=0.0, num_logprobs=2))
    np.testing.assert_allclose(
        greedy.logprobs, np_log_softmax(logits)[np.arange(4), greedy.token_ids], atol=1e-5
    )


@pytest.mark.parametrize("num_used", [1, 16, 17, 40])
def test_score_prompt_is_log_softmax_at_the_scored_positions(num_used):
    """Prompt logprobs of the first num_used of Q = 40 scored positions (at each size the host
    picks: 16, 40) equal numpy's, with the target's rank."""
    rng = np.random.default_rng(num_used)
    T, D, Q, N = 48, 8, 40, 3
    hidden = rng.normal(size=(T, D)).astype(np.float32)
    head = rng.normal(size=(D, V)).astype(np.float32)
    slots = np.zeros(Q, np.int32)
    slots[:num_used] = rng.permutation(T)[:num_used]
    targets = np.full(Q, -1, np.int32)
    targets[:num_used] = rng.integers(0, V, num_used)
    size = scored_size(num_used, Q)
    out = jax.jit(score_prompt, static_argnums=(2, 3, 4))(
        hidden[slots], targets, lambda h: h @ jnp.asarray(head), N, size
    )
    out = jax.tree.map(np.asarray, out)
    assert scored_sizes(Q) == (16, Q) and out.top_ids.shape == (size, N)
    assert size == (16 if num_used <= 16 else Q) and scored_size(0, Q) == 0
    raw = np_log_softmax(hidden[slots[:num_used]] @ head)
    want = raw[np.arange(num_used), targets[:num_used]]
    np.testing.assert_allclose(out.logprobs[:num_used], want, atol=1e-5)
    np.testing.assert_array_equal(out.ranks[:num_used], 1 + (raw > want[:, None]).sum(axis=1))
    top_ids = np.argsort(-raw, axis=1, kind="stable")[:, :N]
    np.testing.assert_array_equal(out.top_ids[:num_used], top_ids)
    np.testing.assert_allclose(
        out.top_logprobs[:num_used], np.take_along_axis(raw, top_ids, axis=1), atol=1e-5
    )


@pytest.mark.parametrize("rows", [6, sampling.TREE_MAX_ROWS + 4])
@pytest.mark.parametrize("vocab", [6, 300, 1024])
def test_plain_greedy_is_the_first_argmax(vocab, rows):
    """A batch of plain greedy rows (no logprobs, bias, penalty, ban or mask) takes the
    sampler's shortcut: the two-stage argmax over blocks of the vocabulary (their maxima by a
    tree of maxima up to TREE_MAX_ROWS rows, by a reduction past it). It returns numpy's
    first index of the max (ties inside and across blocks, the max in the padded last
    block), as the full path does for the same rows."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[0, :] = 1.0  # all tied: token 0
    logits[1, [vocab - 1, vocab // 2]] = 9.0  # tie across blocks: the first
    logits[2, -1] = 9.0  # the max in the last (padded) block
    logits[3, [1, 2]] = 9.0  # tie inside a block
    logits[4] = -np.abs(logits[4]) - 1.0  # all negative: the padding must not win
    plain = run(logits, make_inputs(rows, vocab=vocab, temperature=0.0, num_logprobs=-1))
    np.testing.assert_array_equal(plain.token_ids, logits.argmax(axis=1))
    full = run(logits, make_inputs(rows, vocab=vocab, temperature=0.0))  # wants logprobs
    np.testing.assert_array_equal(full.token_ids, plain.token_ids)


@pytest.mark.parametrize(
    "fields, plan",
    [
        (dict(temperature=0.0, num_logprobs=-1), SamplerPlan.GREEDY),
        (dict(temperature=[0.0, 0.7, 0.0], top_k=3, num_logprobs=-1), SamplerPlan.RANDOM),
        (dict(temperature=0.0, num_logprobs=0), SamplerPlan.GREEDY_LOGPROBS),
        (dict(temperature=[0.0, 0.7, 0.0], num_logprobs=[-1, -1, 2]), SamplerPlan.RANDOM_LOGPROBS),
        (dict(temperature=0.0, num_logprobs=[-1, 0, -1], min_p=0.1), SamplerPlan.GREEDY_LOGPROBS),
        (
            dict(temperature=0.0, num_logprobs=-1, presence_penalty=[0, 0, 0.5]),
            SamplerPlan.FULL_GREEDY,
        ),
        (dict(temperature=0.7, num_logprobs=-1, repetition_penalty=1.1), SamplerPlan.FULL),
        (dict(temperature=[0.0, 0.7, 0.0], bias=[{}, {3: 1.0}, {}]), SamplerPlan.FULL),
        (dict(temperature=0.0, num_logprobs=-1, bias=[{}, {3: 1.0}, {}]), SamplerPlan.FULL_GREEDY),
        (
            dict(temperature=0.0, num_logprobs=-1, suppressed=[[2, -1, -1, -1]] * 3),
            SamplerPlan.FULL_GREEDY,
        ),
    ],
)
def test_plan_is_the_least_the_rows_need(fields, plan):
    """The host's plan: argmax alone for plain greedy rows, filters and noise for rows that
    only sample, either with logprobs when some row wants them, a full sampler for anything
    else (and for any token mask): on a GPU a greedy one where every row is greedy, elsewhere
    FULL (which skips the sort with a conditional). Each is one the platform compiles."""
    fields = dict(fields)
    if "suppressed" in fields:
        fields["suppressed"] = np.array(fields["suppressed"], np.int32)
    rows = make_inputs(3, **fields)
    greedy = bool(np.all(np.asarray(rows.s.temperature) == 0))
    for platform in ("cpu", "gpu", "tpu"):
        with mock.patch.object(jax, "default_backend", lambda p=platform: p):
            got = plan_for(rows.s, masked=False), plan_for(rows.s, masked=True)
            compiled = sampler_plans()
        full = SamplerPlan.FULL_GREEDY if greedy and platform == "gpu" else SamplerPlan.FULL
        want = full if plan is SamplerPlan.FULL_GREEDY else plan
        assert got == (want, full), platform
        assert set(got) <= set(compiled), platform


def test_random_plan_samples_the_oracle_set_and_is_batch_invariant():
    """Rows that only sample (no penalty, bias, ban, mask or logprobs) run the RANDOM plan:
    every token lies in numpy's filtered set, greedy rows take the argmax, and each row's
    token is what it samples alone (run() also checks it against the FULL plan)."""
    rng = np.random.default_rng(11)
    S = 12
    logits, rows, f, _ = random_rows(rng, S, greedy_fraction=0.3)
    rows = rows.replace(
        repetition_penalty=jnp.ones(S),
        presence_penalty=jnp.zeros(S),
        frequency_penalty=jnp.zeros(S),
        num_logprobs=jnp.full(S, -1, jnp.int32),
    )
    assert plan_for(rows.s, masked=False) is SamplerPlan.RANDOM
    out = run(logits, rows)
    for i in range(S):
        if f["temperature"][i] == 0.0:
            assert out.token_ids[i] == logits[i].argmax()
        else:
            allowed, near = np_allowed(
                logits[i], f["temperature"][i], f["top_k"][i], f["top_p"][i], f["min_p"][i]
            )
            assert near or allowed[out.token_ids[i]]
        assert run(logits[i : i + 1], take_rows(rows, [i])).token_ids[0] == out.token_ids[i]
