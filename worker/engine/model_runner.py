"""Runs one packed forward pass per step over a Hugging Face causal LM with a paged KV cache.

Every scheduled token of every sequence goes into one `[1, num_tokens]` batch with its own
position; K/V land in the paged cache through the slot mapping and attention reads them back
through the block tables, so prefill chunks and decodes share a single forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.generation import TokenLogprobs
from worker.engine.config import LogprobsMode
from worker.engine.outputs import SchedulerOutput
from worker.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from worker.engine.structured_output import GrammarBitmask
from worker.model.attention_backend import AttentionMetadata, PagedAttentionBackend
from worker.model.decoder_loop import DecoderLoop
from worker.model.linear_layers import warm_up_packed_layers
from worker.model.loader import LoadedModel, ModelLoadError
from worker.model.plain_weights import release_plain_weights, restore_plain_weights
from worker.model.routing import route_cpu_kernels

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PromptLogprobRows:
    """The extra rows a step keeps logits for, for requests that asked for prompt logprobs: row
    i's logits score prompt token `positions[i]` of request `request_ids[i]` (they come from the
    position before it)."""

    request_ids: list[str]
    positions: list[int]
    num_top: list[int]
    targets: torch.Tensor  # [num_rows] int64: the prompt token each row scores


@dataclass(slots=True)
class ModelInputs:
    """One step's tensors, on the model's device."""

    input_ids: torch.Tensor  # [1, num_tokens] int64
    position_ids: torch.Tensor  # [1, num_tokens] int64
    # [num_sampling + num_prompt_rows] int64: rows whose next token is sampled, then the prompt rows
    logits_indices: torch.Tensor
    attention: AttentionMetadata
    sampling: SamplingMetadata
    prompt_rows: PromptLogprobRows | None = None  # None: nobody in the step asked


@dataclass(slots=True)
class SampledTokens:
    """One step's draws, one per sampling sequence in order, with logprobs where asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # request id -> (prompt position, its logprobs) for the positions this step computed
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True,
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
    ) -> None:
        model = loaded.model
        # Another runner may have released its plain weights (plain_weights): back before any use.
        restore_plain_weights(model)
        first = next(model.parameters())
        if first.device != device or first.dtype != dtype:
            model.to(device=device, dtype=dtype)
        model.eval()
        model.set_attn_implementation(PagedAttentionBackend.register())
        if model.config._attn_implementation != PagedAttentionBackend.NAME:
            # transformers only warns for models outside its attention interface; we would then
            # run their own attention without our cache and return garbage.
            raise ModelLoadError(
                f"{type(model).__name__} does not dispatch attention through transformers' "
                "AttentionInterface, which Carpool's paged KV cache needs"
            )
        self.uses_cpu_kernels = route_cpu_kernels(model, cpu_kernels, device, dtype)
        # The routed model's forward without its module tree, where that reproduces it exactly.
        loop = DecoderLoop.of(model) if self.uses_cpu_kernels else None
        # Where the loop runs the model (every layer routed, whole-head rotary), the engine's steps
        # multiply by the packed copies alone: the plain weights beside them go (plain_weights).
        released = release_plain_weights(model) if loop is not None else 0
        if released:
            log.info("linear weights held once, in their packed copies: %.0f MB of plain copies released",
                     released / 2**20)
            loop = DecoderLoop.of(model)  # records of the weights as they are now, not the released ones
        self.decoder_loop = loop
        self.model = model
        self.device = device
        self.dtype = dtype
        config = model.config.get_text_config()
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings: int | None = getattr(config, "max_position_embeddings", None)
        self.sliding_window = _sliding_window(config)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.sampler = Sampler(logprobs_mode)
        self.eos_token_ids: frozenset[int] = frozenset()  # for min_tokens; set by the engine
        self._pin = device.type == "cuda"

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """Build oneDNN's GEMM primitives for every row count a step can bring (bf16 CPU path), so
        that no step waits 0.7 ms per layer shape for one; a no-op elsewhere."""
        warm_up_packed_layers(self.model, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens))

    def kv_cache_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        # Zeroed, not empty: the attention kernels mask unwritten slots, but NaN garbage is noise.
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        self.block_size = block_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                grammar_mask: GrammarBitmask | None = None) -> SampledTokens:
        """Run the step's forward and sample: one token per sampling sequence, in order.
        `grammar_mask` rules out, on its rows, every token that would leave their grammars."""
        inputs = self.prepare_inputs(out)
        logits = self.forward(inputs)
        prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        if inputs.prompt_rows is not None:
            num_prompt_rows = len(inputs.prompt_rows.positions)
            num_sampling = logits.shape[0] - num_prompt_rows
            prompt_logprobs = self._prompt_logprobs(logits[num_sampling:], inputs.prompt_rows)
            logits = logits[:num_sampling]
        if grammar_mask is not None:
            grammar_mask.apply(logits)
        sampled = self.sample(logits, inputs.sampling)
        sampled.prompt_logprobs = prompt_logprobs
        return sampled

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        starts = out.num_computed_tokens
        lens = out.num_scheduled_tokens
        num_seqs = len(out.seqs)
        input_ids: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        params, seeds, output_indices = [], [], []
        histories: list[list[int]] = []
        num_prompt_tokens: list[int] = []
        bad_words: list[tuple[tuple[int, ...], ...]] = []
        prompt_indices: list[int] = []
        prompt_ids: list[str] = []
        prompt_positions: list[int] = []
        prompt_num_top: list[int] = []
        prompt_targets: list[int] = []
        for seq, start, num_new, is_sampling in zip(out.seqs, starts, lens, out.is_sampling):
            input_ids += seq.token_ids[start : start + num_new]
            end = query_start_loc[-1] + num_new
            if seq.needs_prompt_logprobs:
                # Position p's logits score prompt token p + 1; the last prompt position's are
                # the sampling row's, which score the first output token instead.
                first_row = query_start_loc[-1] - start
                for position in range(start, min(start + num_new, seq.num_prompt_tokens - 1)):
                    prompt_indices.append(first_row + position)
                    prompt_ids.append(seq.request_id)
                    prompt_positions.append(position + 1)
                    prompt_targets.append(seq.token_ids[position + 1])
                    prompt_num_top.append(seq.params.prompt_logprobs or 0)
            query_start_loc.append(end)
            seq_lens.append(start + num_new)
            if is_sampling:
                logits_indices.append(end - 1)
                params.append(seq.params)
                seeds.append(seq.seed)
                output_indices.append(seq.num_output_tokens)  # the index the sampled token gets
                histories.append(seq.token_ids)  # read only for rows with penalties or bad words
                num_prompt_tokens.append(seq.num_prompt_tokens)
                bad_words.append(seq.bad_words_token_ids)
        num_tokens = len(input_ids)
        width = max(len(table) for table in out.block_tables)
        block_tables = [table + [0] * (width - len(table)) for table in out.block_tables]

        qsl = self._tensor(query_start_loc, torch.int32)
        tables = self._tensor(block_tables, torch.int32)
        lens_t = self._tensor(lens, torch.int64)
        # position of token t = its sequence's start + (t - the sequence's first row)
        offsets = self._tensor([s - q for s, q in zip(starts, query_start_loc)], torch.int64)
        positions = torch.arange(num_tokens, device=self.device) + offsets.repeat_interleave(
            lens_t, output_size=num_tokens
        )
        token_seq = torch.arange(num_seqs, device=self.device).repeat_interleave(lens_t, output_size=num_tokens)
        block_ids = tables[token_seq, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        attention = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables,
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=qsl,
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            kv_caches=self.kv_caches,
            use_cpu_kernels=self.uses_cpu_kernels,
        )
        sampling = SamplingMetadata.build(
            params, seeds, output_indices, self.vocab_size, self.device, token_ids=histories,
            num_prompt_tokens=num_prompt_tokens, eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=bad_words)
        prompt_rows = None
        if prompt_indices:
            prompt_rows = PromptLogprobRows(prompt_ids, prompt_positions, prompt_num_top,
                                            self._tensor(prompt_targets, torch.int64))
        return ModelInputs(
            input_ids=self._tensor(input_ids, torch.int64).unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            logits_indices=self._tensor(logits_indices + prompt_indices, torch.int64),
            attention=attention,
            sampling=sampling,
            prompt_rows=prompt_rows,
        )

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits of the kept rows only (`logits_indices`: the sampling rows, then any prompt
        logprob rows): [num_kept, vocab_size] float32."""
        loop = self.decoder_loop
        if loop is not None and inputs.attention.use_cpu_kernels and loop.is_current():
            return loop.logits(inputs.input_ids[0], inputs.position_ids[0], inputs.attention,
                               inputs.logits_indices).float()
        kwargs: dict[str, Any] = {PagedAttentionBackend.KWARG: inputs.attention}
        output = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=inputs.logits_indices,
            **kwargs,
        )
        logits: torch.Tensor = output.logits[0]
        return logits.float()

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SampledTokens:
        if logits.shape[0] == 0:
            return SampledTokens([], [])
        output = self.sampler.forward(logits, metadata)
        token_ids: list[int] = output.token_ids.tolist()  # the step's one host sync...
        return SampledTokens(token_ids, self._logprobs(output, metadata, len(token_ids)))

    @staticmethod
    def _logprobs(output: SamplerOutput, metadata: SamplingMetadata,
                  num_rows: int) -> list[TokenLogprobs | None]:
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        request, sampled = metadata.logprobs, output.logprobs
        if request is None or sampled is None:
            return logprobs
        # ...and more copies only in steps where some request asked for logprobs.
        rows = request.row_list
        values: list[float] = sampled.sampled.tolist()
        top_ids: list[list[int]] = sampled.top_ids.tolist()
        top_values: list[list[float]] = sampled.top_logprobs.tolist()
        for i, row in enumerate(rows):
            k = request.num_top[i]
            logprobs[row] = TokenLogprobs(values[i], tuple(zip(top_ids[i][:k], top_values[i][:k])))
        return logprobs

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor,
                         rows: PromptLogprobRows) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """Each prompt row's token logprob and top-k, of the raw model distribution (no
        temperature or processing: those belong to sampling, and nothing is sampled here)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen_column = logprobs.gather(1, rows.targets.unsqueeze(1))
        chosen: list[float] = chosen_column.squeeze(1).tolist()
        # vLLM's rank: 1 + how many tokens are strictly more likely.
        ranks: list[int] = ((logprobs > chosen_column).sum(dim=1) + 1).tolist()
        max_top = max(rows.num_top)
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if max_top:
            top = logprobs.topk(min(max_top, logprobs.shape[1]), dim=-1)  # sorted, most likely first
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        result: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        for i, (request_id, position, k) in enumerate(zip(rows.request_ids, rows.positions, rows.num_top)):
            pairs = tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ()
            result.setdefault(request_id, []).append((position, TokenLogprobs(chosen[i], pairs, ranks[i])))
        return result

    def _tensor(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True) if self._pin else tensor.to(self.device)


def _sliding_window(config: Any) -> int | None:
    """The attention window if any layer uses one (the kernels attend to the whole context)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
