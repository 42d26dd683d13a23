"""Several processes (hosts) driving one mesh: process 0 schedules, every process steps.

JAX is multi-controller: each process runs the same jitted step on its own devices' shards
of the global params and KV, and the step's collectives join them. So every process must
run the same steps, with the same inputs, in the same order. Process 0 (the leader) owns the
engine -- scheduler, page manager, tokenizer, HTTP server. Before each step's forward program
(warm-up steps included) its runner sends the step's host inputs through a `StepChannel`: a
header i32[6] = (STEP, T, S, P, sampled positions, drafts: RowInputs' static fields) and then
the input arrays of that bucket shape, two `broadcast_one_to_all` collectives; before its
sampling program (and its scoring program, if any) the header (SAMPLE, plan, scored size, 0,
0, 0) and the token bitmask: what to sample is the leader's decision (a
sampling.SamplerPlan), which the followers take as sent. Page-table writes run before a step
(runner.write_pages) go as (PAGES, D, 0, 0, 0, 0) and the writes.
The other processes (followers) run `follow(runner)`, which receives each step and runs its
programs, in the leader's order, until the leader sends the STOP header
(`StepChannel.close`, also run at exit). A follower has nothing to serve: with
`ksana-jax serve`, only process 0 opens the HTTP port.

    multihost.initialize("10.0.0.1:1234", num_processes=2, process_id=i)   # before any JAX use
    llm = LLM(model, tensor_parallel_size=jax.device_count())
    if jax.process_index() == 0:
        outputs = llm.generate(prompts, params)
        llm.close()                                      # releases the followers
    else:
        llm.follow()                                     # returns when the leader closes

If the leader dies, the followers wait in a collective until JAX's coordination service
notices (its heartbeat timeout, 100 s by default) and ends them.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all

from ksana_jax.batch import PageWrites
from ksana_jax.sampling import SamplerPlan

STOP, STEP, PAGES, SAMPLE = 0, 1, 2, 3


def _header(command: int, *fields: int) -> np.ndarray:
    """A message's header: i32[6], the command and up to five fields (0 past those given)."""
    header = np.zeros(6, np.int32)
    header[0] = command
    header[1 : 1 + len(fields)] = fields
    return header


PLANS = tuple(SamplerPlan)  # a plan travels as its index


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (`jax.distributed.initialize`); call before any other
    JAX call. Process 0 also hosts the coordinator at `coordinator_address` (host:port)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


def shutdown() -> None:
    """Leaves the process group (`jax.distributed.shutdown`, a barrier over all processes);
    idempotent, and a no-op for one process. A process that exits without it -- the leader
    killed by a signal -- makes the coordination service end the others with an error."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def is_follower() -> bool:
    return jax.process_index() != 0


class StepChannel:
    """The leader's end: sends each step's host inputs to every other process."""

    def __init__(self) -> None:
        self._closed = False
        atexit.register(self.close)  # followers must not wait forever for a step

    def send(self, inputs: Any, sampling: Any, rows: Any) -> None:
        """Sends one step's forward inputs (StepInputs, SamplingInputs, RowInputs: numpy
        arrays) to the followers."""
        if self._closed:
            raise RuntimeError("the step channel is closed: the followers have stopped")
        num_seqs, pages = inputs.seq_lens.shape[0], rows.context_pages
        static = (rows.sampled_positions, rows.drafts)
        broadcast_one_to_all(_header(STEP, inputs.token_ids.shape[0], num_seqs, pages, *static))
        broadcast_one_to_all((inputs, sampling, rows))

    def send_pages(self, writes: PageWrites) -> None:
        """Sends page-table writes the leader runs before its next step."""
        if self._closed:
            raise RuntimeError("the step channel is closed: the followers have stopped")
        broadcast_one_to_all(_header(PAGES, writes.slots.shape[0]))
        broadcast_one_to_all(writes)

    def send_sample(self, plan: SamplerPlan, scored_size: int, token_bitmask: np.ndarray) -> None:
        """Sends how to sample the step last sent, and its token bitmask, before its sampling
        program (warm-up samples one step under several plans)."""
        if self._closed:
            raise RuntimeError("the step channel is closed: the followers have stopped")
        broadcast_one_to_all(_header(SAMPLE, PLANS.index(plan), scored_size))
        broadcast_one_to_all(token_bitmask)

    def close(self) -> None:
        """Tells the followers to stop (idempotent)."""
        if not self._closed:
            self._closed = True
            broadcast_one_to_all(_header(STOP))


def leader_channel() -> StepChannel | None:
    """A StepChannel on process 0 of several; None otherwise."""
    return StepChannel() if jax.process_count() > 1 and not is_follower() else None


class _Runner(Protocol):
    config: Any
    batch: Any

    def padding_inputs(self, num_tokens: int, num_seqs: int, context: int) -> tuple[Any, ...]: ...

    def forward(self, *inputs: Any) -> Any: ...

    def write_pages(self, writes: PageWrites) -> None: ...

    def sample(self, forwarded: Any, token_bitmask: Any, plan: Any, num_scored: int) -> Any: ...


def follow(runner: _Runner) -> int:
    """Runs the leader's steps on this process until it sends STOP; returns steps run."""
    if not is_follower():
        raise RuntimeError("process 0 leads; follow() is for the other processes")
    steps = 0
    forwarded = None  # the last step's forward outputs
    while True:
        command, *shape = broadcast_one_to_all(_header(STOP)).tolist()
        if command == STOP:
            return steps
        # What arrives has the shapes and dtypes of padding: of the writes' width D, of the
        # step's bucket (T, S, P), or of its bitmask (W sampled positions).
        if command == PAGES:
            writes = PageWrites.padding(shape[0], runner.batch.num_slots)
            runner.write_pages(broadcast_one_to_all(writes))
        elif command == SAMPLE:
            plan, size = shape[:2]
            token_bitmask = runner.batch.bitmasks([], forwarded.logits.shape[0])
            # (a scored size is its own: scored_size(size, Q) == size)
            runner.sample(forwarded, broadcast_one_to_all(token_bitmask), PLANS[plan], size)
        else:
            num_tokens, num_seqs, pages, sampled, drafts = shape
            inputs, sampling, rows, _ = runner.padding_inputs(
                num_tokens, num_seqs, pages * runner.config.page_size
            )
            rows = dataclasses.replace(rows, sampled_positions=sampled, drafts=bool(drafts))
            forwarded = runner.forward(*broadcast_one_to_all((inputs, sampling, rows)))
            steps += 1
