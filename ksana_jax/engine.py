"""The engine loop: add requests, step, abort -- the only code that drives the device.

    scheduled = scheduler.schedule()              which requests run, how many tokens each
    forwarding = runner.dispatch(chunks)          the forward program (+ prompt scoring)
    in_flight = runner.finish_dispatch(...)       the sampling program, under token bitmasks
    scheduler.update_from_output(...)             append tokens; stop ids, EOS, max_tokens
    emit(...)                                     detokenize, stop strings, outputs

With `EngineConfig.async_scheduling` a step's results are fetched only after the next step
is dispatched, so the host's work overlaps the device's; the next step's decode rows read
their tokens on device. A request that finished may then have computed one more token: the
scheduler discards it, so outputs are the same either way. A step with grammar-constrained
rows fills their token bitmasks between its two programs, once the step before is finished
(its tokens advance the grammars): that host work overlaps the step's forward.

With speculative decoding (spec_decode.py) a step may add several tokens to a request; a
stop string inside them ends the request there and drops the tokens after it. While
speculation may propose (a running row is not turned down), steps are not overlapped
(proposals need the last tokens).

Requests come in as text or token ids with SamplingParams; a request with n > 1 runs as n
samples sharing one request id (with the prefix cache on, samples after the first start once
the first has computed the prompt, and share its pages). Outputs are vLLM-shaped delta
RequestOutputs (outputs.py) for the requests that advanced in the step: only what is new
since the request's previous output; `LLM` and `AsyncEngine` add them up. A request with
`output_kind=FINAL_ONLY` (LLM.generate's) gets one output, when it finishes: no per-step
output objects for a caller that waits for the end. Stop strings are matched on the
detokenized text (so they may span tokens) and are cut from it; until a request finishes,
the last characters that could still start a stop string are held back from its visible
text.

Prompt logprobs (SamplingParams.prompt_logprobs): the scheduler marks which prompt positions
each chunk scores, the step returns their logprobs, and the engine files them per group
(`_store_prompt_logprobs`, as vLLM `Logprob`s with each token's text); they go out whole
with the group's first token. Such a request skips the prefix cache (it recomputes a cached
prefix: those positions' logits were never kept), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Sequence
from typing import NamedTuple

from ksana_jax.batch import suppressed_ids
from ksana_jax.config import EngineConfig
from ksana_jax.draft import load_draft
from ksana_jax.model import Model
from ksana_jax.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache
from ksana_jax.request import Request
from ksana_jax.runner import MAX_SUPPRESSED_IDS, InFlight, ModelRunner
from ksana_jax.sampling import SampledTokens, ScoredLogprobs
from ksana_jax.sampling_params import RequestOutputKind, SamplingParams
from ksana_jax.scheduler import Scheduler, SchedulerOutput
from ksana_jax.spec_decode import Speculator
from ksana_jax.step_metrics import StepTimer
from ksana_jax.structured import GrammarCompiler
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
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), filled as
    # the first sample's chunks score them; sent with the group's first token.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def kind(self) -> RequestOutputKind:
        return self.samples[0].params.output_kind

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)


class _Dispatched(NamedTuple):
    """A step on the device: what was scheduled, its outputs, when it was dispatched."""

    scheduled: SchedulerOutput
    in_flight: InFlight
    dispatched: float


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
        model = model.with_quantization(config.quantization).with_tensor_parallel(
            config.tensor_parallel_size, config.enable_expert_parallel
        )
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        spec = config.speculative
        draft_model = None
        if spec is not None and spec.model is not None:
            draft_model = load_draft(spec.model, model, config)
        self.runner = ModelRunner(model, config, draft_model)
        self.speculator = Speculator(spec) if spec is not None else None
        cache = PrefixCache(config.page_size) if config.enable_prefix_caching else None
        self.pages = PageManager(self.runner.num_pages, cache)
        self.scheduler = Scheduler(
            self.pages,
            config.page_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            model.eos_token_ids,
            config.max_num_scored_tokens,
            self.speculator,
        )
        self.stats = EngineStats()
        self._groups: dict[str, _Group] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._in_flight: _Dispatched | None = None  # async scheduling: fetched next step
        self.timer = StepTimer()
        self._token_texts: dict[int, str] = {}  # token id -> decoded_token of prompt logprobs
        self.grammars = GrammarCompiler(
            self.tokenizer, model.config.vocab_size, model.eos_token_ids
        )

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(
                    f"{name} must be <= max_logprobs ({self.config.max_logprobs}), got {value}"
                )
        bad_bias = [t for t in params.logit_bias or () if not t < vocab]
        if bad_bias:
            raise ValueError(
                f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})"
            )
        if params.min_tokens and len(suppressed_ids(params, self.model.eos_token_ids)) > (
            MAX_SUPPRESSED_IDS
        ):
            raise ValueError(
                f"with min_tokens, at most {MAX_SUPPRESSED_IDS} stop_token_ids + "
                f"EOS ids are supported, got {len(params.stop_token_ids)} stop ids"
            )
        params = dataclasses.replace(params, max_tokens=max_tokens)
        spec = params.structured_outputs
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(token_ids),
                params=params,
                seed=0,
                parent_id=request_id,
                index=i,
                priority=priority,
                # compiled here, off the event loop (cached per spec); ValueError if invalid
                matcher=self.grammars.matcher(spec) if spec is not None else None,
            )
            for i in range(params.n)
        ]
        detoks = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            for _ in samples
        ]
        group = _Group(request_id, text, samples, detoks)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(token_ids)
        return group

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
        # With the prefix cache, the other samples wait for the first to compute the prompt,
        # then find its pages cached instead of each computing a copy.
        if self.config.enable_prefix_caching:
            self.scheduler.add(group.samples[0], after_prompt=group.samples[1:])
        else:
            for sample in group.samples:
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
        return self._output(group, True)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> emit. A step runs as two programs (runner.py):
        the forward, then the sampling. With async scheduling a step's results are fetched
        by the next call, once it has dispatched the step after it. A step with
        grammar-constrained rows dispatches its forward, then finishes the step before it
        (whose tokens advance the grammars), then fills its token bitmasks and dispatches its
        sampling: the host's work overlaps the forward. Speculation needs the tokens on the
        host to propose (proposals extend the known tokens): a step that may propose is
        finished before the next is scheduled, as without async scheduling."""
        begin = time.perf_counter()
        outputs = []
        if self._in_flight is not None and self._speculating():
            outputs = self._finish(self._in_flight, begin)
            self._in_flight = None
        scheduled = self.scheduler.schedule()
        self._count(scheduled)
        running = None
        if scheduled.chunks:
            forwarding = self.runner.dispatch(scheduled.chunks)
            dispatched = time.perf_counter()
            if forwarding.constrained and self._in_flight is not None:
                outputs += self._finish(self._in_flight, begin)  # while the forward runs
                self._in_flight = None
            in_flight = self.runner.finish_dispatch(forwarding)
            running = _Dispatched(scheduled, in_flight, dispatched)
        if self.config.async_scheduling and not scheduled.num_drafts:
            done, self._in_flight = self._in_flight, running
        else:  # a step verifying proposals is finished before the next is scheduled
            done = running
        if done is not None:
            outputs += self._finish(done, begin)
        elif not outputs:
            self.timer.pause()
        return outputs

    def _speculating(self) -> bool:
        """Speculation may propose at the next schedule: few enough requests run and one of
        them is not turned down."""
        return self.speculator is not None and self.speculator.may_propose(self.scheduler.running)

    def _finish(self, done: _Dispatched, begin: float) -> list[RequestOutput]:
        """fetch -> update -> emit for a dispatched step."""
        fetch_begin = time.perf_counter()
        was_ready = done.in_flight.out[0].token_ids.is_ready()
        sampled, scored, proposals = self.runner.fetch(done.in_flight)
        fetch_end = time.perf_counter()
        advanced = self.scheduler.update_from_output(done.scheduled, sampled.token_ids, proposals)
        if scored is not None:
            self._store_prompt_logprobs(done.scheduled, scored)
        outputs = self._emit(advanced, sampled)
        end = time.perf_counter()
        self.timer.record(begin, end, done.dispatched, fetch_begin, fetch_end, was_ready)
        return outputs

    def _count(self, scheduled: SchedulerOutput) -> None:
        self.stats.preemptions += len(scheduled.preempted)
        self.stats.prefix_cache_queries += scheduled.prefix_cache_queries
        self.stats.prefix_cache_hits += scheduled.prefix_cache_hits
        self.stats.steps += bool(scheduled.chunks)

    def _store_prompt_logprobs(self, scheduled: SchedulerOutput, scored: ScoredLogprobs) -> None:
        """Files the step's scored positions (in chunk order) as their groups' prompt logprobs:
        position p's distribution is prompt token p + 1's entry. A group gone (aborted) is
        skipped; a position scored again (after a preemption) is overwritten."""
        done = 0
        for chunk in scheduled.chunks:
            request = chunk.request
            group = self._groups.get(request.parent_id)
            if chunk.num_scored and group is not None and group.prompt_logprobs is not None:
                for j in range(chunk.num_scored):
                    position = chunk.start + 1 + j
                    group.prompt_logprobs[position] = self._prompt_entry(
                        request.prompt_token_ids[position],
                        scored,
                        done + j,
                        request.params.prompt_logprobs,
                    )
            done += chunk.num_scored

    def _prompt_entry(
        self, token: int, scored: ScoredLogprobs, i: int, num_top: int
    ) -> dict[int, Logprob]:
        """Scored position i's entry: the actual next token first, then the top num_top."""
        entry = {token: (float(scored.logprobs[i]), int(scored.ranks[i]))}
        top_ids, top_logprobs = scored.top_ids[i, :num_top], scored.top_logprobs[i, :num_top]
        for rank, (t, lp) in enumerate(
            zip(top_ids.tolist(), top_logprobs.tolist(), strict=True), 1
        ):
            entry.setdefault(t, (lp, rank))
        return {t: Logprob(lp, rank, self._token_text(t)) for t, (lp, rank) in entry.items()}

    def _token_text(self, token_id: int) -> str:
        """One token's text alone, as vLLM's Logprob.decoded_token gives it (cached)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _emit(
        self, advanced: list[tuple[int, Request, int]], sampled: SampledTokens
    ) -> list[RequestOutput]:
        """Detokenizes each new token, applies stop strings; outputs of the groups that moved.
        A stop string ends a request at the token completing it: tokens after it (accepted
        proposals) are dropped."""
        groups: dict[str, _Group] = {}
        stats = self.stats
        for position, request, num_new in advanced:
            group = self._groups[request.parent_id]
            groups[group.request_id] = group
            first = len(request.output_token_ids) - num_new
            if first == 0:
                stats.prompt_tokens += len(request.prompt_token_ids)
            stats.generation_tokens += num_new
            if group.error is not None:
                continue
            try:
                for j in range(num_new):
                    index = first + j
                    stopped = self._append_token(
                        request, group.detokenizers[request.index], sampled, position + j, index
                    )
                    if stopped and index + 1 < len(request.output_token_ids):
                        del request.output_token_ids[index + 1 :]
                        break
            except Exception as e:  # a bug met by one request must not stop the others
                log.exception("request %s failed", group.request_id)
                group.error = f"{type(e).__name__}: {e}"
                for sample in group.samples:
                    if not sample.is_finished:
                        self.scheduler.finish(sample, "abort")
        outputs = []
        for group in groups.values():
            finished = group.finished
            if finished or group.kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(group, finished))
            if finished:
                del self._groups[group.request_id]
        return outputs

    def _append_token(
        self,
        request: Request,
        detok: IncrementalDetokenizer,
        sampled: SampledTokens,
        row: int,
        index: int,
    ) -> bool:
        """The host side of output token `index` (the scheduler has appended it and applied
        stop ids, EOS and max_tokens), sampled at position `row`: logprobs, text, stop
        strings. True if a stop string ended the request at it."""
        params = request.params
        token = request.output_token_ids[index]
        is_last = index + 1 == len(request.output_token_ids)
        if params.logprobs is not None:
            top = zip(
                sampled.top_ids[row, : params.logprobs].tolist(),
                sampled.top_logprobs[row, : params.logprobs].tolist(),
                strict=True,
            )
            entry = dict(top)
            entry[token] = float(sampled.logprobs[row])
            request.output_logprobs.append(entry)
        request.text_offsets.append(detok.num_chars)
        if request.stopped_on_token and is_last:  # a stop token id or EOS: not in the text
            return False
        delta = detok.add(token)
        request.text += delta
        num_out = index + 1
        can_stop = num_out > params.min_tokens or num_out == params.max_tokens
        if can_stop and delta and params.stop:
            for stop in params.stop:
                start = max(0, len(request.text) - len(delta) - len(stop) + 1)
                at = request.text.find(stop, start)
                if at >= 0:
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    request.text = request.text[:end]
                    request.stop_reason = stop
                    if request.is_finished:  # at max_tokens: the stop string names the end
                        request.finish_reason = "stop"
                    else:
                        self.scheduler.finish(request, "stop")
                    return True
        return False

    def _output(self, group: _Group, finished: bool) -> RequestOutput:
        """The group's delta output: what each sample gained since its previous one."""
        completions = []
        for sample in group.samples:
            text = sample.text
            visible = len(text)
            if not sample.is_finished and sample.params.stop:  # could start a stop string
                visible = max(0, visible - (max(len(s) for s in sample.params.stop) - 1))
            start = sample.num_emitted_tokens
            sample.num_emitted_tokens = len(sample.output_token_ids)
            chars = sample.num_emitted_chars
            sample.num_emitted_chars = max(chars, visible)
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=text[chars:visible],
                    token_ids=sample.output_token_ids[start:],
                    logprobs=sample.output_logprobs[start:]
                    if sample.params.logprobs is not None
                    else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    text_offsets=sample.text_offsets[start:],
                )
            )
        prompt_logprobs = None
        first = group.samples[0]
        # Complete once the prompt is computed: sent with the first sample's first token.
        if group.prompt_logprobs is not None and first.output_token_ids:
            prompt_logprobs = None if group.prompt_logprobs_sent else group.prompt_logprobs
            group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.samples[0].prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=group.error,
            prompt_logprobs=prompt_logprobs,
        )
