"""Offline API for notebooks and scripts: `LLM(model).generate(prompts, params)`.

    llm = LLM("demo", max_model_len=1024)
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=16))
    for out in llm.stream("Once upon a time"): print(out.outputs[0].text)

`LLM` loads the model (anything `ksana_jax.load` accepts, or `demo`), builds the engine from
EngineConfig fields given as keyword arguments, and compiles every step bucket up front.
Its outputs are cumulative: it adds up the engine's delta outputs.
With several processes (multihost.py) process 0 generates and the others call `follow()`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from ksana_jax import multihost
from ksana_jax.config import EngineConfig
from ksana_jax.demo import resolve_model
from ksana_jax.engine import LLMEngine
from ksana_jax.model import Model, load
from ksana_jax.outputs import RequestOutput
from ksana_jax.sampling_defaults import sampling_defaults
from ksana_jax.sampling_params import RequestOutputKind, SamplingParams

# Text, token ids, or vLLM's prompt dicts {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
Conversation = Sequence[Mapping[str, Any]]


def engine_config(**fields: Any) -> EngineConfig:
    """EngineConfig from keyword arguments; an unknown name is a ValueError naming it."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
    return EngineConfig(**fields)


class LLM:
    def __init__(
        self,
        model: str | Path | Model,
        warm_up: bool = True,
        revision: str | None = None,
        **config: Any,
    ):
        """`model`: a Model, or anything `resolve_model` takes (a path, `demo`, a Hugging Face
        id `org/name`, fetched at `revision`); `config`: EngineConfig fields."""
        self.config = engine_config(**config)
        if self.config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", self.config.compilation_cache_dir)
        if isinstance(model, Model):
            model = model.with_dtype(self.config.dtype)
        else:
            model = load(
                resolve_model(str(model), revision),
                dtype=self.config.dtype,
                tensor_parallel_size=self.config.tensor_parallel_size,
                quantization=self.config.quantization,
                enable_expert_parallel=self.config.enable_expert_parallel,
            )
        self.model = model
        self.tokenizer = model.tokenizer
        self.engine = LLMEngine(model, self.config)
        self._ids = itertools.count()
        if warm_up and not multihost.is_follower():  # followers compile as process 0 steps
            self.engine.warm_up()

    def follow(self) -> int:
        """On a process other than 0: runs process 0's steps until it calls `close()`."""
        return multihost.follow(self.engine.runner)

    def close(self) -> None:
        """On process 0 of several: releases the followers (idempotent; also run at exit)."""
        if self.engine.runner.channel is not None:
            self.engine.runner.channel.close()

    def _add(self, prompt: Prompt, params: SamplingParams | None, kind: RequestOutputKind) -> str:
        """Queues a prompt whose outputs come as `kind` (whatever the params say)."""
        if multihost.is_follower():
            raise RuntimeError(
                f"process {jax.process_index()} follows process 0's steps: call follow()"
            )
        request_id = f"llm-{next(self._ids)}"
        if params is None:
            params = self.get_default_sampling_params()
        if params.output_kind is not kind:
            params = dataclasses.replace(params, output_kind=kind)
        self.engine.add_request(request_id, _prompt_of(prompt), params)
        return request_id

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses (vLLM's name): the model's
        generation_config.json sampling fields, OpenAI's defaults for the rest."""
        return SamplingParams(**sampling_defaults(self.model.generation_config))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs all prompts with continuous batching; outputs in the order of `prompts`."""
        if isinstance(prompts, str | Mapping) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # vLLM's LLM.generate does the same: a request's one output comes when it finishes
        final = RequestOutputKind.FINAL_ONLY
        ids = [self._add(p, sp, final) for p, sp in zip(prompts, params, strict=True)]
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    _accumulate(outputs, delta)
                    bar.update(delta.finished)
        return [outputs[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the chat template (the model's, or `chat_template`) to each conversation,
        then generates (vLLM's LLM.chat). `tools` (OpenAI function definitions) and
        `chat_template_kwargs` are the template's variables; continue_final_message lets the
        model go on with the last message (add_generation_prompt=False with it). The
        outputs are raw text, as vLLM's: tool calls are not parsed offline."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        variables = dict(chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = list(tools)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    c,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    **variables,
                ),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the request's output after every step that advanced it, until it finishes.

        Other requests already in the engine keep running alongside.
        """
        request_id = self._add(prompt, sampling_params, RequestOutputKind.DELTA)
        outputs: dict[str, RequestOutput] = {}
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        out = _accumulate(outputs, delta)
                        yield out.copy()
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)


def _accumulate(outputs: dict[str, RequestOutput], delta: RequestOutput) -> RequestOutput:
    """Adds an engine delta to the request's cumulative output (the first delta starts it)."""
    out = outputs.setdefault(delta.request_id, delta)
    if out is not delta:
        out.add(delta)
    return out


def _prompt_of(prompt: Prompt) -> str | Sequence[int]:
    """The text or token ids of a prompt; a vLLM prompt dict holds exactly one of them."""
    if not isinstance(prompt, Mapping):
        return prompt
    given = [key for key in PROMPT_KEYS if key in prompt]
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown or len(given) != 1:
        raise ValueError(
            f"a prompt dict holds exactly one of {list(PROMPT_KEYS)}, got keys {sorted(prompt)}"
        )
    return prompt[given[0]]
