"""AsyncEngine: concurrent requests through the engine thread, early exit aborts and frees
pages, bad input raises in the caller; SmolLM2 batches equal one-at-a-time runs."""

from __future__ import annotations

import asyncio

import pytest

import ksana_jax
from ksana_jax import EngineConfig, SamplingParams
from ksana_jax.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from ksana_jax.engine import LLMEngine

CONFIG = EngineConfig(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=(16, 64),
    seq_buckets=(4,),
    context_buckets=(64, 256),
)
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The three primary colours are",
    "Translate to French: good morning ->",
]


@pytest.fixture(scope="module")
def engine(smollm2):
    async_engine = AsyncEngine(LLMEngine(smollm2, CONFIG))
    yield async_engine
    async_engine.shutdown()


def test_concurrent_requests_equal_one_at_a_time_and_abort_frees(engine, smollm2):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    tok = smollm2.tokenizer

    async def collect(i: int) -> list[int]:
        last = None
        async for out in await engine.add_request(f"c{i}", PROMPTS[i], greedy):
            last = out
        assert last.finished
        return last.outputs[0].token_ids

    async def leave_early() -> int:
        seen = 0
        long = SamplingParams(temperature=0, max_tokens=200)
        async for _ in await engine.add_request("early", PROMPTS[1], long):
            seen += 1
            if seen == 3:
                break  # like a client disconnect
        return seen

    async def main():
        results = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))), leave_early())
        for _ in range(100):  # the abort is applied by the engine thread
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return results

    *outputs, seen = asyncio.run(main())
    assert seen == 3
    pages = engine.engine.pages
    assert pages.num_free == pages.num_usable  # the abandoned request's pages came back
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        want = ksana_jax.generate(smollm2, tok.encode(prompt), max_tokens=16)
        # Greedy over batches of different shapes: equal unless a true float tie is met.
        if got != want:
            i = next(k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            logits = smollm2.logits(tok.encode(prompt) + want[:i])[-1]
            top2 = sorted(logits)[-2:]
            assert top2[1] - top2[0] < 1e-3, (prompt, got, want)


def test_bad_input_raises_in_the_caller(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)
        ok = [
            out
            async for out in await engine.add_request(
                "after", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2)
            )
        ]
        return ok[-1]

    last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 2
    assert engine.error is None


def test_shutdown_runs_queued_aborts_then_ends_every_request(smollm2):
    """Stopping mid-step: the aborts queued before the stop still run (a stop that checked
    its flag first left them unrun and their pages held), requests still running are ended
    with RequestAbortedError, no page stays held, and a new request is refused. Both ways a
    stop comes: the server's (abort_all, then shutdown) and a client gone, then shutdown."""
    engine = LLMEngine(smollm2, CONFIG)
    long = SamplingParams(temperature=0, max_tokens=200)
    prompts = PROMPTS[: CONFIG.max_num_seqs]

    async def stop(async_engine: AsyncEngine, server: bool) -> list[str]:
        streams = [await async_engine.add_request(f"r{i}", p, long) for i, p in enumerate(prompts)]
        for stream in streams:
            await anext(stream)  # every request is running: the engine thread is stepping
        if server:
            assert async_engine.abort_all("the server is shutting down") == len(prompts)
        else:
            async_engine.abort("r0")  # its client left; it reads no more
            streams = streams[1:]
        async_engine.shutdown()
        messages = []
        for stream in streams:
            with pytest.raises(RequestAbortedError) as e:
                async for _ in stream:
                    pass
            messages.append(str(e.value))
        with pytest.raises(EngineDeadError, match="shut down"):
            await async_engine.add_request("late", prompts[0], long)
        return messages

    for server, reason in [(True, "the server is shutting down"), (False, "shut down")]:
        async_engine = AsyncEngine(engine)
        messages = asyncio.run(stop(async_engine, server))
        assert len(messages) == len(prompts) - (not server)
        assert all(reason in m for m in messages), messages
        assert not async_engine._thread.is_alive()
        assert not engine.has_unfinished_requests()
        assert engine.pages.num_free == engine.pages.num_usable
