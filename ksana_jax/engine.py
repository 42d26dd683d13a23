"""The engine loop: add requests, step, abort -- the only code that drives the device.

    scheduled = scheduler.schedule()      which requests run, how many tokens each
    sampled = runner.run(chunks)          one jitted call: forward + sampling
    outputs = postprocess(...)            append tokens, detokenize, stop checks

Requests come in as text or token ids with SamplingParams; a request with n > 1 runs as n
samples sharing one request id (with the prefix cache on, samples after the first start once
the first has computed the prompt, and share its pages). Outputs are vLLM-shaped
RequestOutputs for the requests that advanced in the step. Stop strings are matched on the
detokenized text (so they may span tokens) and are cut from it; until a request finishes,
the last characters that could still start a stop string are held back from its visible
text.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Sequence

from ksana_jax.config import EngineConfig
from ksana_jax.model import Model
from ksana_jax.outputs import CompletionOutput, RequestOutput
from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache
from ksana_jax.request import Request
from ksana_jax.runner import MAX_SUPPRESSED_IDS, ModelRunner, suppressed_ids
from ksana_jax.sampling import SampledTokens
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.scheduler import ScheduledChunk, Scheduler
from ksana_jax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("ksana_jax.engine")


@dataclasses.dataclass
class _Group:
    """One client request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    error: str | None = None


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (Prometheus counters)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    # Prefix cache, in tokens: prompt tokens of started requests (not counting restarts after
    # preemption) looked up in the cache, and those found there. Hit rate = hits / queries.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig):
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's context "
                f"({model.config.max_position_embeddings})"
            )
        model = model.with_tensor_parallel(config.tensor_parallel_size)
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        self.runner = ModelRunner(model, config)
        cache = PrefixCache(config.page_size) if config.enable_prefix_caching else None
        self.pages = PageManager(self.runner.num_pages, cache)
        self.scheduler = Scheduler(
            self.pages, config.page_size, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.stats = EngineStats()
        self._groups: dict[str, _Group] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._eos_ids = frozenset(model.eos_token_ids)

    def warm_up(self, progress: bool = True) -> int:
        return self.runner.warm_up(progress)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of the usable KV pages that running requests reference.

        Cached pages that no request references count as free: they are reused on demand.
        """
        return self.pages.num_used / self.pages.num_usable

    # ------------------------------------------------------------------ requests

    def make_group(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> _Group:
        """Validates and tokenizes a request without touching engine state (thread-safe)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        room = self.config.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) must be shorter than "
                f"max_model_len ({self.config.max_model_len})"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(
                f"max_tokens ({max_tokens}) + prompt ({len(token_ids)} tokens) exceed "
                f"max_model_len ({self.config.max_model_len})"
            )
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(
                f"stop_token_ids {bad_stops[:5]} are outside the vocabulary [0, {vocab})"
            )
        if params.top_k >= vocab:  # every token: the same as no top-k (and fits in int32)
            params = dataclasses.replace(params, top_k=0)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs must be <= max_logprobs ({self.config.max_logprobs}), "
                f"got {params.logprobs}"
            )
        if params.min_tokens and len(suppressed_ids(params, self.model.eos_token_ids)) > (
            MAX_SUPPRESSED_IDS
        ):
            raise ValueError(
                f"with min_tokens, at most {MAX_SUPPRESSED_IDS} stop_token_ids + "
                f"EOS ids are supported, got {len(params.stop_token_ids)} stop ids"
            )
        params = dataclasses.replace(params, max_tokens=max_tokens)
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(token_ids),
                params=params,
                seed=0,
                parent_id=request_id,
                index=i,
                priority=priority,
            )
            for i in range(params.n)
        ]
        detoks = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            for _ in samples
        ]
        return _Group(request_id, text, samples, detoks)

    def add_group(self, group: _Group) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request_id {group.request_id!r} is already running")
        for sample in group.samples:
            params = sample.params
            sample.seed = (
                (params.seed + sample.index) % 2**32
                if params.seed is not None
                else self._seeds.getrandbits(32)
            )
            sample.arrival = next(self._arrivals)
        # With the prefix cache, the other samples wait for the first to compute the prompt
        # (see _postprocess), then find its pages cached instead of each computing a copy.
        sharing = self.config.enable_prefix_caching
        for sample in group.samples[:1] if sharing else group.samples:
            self.scheduler.add(sample)
        self._groups[group.request_id] = group

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        self.add_group(self.make_group(request_id, prompt, params, priority))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request at any point, freeing all its pages; None if it is unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample in group.samples:
            if not sample.is_finished:
                self.scheduler.finish(sample, "abort")
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        self.stats.preemptions += len(scheduled.preempted)
        self.stats.prefix_cache_queries += scheduled.prefix_cache_queries
        self.stats.prefix_cache_hits += scheduled.prefix_cache_hits
        if not scheduled.chunks:
            return []
        sampled = self.runner.run(scheduled.chunks)
        self.stats.steps += 1
        return self._postprocess(scheduled.chunks, sampled)

    def _postprocess(
        self, chunks: list[ScheduledChunk], sampled: SampledTokens
    ) -> list[RequestOutput]:
        advanced: dict[str, _Group] = {}
        for row, chunk in enumerate(chunks):
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            group = self._groups[request.parent_id]
            if len(request.output_token_ids) == 0:
                self.stats.prompt_tokens += len(request.prompt_token_ids)
                if request.index == 0 and self.config.enable_prefix_caching:
                    for sibling in group.samples[1:]:  # the prompt's pages are computed now
                        self.scheduler.add(sibling)
            self.stats.generation_tokens += 1
            advanced[group.request_id] = group
            if group.error is not None:
                continue
            try:
                self._append_token(request, group.detokenizers[request.index], sampled, row)
            except Exception as e:  # a bug met by one request must not stop the others
                log.exception("request %s failed", group.request_id)
                group.error = f"{type(e).__name__}: {e}"
                for sample in group.samples:
                    if not sample.is_finished:
                        self.scheduler.finish(sample, "abort")
        outputs = [self._output(group) for group in advanced.values()]
        for out in outputs:
            if out.finished:
                del self._groups[out.request_id]
        return outputs

    def _append_token(
        self, request: Request, detok: IncrementalDetokenizer, sampled: SampledTokens, row: int
    ) -> None:
        params = request.params
        token = int(sampled.token_ids[row])
        request.output_token_ids.append(token)
        if params.logprobs is not None:
            top = zip(
                sampled.top_ids[row, : params.logprobs].tolist(),
                sampled.top_logprobs[row, : params.logprobs].tolist(),
                strict=True,
            )
            entry = dict(top)
            entry[token] = float(sampled.logprobs[row])
            request.output_logprobs.append(entry)
        num_out = len(request.output_token_ids)
        can_stop = num_out > params.min_tokens or num_out == params.max_tokens
        if can_stop and (
            token in params.stop_token_ids or (token in self._eos_ids and not params.ignore_eos)
        ):
            self.scheduler.finish(request, "stop")
            return
        delta = detok.add(token)
        request.text += delta
        if can_stop and delta and params.stop:
            for stop in params.stop:
                start = max(0, len(request.text) - len(delta) - len(stop) + 1)
                at = request.text.find(stop, start)
                if at >= 0:
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    request.text = request.text[:end]
                    self.scheduler.finish(request, "stop")
                    return
        if num_out >= params.max_tokens:
            self.scheduler.finish(request, "length")

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for sample in group.samples:
            text = sample.text
            if not sample.is_finished and sample.params.stop:
                hold = max(len(s) for s in sample.params.stop) - 1
                text = text[: len(text) - hold] if hold else text
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=text,
                    token_ids=list(sample.output_token_ids),
                    logprobs=list(sample.output_logprobs)
                    if sample.params.logprobs is not None
                    else None,
                    finish_reason=sample.finish_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.samples[0].prompt_token_ids,
            outputs=completions,
            finished=all(s.is_finished for s in group.samples),
            error=group.error,
        )
