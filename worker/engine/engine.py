"""The in-process engine: requests in, token deltas out, one forward pass per `step()`.

No Redis, no asyncio: the Redis worker drives it by calling `add_request`, `abort` and `step`
at iteration boundaries.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol.generation import MAX_SEED, FinishReason, SamplingParams, TokenEntry, TokenLogprobs
from worker.engine import kv_memory
from worker.engine.batch_limits import resolve_batch_limits, seat_cap
from worker.engine.block_manager import BlockManager
from worker.engine.config import BatchingMode, EngineConfig
from worker.engine.detokenizer import Detokenizer, make_decode
from worker.engine.model_runner import ModelRunner, SampledTokens
from worker.engine.outputs import (
    Completion,
    PreemptedRequest,
    RequestOutput,
    SchedulerOutput,
    StepOutput,
    StepStats,
)
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.structured_output import StructuredOutputs
from worker.model.loader import LoadedModel, load_model
from worker.model.routing import resolve_device, resolve_dtype

__all__ = [
    "BatchingMode", "Completion", "Engine", "EngineConfig", "FinishReason", "PreemptedRequest",
    "RequestOutput", "SamplingParams", "StepOutput", "StepStats", "TokenEntry",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048  # for configs that name no max_position_embeddings


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detokenizer: Detokenizer
    # Asked for prompt logprobs: one per prompt token (the first has none), filled in as prefill
    # chunks compute them, handed out with the first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if loaded is None:
            loaded = load_model(config.model, dtype=dtype, device=str(device))
        self.loaded = loaded
        self.tokenizer: Any = loaded.tokenizer
        self.runner = ModelRunner(loaded, device, dtype, config.enable_cpu_kernels,
                                  config.logprobs_mode)
        self.max_model_len, num_blocks = self._size_kv_pool(config.max_num_seqs or seat_cap(device.type))
        self.limits = resolve_batch_limits(device.type, num_blocks * config.block_size,
                                           config.max_num_seqs, config.max_num_batched_tokens)
        self.runner.warm_up(self.limits.max_num_batched_tokens, self.limits.max_num_seqs)
        self.runner.allocate_kv_cache(num_blocks, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.eos_token_ids = _eos_token_ids(loaded)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.limits.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            mode=config.mode,
            eos_token_ids=self.eos_token_ids,
            requeue_preempted=config.requeue_preempted,
        )
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        self._decode = make_decode(self.tokenizer)
        self._decode_special = make_decode(self.tokenizer, skip_special_tokens=False)
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step
        self._rng = random.Random()  # seeds for unseeded requests; OS entropy
        self._generate_ids = itertools.count()

    @property
    def model_dir(self) -> Path:
        """The Hugging Face directory the model was loaded from (tokenizer files, config)."""
        return self.loaded.path

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: Seq[int] = (),
        preempt_first: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; `output_token_ids` resumes one, generation continuing at that index.
        `preempt_first`: a background request (the Batch API's tier), which the scheduler
        preempts before any other when the KV pool runs out. `cache_salt` (vLLM's): the request
        shares prefix-cache blocks only with requests of the same salt (None: the unsalted ones)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        prompt = self._check_token_ids("prompt_token_ids", prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        output = self._check_token_ids("output_token_ids", output_token_ids)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", [token_id for token_id, _ in params.logit_bias])
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        if len(output) >= params.max_tokens:
            raise ValueError(
                f"output_token_ids already holds {len(output)} tokens, max_tokens is {params.max_tokens}: "
                "nothing is left to generate"
            )
        if len(prompt) + len(output) >= self.max_model_len:
            what = f"prompt ({len(prompt)} tokens)" + (f" plus output ({len(output)})" if output else "")
            raise ValueError(
                f"{what} leaves no room to generate within max_model_len={self.max_model_len}; "
                f"at most {self.max_model_len - 1} tokens fit"
            )
        seed = params.seed if params.seed is not None else self._rng.randint(0, MAX_SEED)
        seq = Sequence(
            request_id=request_id,
            token_ids=prompt + output,
            num_prompt_tokens=len(prompt),
            params=params,
            seed=seed,
            # A resumed request handed its prompt logprobs out with its first token already.
            needs_prompt_logprobs=params.prompt_logprobs is not None and not output,
            preempt_first=preempt_first,
            cache_salt=cache_salt,
            bad_words_token_ids=bad_words_token_ids,
        )
        decode = self._decode if params.skip_special_tokens else self._decode_special
        detokenizer = Detokenizer(decode, prompt, params.stop, params.min_tokens,
                                  include_stop=params.include_stop_str_in_output)
        for token_id in output:  # replay, so the deltas continue exactly where they stopped
            detokenizer.step(token_id)
        if params.structured_output is not None:  # replays `output` into the grammar, or raises
            self.structured_outputs.add(request_id, params.structured_output, output)
        self.scheduler.add(seq)
        prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(prompt) if seq.needs_prompt_logprobs else None)
        self._requests[request_id] = _Request(seq, detokenizer, prompt_logprobs)

    def abort(self, request_id: str) -> bool:
        """Cancel at this iteration boundary: blocks are freed now, the next step reports ABORT."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        del self._requests[request_id]
        self.structured_outputs.remove(request_id)
        self._pending.append(self._request_output(seq, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def num_free_slots(self) -> int:
        return self.scheduler.num_free_slots()

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer: token ids run from 0 to vocab_size - 1."""
        return self.runner.vocab_size

    def num_free_kv_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        started = time.perf_counter()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        sampling_ids = [seq.request_id for seq, is_sampling in zip(scheduled.seqs, scheduled.is_sampling)
                        if is_sampling]
        mask = self.structured_outputs.bitmask(sampling_ids) if len(self.structured_outputs) else None
        sampled = self.runner.execute(scheduled, mask) if scheduled.seqs else SampledTokens([], [])
        for request_id, computed in sampled.prompt_logprobs.items():
            collected = self._requests[request_id].prompt_logprobs
            if collected is not None:
                for position, scored in computed:  # a recomputed chunk rewrites the same values
                    collected[position] = scored
        texts, stop_hits = self._detokenize(scheduled, sampled.token_ids)
        # A complete grammar ends its request as a stop string would, but keeps its held-back text.
        grammar_done = (self.structured_outputs.advance(sampling_ids, sampled.token_ids)
                        if mask is not None else set())
        self.scheduler.update(scheduled, sampled.token_ids, stop_hits | grammar_done)
        sampling = (seq for seq, is_sampling in zip(scheduled.seqs, scheduled.is_sampling) if is_sampling)
        for seq, logprobs in zip(sampling, sampled.logprobs):
            outputs.append(self._emit_token(seq, texts[seq.request_id], seq.request_id in stop_hits,
                                            logprobs))
        for seq in scheduled.finished:  # retired while scheduling, without a new token
            self.structured_outputs.remove(seq.request_id)
            if self._requests.pop(seq.request_id, None) is not None:
                outputs.append(self._request_output(seq, []))
        preempted = []
        if not self.config.requeue_preempted:
            for seq in scheduled.preempted:
                del self._requests[seq.request_id]
                self.structured_outputs.remove(seq.request_id)
                preempted.append(PreemptedRequest(seq.request_id, seq.output_token_ids))
        return StepOutput(outputs, preempted, self._stats(scheduled, started))

    def _detokenize(self, scheduled: SchedulerOutput, sampled: list[int]) -> tuple[dict[str, str], set[str]]:
        """Each sampled token's released text, and the requests whose text reached a stop string
        (the scheduler decides what that ends, with EOS and the length limits)."""
        texts: dict[str, str] = {}
        stop_hits: set[str] = set()
        sampling = (seq for seq, is_sampling in zip(scheduled.seqs, scheduled.is_sampling) if is_sampling)
        for seq, token_id in zip(sampling, sampled):
            if not seq.params.skip_special_tokens and self.scheduler.is_ending_eos(seq, token_id):
                # The EOS that ends it is not text, special tokens written or not (as vLLM).
                texts[seq.request_id] = ""
                continue
            text, hit_stop = self._requests[seq.request_id].detokenizer.step(token_id)
            texts[seq.request_id] = text
            if hit_stop:
                stop_hits.add(seq.request_id)
        return texts, stop_hits

    def _emit_token(self, seq: Sequence, text: str, hit_stop: bool,
                    logprobs: TokenLogprobs | None) -> RequestOutput:
        request = self._requests[seq.request_id]
        if seq.is_finished:
            del self._requests[seq.request_id]
            self.structured_outputs.remove(seq.request_id)
            if not hit_stop:  # text held back for a possible stop string is released at the end
                text += request.detokenizer.flush()
        token_id = seq.token_ids[-1]
        entry = TokenEntry(seq.num_output_tokens - 1, token_id, text, logprobs)
        output = self._request_output(seq, [entry])
        if seq.needs_prompt_logprobs:  # the first token: every prompt position is computed now
            output.prompt_logprobs = request.prompt_logprobs
            seq.needs_prompt_logprobs = False
            request.prompt_logprobs = None
        return output

    def _request_output(self, seq: Sequence, tokens: list[TokenEntry]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            tokens=tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _stats(self, scheduled: SchedulerOutput, started: float) -> StepStats:
        num_running = len(self.scheduler.running)
        return StepStats(
            num_seqs=len(scheduled.seqs),
            num_scheduled_tokens=scheduled.total_num_scheduled_tokens,
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_cached_tokens=scheduled.num_cached_tokens,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_running=num_running,
            num_waiting=len(self.scheduler.waiting),
            slot_utilisation=num_running / self.limits.max_num_seqs,
            num_preemptions=len(scheduled.preempted),
            step_time_s=time.perf_counter() - started,
        )

    # -- convenience -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[Completion]:
        """Run prompts to completion (strings tokenized raw, no chat template); results in order."""
        if self.has_unfinished():
            raise RuntimeError("generate() drives the engine alone; finish or abort other requests first")
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        run = next(self._generate_ids)
        ids = [f"generate-{run}-{i}" for i in range(len(prompts))]
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for request_id, prompt, p in zip(ids, prompt_ids, params):
            self.add_request(request_id, prompt, p)
        texts = dict.fromkeys(ids, "")
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        reasons: dict[str, FinishReason] = {}
        by_id = dict(zip(ids, zip(prompt_ids, params)))
        while self.has_unfinished():
            out = self.step()
            for request in out.outputs:
                for delta in request.tokens:
                    texts[request.request_id] += delta.text
                    tokens[request.request_id].append(delta.token_id)
                if request.finish_reason is not None:
                    reasons[request.request_id] = request.finish_reason
            for preempted in out.preempted:  # requeue_preempted=False: resume it ourselves
                prompt, p = by_id[preempted.request_id]
                self.add_request(preempted.request_id, prompt, p, preempted.output_token_ids)
        return [
            Completion(texts[i], tokens[i], reasons[i], len(prompt)) for i, prompt in zip(ids, prompt_ids)
        ]

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a chat through the tokenizer's template: ready for the assistant's turn, or
        (continue_final_message) ending inside the last message, which the model continues.
        ValueError where the template cannot continue it. `template_kwargs`: more variables for
        the template (the API kept those it reads, none of apply_chat_template's own)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False,
            **(template_kwargs or {}))
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    # -- sizing ----------------------------------------------------------------------------------

    def _size_kv_pool(self, num_seqs: int) -> tuple[int, int]:
        """(max_model_len, num_kv_blocks): room for `num_seqs` full contexts within the memory cap;
        the pool always holds one full-length sequence."""
        config, runner = self.config, self.runner
        model_len = runner.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ValueError(
                    f"max_model_len={config.max_model_len} exceeds the model's "
                    f"max_position_embeddings={model_len}"
                )
            model_len = config.max_model_len
        if runner.sliding_window is not None and runner.sliding_window < model_len:
            # Within the window, sliding-window attention is full attention, which the kernels do.
            log.warning("capping max_model_len at the model's sliding window, %d", runner.sliding_window)
            model_len = runner.sliding_window
        bytes_per_block = runner.kv_cache_bytes_per_token() * config.block_size
        available = kv_memory.memory_for_kv(runner.device)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            wanted = -(-num_seqs * model_len // config.block_size)
            cap = (int(config.kv_cache_memory_gib * 2**30) if config.kv_cache_memory_gib is not None
                   else kv_memory.default_kv_pool_bytes(available, runner.device.type))
            num_blocks = max(1, min(wanted, cap // bytes_per_block))
        if available is not None and num_blocks * bytes_per_block > available:
            # A CPU pool past the memory there is would be filled with zeros page by page until
            # the kernel kills the process, with no word of why (a GPU's would fail with CUDA's
            # out-of-memory error): refuse it with the numbers instead.
            raise ValueError(
                f"the KV pool would take {num_blocks * bytes_per_block / 2**30:.2f} GiB "
                f"({num_blocks} blocks of {config.block_size} tokens), more than the "
                f"{available / 2**30:.2f} GiB of memory available on {runner.device}: lower "
                "kv_cache_memory_gib (CARPOOL_KV_CACHE_MEMORY_GIB) or num_kv_blocks")
        capacity = num_blocks * config.block_size
        if capacity < model_len:
            if config.max_model_len is not None:
                log.warning("the KV pool holds %d tokens: capping max_model_len=%d", capacity, model_len)
            model_len = capacity
        return model_len, num_blocks

    def _tokenize_bad_words(self, bad_words: Seq[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad_words (SamplingParams.update_from_tokenizer): each word,
        leading whitespace stripped, as is and after a space, so that it is banned at the start
        of the text and mid-text alike. The spaced form is kept only when it starts with another
        token and is as long: where the space is a token of its own, or changes how the word
        splits, that form would not be the word's mid-text spelling (vLLM's rule)."""
        sequences: list[tuple[int, ...]] = []
        for word in dict.fromkeys(bad_words):  # a repeated word bans nothing more
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
            sequences.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self._check_token_ids("bad_words", [token_id for sequence in sequences for token_id in sequence])
        return tuple(sequences)

    def _check_token_ids(self, name: str, token_ids: Seq[int]) -> list[int]:
        ids = list(token_ids)
        vocab_size = self.runner.vocab_size
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"{name} must hold ints, got {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"{name} holds {token_id}, outside the vocabulary [0, {vocab_size})")
        return ids


def _eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    generation_config = getattr(loaded.model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(token_id) for token_id in source)
    return ids
