"""An engine without a model, for load tests of everything around it: every seat gets one token
per step at a fixed step time. It offers the surface BatchingWorker uses (scripts/bench_fleet.py
and the stream shard tests run the real worker loop around it), so the Redis side is measured
and tested at fleet rates with no model in memory."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.generation import FinishReason, SamplingParams, TokenEntry
from worker.engine.batch_limits import BatchLimits
from worker.engine.outputs import RequestOutput, StepOutput, StepStats


# Token i of every job: an id and text the tests can check without a tokenizer.
def synthetic_token_id(index: int) -> int:
    return 1000 + index % 500


SYNTHETIC_TEXT = " tok"


class _Tokenizer:
    eos_token = "</s>"
    bos_token = "<s>"
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [1 + (ord(c) % 100) for c in text]


@dataclass(slots=True)
class _Request:
    max_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    is_aborted: bool = False


class SyntheticEngine:
    """The engine surface BatchingWorker uses: one token per seat every `step_s`, no model."""

    def __init__(self, max_num_seqs: int, step_s: float) -> None:
        self.tokenizer = _Tokenizer()
        self.max_model_len = 1 << 16
        self.model_dir = Path("/nonexistent-synthetic-model")
        self.vocab_size = 0  # unknown: the API skips its vocabulary checks
        self._max_num_seqs = max_num_seqs
        self.limits = BatchLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs)
        self._step_s = step_s
        self._requests: dict[str, _Request] = {}
        self._next_step_at = time.monotonic()

    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> None:
        return None  # the worker's warm-up: nothing to warm

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def num_free_slots(self) -> int:
        return self._max_num_seqs - len(self._requests)

    def num_free_kv_blocks(self) -> int:
        return 1 << 20

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode(" ".join(m["content"] for m in messages))

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    output_token_ids: tuple[int, ...] = (), preempt_first: bool = False,
                    cache_salt: str | None = None) -> None:
        # No KV cache here, so cache_salt has nothing to isolate: taken for Engine's signature.
        self._requests[request_id] = _Request(sampling.max_tokens, len(prompt_ids),
                                              len(output_token_ids))

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self._requests[request_id].is_aborted = True

    def step(self) -> StepOutput:
        now = time.monotonic()
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)
        self._next_step_at = max(now, self._next_step_at) + self._step_s
        outputs = []
        for request_id, request in list(self._requests.items()):
            if request.is_aborted:
                del self._requests[request_id]
                outputs.append(RequestOutput(request_id, [], FinishReason.CANCELED,
                                             request.num_prompt_tokens, request.num_output_tokens))
                continue
            index = request.num_output_tokens
            request.num_output_tokens += 1
            reason = FinishReason.LENGTH if request.num_output_tokens >= request.max_tokens else None
            if reason is not None:
                del self._requests[request_id]
            outputs.append(RequestOutput(request_id, [TokenEntry(index, synthetic_token_id(index),
                                                                SYNTHETIC_TEXT)],
                                         reason, request.num_prompt_tokens,
                                         request.num_output_tokens))
        num = len(outputs)
        stats = StepStats(num_seqs=num, num_scheduled_tokens=num, num_prefill_tokens=0,
                          num_decode_tokens=num, num_kv_blocks_used=0, num_kv_blocks_total=1 << 20,
                          num_running=len(self._requests), num_waiting=0,
                          slot_utilisation=len(self._requests) / self._max_num_seqs,
                          num_preemptions=0, step_time_s=self._step_s)
        return StepOutput(outputs=outputs, preempted=[], stats=stats)
