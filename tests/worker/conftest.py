"""Builders for the worker tests. Nothing here imports torch at module level: the scheduler and
block manager tests must run without it."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from protocol.generation import SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.config import BatchingMode
from worker.engine.outputs import SchedulerOutput
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

EOS = 0


def make_seq(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 4,
    output: Seq[int] = (),
    ignore_eos: bool = True,
) -> Sequence:
    prompt = [100 + i for i in range(num_prompt_tokens)]
    return Sequence(
        request_id=request_id,
        token_ids=prompt + list(output),
        num_prompt_tokens=num_prompt_tokens,
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        seed=0,
    )


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    mode: BatchingMode = BatchingMode.CONTINUOUS,
    requeue_preempted: bool = True,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        mode=mode,
        eos_token_ids=(EOS,),
        requeue_preempted=requeue_preempted,
    )


def fake_step(scheduler: Scheduler, token_id: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step with a stand-in model that samples `token_id` for every sampling sequence."""
    out = scheduler.schedule()
    return out, scheduler.update(out, [token_id] * out.num_sampling)


def check_block_accounting(scheduler: Scheduler) -> None:
    """Exact accounting between steps: a block is free, or held by running tables, its ref_cnt
    counting them; only a cached (hashed, full) block is ever in more than one table."""
    bm = scheduler.block_manager
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    holders: dict[int, list[str]] = {}
    for seq_id, table in bm.tables.items():
        assert len(table) == len(set(table)), f"{seq_id} holds a block twice"
        for block_id in table:
            holders.setdefault(block_id, []).append(seq_id)
    assert not set(free) & set(holders), "a block is both free and held"
    assert len(free) + len(holders) == bm.num_blocks, "a block is neither free nor held"
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_cnt == len(holders.get(block.block_id, [])), block
        if block.ref_cnt > 1:
            assert bm.cached_block_ids.get(block.block_hash) == block.block_id, f"{block} shared uncached"
    for block_hash, block_id in bm.cached_block_ids.items():
        assert bm.blocks[block_id].block_hash == block_hash
    if not bm.enable_prefix_caching:
        assert all(len(seq_ids) == 1 for seq_ids in holders.values())
        assert not bm.cached_block_ids
    running_ids = {seq.request_id for seq in scheduler.running}
    assert set(bm.tables) <= running_ids, "a sequence that is not running holds blocks"
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(bm.block_table(seq.request_id)) == bm.num_blocks_for(seq.num_computed_tokens)
        assert seq.num_computed_tokens < seq.num_tokens
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.num_computed_tokens == 0
        assert seq.request_id not in bm.tables
    assert len(scheduler.running) <= scheduler.max_num_seqs


# -- engine builders (torch is imported inside, on first use) ----------------------------------

GREEDY_MAX_TOKENS = (4, 9, 16, 24)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Any:
    """Tiny models gain nothing from a second thread, and on a busy 2-core box lose a lot."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass(slots=True)
class Run:
    """What an engine produced for each request, gathered from its step outputs."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    indices: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, Any] = field(default_factory=dict)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_steps: int = 0
    max_scheduled_tokens: int = 0

    def collect(self, out: Any) -> None:
        self.num_steps += 1
        self.num_preemptions += out.stats.num_preemptions
        self.num_cached_tokens += out.stats.num_cached_tokens
        self.max_scheduled_tokens = max(self.max_scheduled_tokens, out.stats.num_scheduled_tokens)
        for request in out.outputs:
            for delta in request.tokens:
                self.token_ids.setdefault(request.request_id, []).append(delta.token_id)
                self.indices.setdefault(request.request_id, []).append(delta.index)
                self.texts[request.request_id] = self.texts.get(request.request_id, "") + delta.text
            if request.finish_reason is not None:
                assert request.request_id not in self.reasons, "finished twice"
                self.reasons[request.request_id] = request.finish_reason


def random_prompts(count: int, seed: int, vocab_size: int = 49152) -> list[list[int]]:
    """Prompts of many lengths (1 to 60 tokens) of random ids, skipping the special tokens."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 60] + [rng.randint(1, 60) for _ in range(count - 9)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:count]]


def run_engine(
    engine: Any,
    requests: list[tuple[str, list[int], Any]],
    arrivals: dict[str, int] | None = None,
    max_steps: int = 10_000,
) -> Run:
    """Drive `engine.step()` until done; a request in `arrivals` is added before that step."""
    arrivals = arrivals or {}
    run = Run()
    pending = [r for r in requests if r[0] in arrivals]
    for request_id, prompt, params in requests:
        if request_id not in arrivals:
            engine.add_request(request_id, prompt, params)
    for step in range(max_steps):
        for request_id, prompt, params in list(pending):
            if arrivals[request_id] <= step:
                engine.add_request(request_id, prompt, params)
                pending.remove((request_id, prompt, params))
        if not engine.has_unfinished() and not pending:
            return run
        out = engine.step()
        run.collect(out)
        for preempted in out.preempted:  # requeue_preempted=False: resume, as the Redis worker does
            prompt, params = next((p, s) for r, p, s in requests if r == preempted.request_id)
            engine.add_request(preempted.request_id, prompt, params, preempted.output_token_ids)
    raise AssertionError(f"the engine did not finish in {max_steps} steps")


def _load(directory: Path) -> Any:
    from worker.model.loader import load_model

    return load_model(str(directory))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> Any:
    """A LoadedModel for engines (they switch its attention to the paged one)."""
    return _load(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_qwen2_dir: Path) -> Any:
    return _load(tiny_qwen2_dir)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest) -> Any:
    """Each tiny architecture in turn, with its HF greedy reference for the shared prompts."""
    loaded = request.getfixturevalue(f"tiny_{request.param}")
    directory = request.getfixturevalue(f"tiny_{request.param}_dir")
    return TinyCase(request.param, loaded, greedy_reference(directory, GREEDY_PROMPTS))


@dataclass(slots=True)
class TinyCase:
    architecture: str
    loaded: Any
    reference: list[list[int]]  # HF greedy output of GREEDY_PROMPTS[i], up to GREEDY_PARAMS[i]


GREEDY_PROMPTS = random_prompts(18, seed=7)


def greedy_max_tokens(index: int) -> int:
    return GREEDY_MAX_TOKENS[index % len(GREEDY_MAX_TOKENS)]


def greedy_reference(
    directory: Path, prompts: list[list[int]], max_tokens: list[int] | None = None, dtype: str = "float32",
) -> list[list[int]]:
    """HF `generate`, one prompt at a time, greedy, on a separate (sdpa) model instance."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    outputs = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens[i] if max_tokens else greedy_max_tokens(i),
                do_sample=False, pad_token_id=model.generation_config.eos_token_id,
            )
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def make_engine(loaded: Any, **overrides: Any) -> Any:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    # fp32 on the CPU whatever the machine: the references are fp32 on the CPU (auto picks bf16 on
    # AVX512-BF16/AMX CPUs, and a CUDA GPU where there is one); GPU tests ask for device="cuda".
    settings = {"model": str(loaded.path), "dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 512,
                "max_num_seqs": 32, "max_num_batched_tokens": 256, **overrides}
    return Engine(EngineConfig(**settings), loaded=loaded)
