"""Decides, each step, which sequences run and how many of their tokens: continuous batching.

Pure Python. Two calls per step: `schedule()` picks the work and reserves KV blocks for it,
`update(output, sampled)` records what the model produced and retires finished sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from protocol.generation import FinishReason
from worker.engine.block_manager import BlockManager
from worker.engine.config import BatchingMode
from worker.engine.outputs import SchedulerOutput
from worker.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        mode: BatchingMode = BatchingMode.CONTINUOUS,
        eos_token_ids: Iterable[int] = (),
        requeue_preempted: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = 1 if mode is BatchingMode.SEQUENTIAL else max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.mode = mode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requeue_preempted = requeue_preempted
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the youngest
        self._unfinished: dict[str, Sequence] = {}

    # -- queue -------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._unfinished:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.append(seq)
        self._unfinished[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._unfinished.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def num_free_slots(self) -> int:
        """How many more requests may be handed over now without waiting behind the queue."""
        if self.mode is BatchingMode.CONTINUOUS:
            return max(0, self.max_num_seqs - len(self.running) - len(self.waiting))
        if self.running:  # a static batch (or the one sequential request) is on the road
            return 0
        return max(0, self.max_num_seqs - len(self.waiting))

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._unfinished.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, FinishReason.CANCELED)
        return seq

    # -- the two calls -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[str] = set()
        budget = self.max_num_batched_tokens
        if self.mode is not BatchingMode.CONTINUOUS and not self.running:
            self._form_batch(out)

        # Decodes first: one token each, oldest first, so a long prompt never stalls them.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if self._reserve(seq, 1, scheduled, out):
                self._add_scheduled(out, seq, 1, scheduled)
                budget -= 1

        # Then prefill chunks (prompts, or recomputation after preemption) in the leftover budget.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in scheduled:
                continue
            num_new = self._chunk(seq, budget, scheduled, out)
            if num_new > 0:
                self._add_scheduled(out, seq, num_new, scheduled)
                budget -= num_new

        # Admission: skipped after a preemption, or the victim would come straight back and thrash.
        if self.mode is BatchingMode.CONTINUOUS and not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if self._can_never_fit(seq):
                    self.waiting.popleft()
                    self._finish(seq, FinishReason.LENGTH)
                    out.finished.append(seq)
                    continue
                num_cached = self._claim_cached_prefix(seq, out)
                room = self.block_manager.num_free_slots(seq.request_id, num_cached)
                num_new = min(seq.num_tokens - num_cached, budget, room)
                if num_new <= 0:
                    self.block_manager.free(seq.request_id)  # its cached blocks stay cached
                    out.num_cached_tokens -= num_cached
                    break  # first come, first served: nobody overtakes the head of the queue
                self.waiting.popleft()
                self._admit(seq)
                seq.num_computed_tokens = num_cached
                self.block_manager.allocate(seq.request_id, num_cached + num_new)
                self._add_scheduled(out, seq, num_new, scheduled)
                budget -= num_new
        return out

    def update(
        self, output: SchedulerOutput, sampled: list[int], stop_hits: AbstractSet[str] = frozenset(),
    ) -> list[Sequence]:
        """Record one step's results; `sampled` holds a token per sampling sequence, in order, and
        `stop_hits` the requests whose text reached one of their stop strings with that token.
        The one place that decides a sequence finished (EOS, stop string, max_tokens, context)."""
        finished = list(output.finished)
        if len(sampled) != output.num_sampling:
            raise ValueError(f"expected {output.num_sampling} sampled tokens, got {len(sampled)}")
        sample_index = 0
        for seq, num_new, is_sampling in zip(
            output.seqs, output.num_scheduled_tokens, output.is_sampling
        ):
            if is_sampling:
                token_id = sampled[sample_index]
                sample_index += 1
            if seq.status is not SequenceStatus.RUNNING:
                continue  # retired between the two calls
            seq.num_computed_tokens += num_new
            self.block_manager.cache_computed_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens,
                                                     cache_salt=seq.cache_salt)
            if not is_sampling:
                continue
            seq.token_ids.append(token_id)
            reason = self._stop_reason(seq, token_id, seq.request_id in stop_hits)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # -- internals ---------------------------------------------------------------------------

    def _form_batch(self, out: SchedulerOutput) -> None:
        """Static and sequential modes: board a whole car at once, as many as the pool holds."""
        reserved = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._can_never_fit(seq):
                self.waiting.popleft()
                self._finish(seq, FinishReason.LENGTH)
                out.finished.append(seq)
                continue
            needed = self.block_manager.num_blocks_for(seq.num_tokens)
            if self.running and reserved + needed > self.block_manager.num_free_blocks:
                break
            reserved += needed
            self.waiting.popleft()
            self._admit(seq)

    def _admit(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _claim_cached_prefix(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Start a sequence with no blocks yet on its cached prefix; return the tokens it covers."""
        if seq.needs_prompt_logprobs:
            seq.num_cached_tokens = 0
            return 0  # cached positions would have no logits: compute the whole prompt
        num_cached = self.block_manager.allocate_cached_prefix(seq.request_id, seq.token_ids,
                                                               cache_salt=seq.cache_salt)
        out.num_cached_tokens += num_cached
        # A resumed sequence may also hit its own output; usage reports prompt tokens only.
        seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
        return num_cached

    def _can_never_fit(self, seq: Sequence) -> bool:
        # Sampling the next token needs the K/V of every token so far; an empty pool is the most.
        return self.block_manager.num_blocks_for(seq.num_tokens) > self.block_manager.num_blocks

    def _reserve(self, seq: Sequence, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Find blocks for `num_new` more tokens of `seq`, preempting younger sequences if needed."""
        target = seq.num_computed_tokens + num_new
        while self.block_manager.allocate(seq.request_id, target) is None:
            victim = self._find_victim(seq, scheduled)
            if victim is not None:
                self._preempt(victim, out)
                continue
            self._give_up(seq, out)
            return False
        return True

    def _chunk(self, seq: Sequence, budget: int, scheduled: set[str], out: SchedulerOutput) -> int:
        """The size of `seq`'s next prefill chunk, with its blocks allocated; 0 if it must wait."""
        bm = self.block_manager
        if seq.num_computed_tokens == 0 and not bm.block_table(seq.request_id):
            seq.num_computed_tokens = self._claim_cached_prefix(seq, out)
        remaining = seq.num_tokens - seq.num_computed_tokens
        while True:
            room = bm.num_free_slots(seq.request_id, seq.num_computed_tokens)
            num_new = min(remaining, budget, room)
            if num_new > 0:
                bm.allocate(seq.request_id, seq.num_computed_tokens + num_new)
                return num_new
            victim = self._find_victim(seq, scheduled)
            if victim is None:
                break
            self._preempt(victim, out)
        # Older sequences (or this step's decodes) hold the pool: wait until they free blocks.
        if len(bm.block_table(seq.request_id)) < bm.num_used_blocks:
            return 0
        self._finish(seq, FinishReason.LENGTH)  # it alone fills the pool: it can never progress
        out.finished.append(seq)
        return 0

    def _give_up(self, seq: Sequence, out: SchedulerOutput) -> None:
        bm = self.block_manager
        if len(bm.block_table(seq.request_id)) < bm.num_used_blocks:
            self._preempt(seq, out)  # it is the youngest holder: step aside for the older ones
            return
        # It alone fills the pool and still needs more: it can never progress, so it ends here.
        self._finish(seq, FinishReason.LENGTH)
        out.finished.append(seq)

    def _find_victim(self, seq: Sequence, scheduled: set[str]) -> Sequence | None:
        """The youngest sequence admitted after `seq` that holds blocks and is not in this step.
        Background sequences (`preempt_first`) give way to every other one, older or not: a
        foreground `seq` takes the youngest background holder first; a background `seq` only
        ever takes a younger background one (else it steps aside itself)."""
        if not seq.preempt_first:
            for candidate in reversed(self.running):
                if candidate.preempt_first and candidate.request_id not in scheduled \
                        and self.block_manager.block_table(candidate.request_id):
                    return candidate
        for candidate in reversed(self.running):
            if candidate is seq:
                return None
            if candidate.request_id in scheduled or (seq.preempt_first
                                                     and not candidate.preempt_first):
                continue
            if self.block_manager.block_table(candidate.request_id):
                return candidate
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: drop the cache; the tokens stay and are prefilled again."""
        self.block_manager.free(seq.request_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.requeue_preempted:
            self.waiting.appendleft(seq)  # older victims are preempted later, so land in front
        else:
            del self._unfinished[seq.request_id]

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[str]) -> None:
        start = seq.num_computed_tokens
        is_sampling = start + num_new == seq.num_tokens
        out.seqs.append(seq)
        out.num_computed_tokens.append(start)
        out.num_scheduled_tokens.append(num_new)
        out.block_tables.append(self.block_manager.block_table(seq.request_id))
        out.is_sampling.append(is_sampling)
        if num_new == 1 and is_sampling and seq.num_output_tokens > 0:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new
        scheduled.add(seq.request_id)

    def is_ending_eos(self, seq: Sequence, token_id: int) -> bool:
        """Whether `token_id` is an end-of-sequence token that ends `seq` (it does not ignore EOS)."""
        return not seq.params.ignore_eos and token_id in self.eos_token_ids

    def _stop_reason(self, seq: Sequence, token_id: int, hit_stop_string: bool) -> FinishReason | None:
        # A stop string beats max_tokens on the same token, as EOS does.
        if hit_stop_string or self.is_ending_eos(seq, token_id):
            return FinishReason.STOP
        if token_id in seq.params.stop_token_ids:  # sampled only from min_tokens on (masked before)
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq.request_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._unfinished.pop(seq.request_id, None)
