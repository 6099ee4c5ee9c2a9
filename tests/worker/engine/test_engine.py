"""The engine against Hugging Face `generate`, token for token, under every scheduling regime."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.conftest import (
    GREEDY_PROMPTS,
    Run,
    TinyCase,
    greedy_max_tokens,
    greedy_reference,
    make_engine,
    random_prompts,
    run_engine,
)
from worker.engine.config import BatchingMode, EngineConfig
from worker.engine.engine import Engine, FinishReason, SamplingParams
from worker.model.attention_backend import PagedAttentionBackend


def greedy_requests() -> list[tuple[str, list[int], SamplingParams]]:
    return [
        (f"r{i}", prompt, SamplingParams(max_tokens=greedy_max_tokens(i), temperature=0.0))
        for i, prompt in enumerate(GREEDY_PROMPTS)
    ]


def assert_matches_reference(run: Run, tiny: TinyCase) -> None:
    assert len(GREEDY_PROMPTS) >= 16
    for i, expected in enumerate(tiny.reference):
        request_id = f"r{i}"
        assert run.token_ids[request_id] == expected, f"{tiny.architecture} prompt {i}"
        assert run.indices[request_id] == list(range(len(expected)))
        assert run.reasons[request_id] is FinishReason.LENGTH or expected[-1] == 2


SCENARIOS: dict[str, dict[str, Any]] = {
    "all-at-once": {},
    "tiny-kv-pool": {"num_kv_blocks": 24, "max_num_seqs": 16},  # 96 slots for 18 sequences
    "tiny-kv-pool-handed-back": {"num_kv_blocks": 24, "max_num_seqs": 16, "requeue_preempted": False},
    "tiny-kv-pool-no-prefix-cache": {"num_kv_blocks": 24, "max_num_seqs": 16, "enable_prefix_caching": False},
    "chunked-prefill-8": {"max_num_batched_tokens": 8},
    "static": {"mode": BatchingMode.STATIC, "max_num_seqs": 8},
    "sequential": {"mode": BatchingMode.SEQUENTIAL},
    "torch-only": {"enable_cpu_kernels": False},  # the twins: F.linear and the torch paged attention
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_equals_hf_generate(tiny: TinyCase, scenario: str) -> None:
    engine = make_engine(tiny.loaded, **SCENARIOS[scenario])
    run = run_engine(engine, greedy_requests())
    assert_matches_reference(run, tiny)
    assert engine.num_free_kv_blocks() == engine.block_manager.num_blocks
    if scenario.startswith("tiny-kv-pool"):
        assert run.num_preemptions > 0
    if scenario == "chunked-prefill-8":
        assert run.max_scheduled_tokens == 8


def test_greedy_equals_hf_generate_with_staggered_arrivals(tiny: TinyCase) -> None:
    engine = make_engine(tiny.loaded, num_kv_blocks=40, max_num_batched_tokens=16)
    arrivals = {f"r{i}": 1 + (i * 5) % 17 for i in range(0, len(GREEDY_PROMPTS), 2)}
    run = run_engine(engine, greedy_requests(), arrivals)
    assert_matches_reference(run, tiny)


def test_greedy_equals_hf_generate_with_a_cached_shared_prefix(
    tiny: TinyCase, tiny_llama_dir: Any, tiny_qwen2_dir: Any,
) -> None:
    directory = tiny_llama_dir if tiny.architecture == "llama" else tiny_qwen2_dir
    shared = GREEDY_PROMPTS[8][:21]
    prompts = [shared + suffix[:n] for n, suffix in zip((1, 3, 6, 11, 2, 7), GREEDY_PROMPTS[9:15])]
    expected = greedy_reference(directory, prompts, [10] * len(prompts))
    params = SamplingParams(max_tokens=10, temperature=0.0)
    for overrides in ({}, {"num_kv_blocks": 20, "max_num_batched_tokens": 16}):
        engine = make_engine(tiny.loaded, **overrides)
        requests = [(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]
        arrivals = {f"p{i}": 2 * i for i in range(1, len(prompts))}  # the prefix is cached by then
        run = run_engine(engine, requests, arrivals)
        assert [run.token_ids[f"p{i}"] for i in range(len(prompts))] == expected
        assert run.num_cached_tokens >= 20 * (len(prompts) - 1)  # five blocks of 4 each time
        assert engine.num_free_kv_blocks() == engine.block_manager.num_blocks


def test_attention_metadata_reaches_the_attention_layers(tiny: TinyCase) -> None:
    model = tiny.loaded.model
    make_engine(tiny.loaded)
    assert model.config._attn_implementation == PagedAttentionBackend.NAME
    with pytest.raises(RuntimeError, match=PagedAttentionBackend.KWARG), torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6]]), use_cache=False)


def test_no_attention_mask_is_built(tiny: TinyCase) -> None:
    from transformers.masking_utils import create_causal_mask

    model = tiny.loaded.model
    make_engine(tiny.loaded)
    embeds = torch.zeros(1, 7, model.config.hidden_size)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]),
    )
    assert mask is None


# -- stop conditions ---------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens_is_not_emitted(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    prompt = GREEDY_PROMPTS[5]
    free = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the last 2 characters of token 6 and the first 2 of token 7.
    assert len(pieces[6]) >= 2 and len(pieces[7]) >= 2, pieces
    stop = pieces[6][-2:] + pieces[7][:2]
    start = free.text.find(stop)
    assert start >= 0
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == free.text[:start]
    assert stop not in stopped.text
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) <= 8


def test_eos_stops_generation_as_in_hf(tiny_llama_dir: Any) -> None:
    from worker.model.loader import load_model

    loaded = load_model(str(tiny_llama_dir))  # its own copy: we change its EOS token
    prompt = GREEDY_PROMPTS[3]
    free = greedy_reference(tiny_llama_dir, [prompt], [16])[0]
    eos = free[5]
    assert eos not in free[:5]
    loaded.model.generation_config.eos_token_id = eos
    engine = make_engine(loaded)
    run = run_engine(engine, [("eos", prompt, SamplingParams(max_tokens=16, temperature=0.0))])
    assert run.token_ids["eos"] == free[:6]
    assert run.reasons["eos"] is FinishReason.STOP
    run = run_engine(
        engine, [("ignored", prompt, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))]
    )
    assert run.token_ids["ignored"] == free[:9]
    assert run.reasons["ignored"] is FinishReason.LENGTH


def test_max_tokens_and_context_length(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama, max_model_len=32)
    assert engine.max_model_len == 32
    requests = [
        ("max-tokens", [5] * 4, SamplingParams(max_tokens=3)),
        ("context", [5] * 28, SamplingParams(max_tokens=100)),
    ]
    run = run_engine(engine, requests)
    assert len(run.token_ids["max-tokens"]) == 3 and run.reasons["max-tokens"] is FinishReason.LENGTH
    assert len(run.token_ids["context"]) == 4 and run.reasons["context"] is FinishReason.LENGTH


def test_streamed_text_is_the_decoded_output(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    results = engine.generate(GREEDY_PROMPTS[:6], SamplingParams(max_tokens=20, temperature=0.7, seed=3))
    for result in results:
        # The decoded ids, but a last character still missing bytes (Detokenizer.flush).
        assert result.text == engine.tokenizer.decode(result.token_ids,
                                                      skip_special_tokens=True).rstrip("\ufffd")
        assert "\ufffd" not in result.text or "\ufffd" in engine.tokenizer.decode(result.token_ids)


# -- seeds -------------------------------------------------------------------------------------

SEEDED = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=1234)


def test_seeded_tokens_do_not_depend_on_batch_companions(tiny_llama: Any) -> None:
    prompt = GREEDY_PROMPTS[4]
    alone = run_engine(make_engine(tiny_llama), [("seeded", prompt, SEEDED)])
    companions = [(f"c{i}", p, SamplingParams(max_tokens=12, temperature=1.0))
                  for i, p in enumerate(GREEDY_PROMPTS[6:14])]
    crowded = run_engine(make_engine(tiny_llama), [*companions[:4], ("seeded", prompt, SEEDED), *companions[4:]])
    assert crowded.token_ids["seeded"] == alone.token_ids["seeded"]
    assert len(set(map(tuple, crowded.token_ids.values()))) == len(crowded.token_ids)


def test_seeded_tokens_survive_preemption_and_resume(tiny_llama: Any) -> None:
    prompt = GREEDY_PROMPTS[4]
    alone = run_engine(make_engine(tiny_llama), [("seeded", prompt, SEEDED)])
    others = [(f"o{i}", p, SamplingParams(max_tokens=20, temperature=0.0)) for i, p in enumerate(GREEDY_PROMPTS[8:16])]
    for requeue in (True, False):
        engine = make_engine(tiny_llama, num_kv_blocks=24, requeue_preempted=requeue)
        tight = run_engine(engine, [*others, ("seeded", prompt, SEEDED)])
        assert tight.num_preemptions > 0
        assert tight.token_ids["seeded"] == alone.token_ids["seeded"]
        assert tight.texts["seeded"] == alone.texts["seeded"]


def test_resume_with_output_token_ids_continues_identically(tiny_llama: Any) -> None:
    prompt = GREEDY_PROMPTS[4]
    whole = run_engine(make_engine(tiny_llama), [("seeded", prompt, SEEDED)])
    tokens = whole.token_ids["seeded"]
    engine = make_engine(tiny_llama)
    engine.add_request("seeded", prompt, SEEDED, output_token_ids=tokens[:7])
    rest = run_engine(engine, [])
    assert rest.token_ids["seeded"] == tokens[7:]
    assert rest.indices["seeded"] == list(range(7, len(tokens)))
    first_part = "".join(
        engine.tokenizer.decode(tokens[:7], skip_special_tokens=True)
    )
    assert first_part + rest.texts["seeded"] == whole.texts["seeded"]


def test_unseeded_requests_get_their_own_seed(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=12, temperature=1.0)
    run = run_engine(engine, [(f"u{i}", GREEDY_PROMPTS[2], params) for i in range(4)])
    assert len({tuple(tokens) for tokens in run.token_ids.values()}) > 1


# -- lifecycle -------------------------------------------------------------------------------


def test_abort_frees_blocks_now_and_reports_at_the_next_step(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama, num_kv_blocks=64)
    engine.add_request("keep", GREEDY_PROMPTS[6], SamplingParams(max_tokens=8))
    engine.add_request("drop", GREEDY_PROMPTS[7], SamplingParams(max_tokens=8))
    engine.step()
    before = engine.num_free_kv_blocks()
    assert engine.abort("drop") is True
    assert engine.num_free_kv_blocks() > before
    assert engine.abort("drop") is False and engine.abort("never-added") is False
    out = engine.step()
    aborted = [o for o in out.outputs if o.request_id == "drop"]
    assert len(aborted) == 1 and aborted[0].finish_reason is FinishReason.CANCELED and aborted[0].tokens == []
    run = run_engine(engine, [])
    assert set(run.reasons) == {"keep"}
    assert engine.num_free_kv_blocks() == 64


def test_free_slots_by_mode(tiny_llama: Any) -> None:
    params = SamplingParams(max_tokens=3)
    continuous = make_engine(tiny_llama, max_num_seqs=4)
    continuous.add_request("a", [5, 6], params)
    assert continuous.num_free_slots() == 3
    static = make_engine(tiny_llama, max_num_seqs=4, mode=BatchingMode.STATIC)
    static.add_request("a", [5, 6], params)
    static.step()
    assert static.num_free_slots() == 0
    sequential = make_engine(tiny_llama, mode=BatchingMode.SEQUENTIAL)
    assert sequential.num_free_slots() == 1
    sequential.add_request("a", [5, 6], params)
    assert sequential.num_free_slots() == 0


def test_step_stats(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=4, num_kv_blocks=64)
    for i in range(5):
        engine.add_request(f"s{i}", GREEDY_PROMPTS[i + 1], SamplingParams(max_tokens=4))
    stats = engine.step().stats
    assert stats.num_seqs == 4 and stats.num_running == 4 and stats.num_waiting == 1
    assert stats.num_prefill_tokens == sum(len(GREEDY_PROMPTS[i + 1]) for i in range(4))
    assert stats.num_decode_tokens == 0 and stats.num_scheduled_tokens == stats.num_prefill_tokens
    assert stats.slot_utilisation == 1.0 and stats.num_kv_blocks_total == 64
    assert 0 < stats.num_kv_blocks_used == 64 - engine.num_free_kv_blocks()
    stats = engine.step().stats
    assert stats.num_decode_tokens == 4 and stats.step_time_s > 0


def test_generate_and_chat_encoding(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    ids = engine.encode_chat([{"role": "user", "content": "Hi"}])
    assert engine.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    results = engine.generate(["Hello there", ids], SamplingParams(max_tokens=5, temperature=0.0))
    assert [r.num_prompt_tokens for r in results] == [len(engine.tokenizer.encode("Hello there")), len(ids)]
    assert all(len(r.token_ids) == 5 and r.finish_reason is FinishReason.LENGTH for r in results)


def test_chat_encoding_continues_the_final_message_as_transformers_renders_it(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    continued = engine.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert engine.tokenizer.decode(continued).endswith("<|im_start|>assistant\nHello, I am")
    closed = engine.encode_chat(messages, add_generation_prompt=False)
    assert engine.tokenizer.decode(closed).endswith("Hello, I am<|im_end|>\n")
    with pytest.raises(ValueError, match="continue_final_message"):
        engine.encode_chat(messages, add_generation_prompt=True, continue_final_message=True)


def test_chat_encoding_passes_template_kwargs_to_the_template(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    assert engine.tokenizer.decode(engine.encode_chat(messages, template_kwargs={"shout": True})) == "Hi!"
    assert engine.tokenizer.decode(engine.encode_chat(messages)) == "Hi"


def test_skip_special_tokens_false_writes_them_but_not_the_ending_eos(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    im_start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in engine.eos_token_ids and im_start in engine.tokenizer.all_special_ids
    forced = SamplingParams(max_tokens=3, temperature=0.0, logit_bias=((im_start, 100.0),))
    written, skipped = engine.generate(["Hello", "Hello"], [
        dataclasses.replace(forced, skip_special_tokens=False), forced])
    assert written.token_ids == skipped.token_ids == [im_start] * 3
    assert (written.text, skipped.text) == ("<|im_start|>" * 3, "")
    (eos,) = sorted(engine.eos_token_ids)[:1]
    (ended,) = engine.generate(["Hello"], SamplingParams(
        max_tokens=3, temperature=0.0, logit_bias=((eos, 100.0),), skip_special_tokens=False))
    assert ended.token_ids == [eos] and ended.finish_reason is FinishReason.STOP and ended.text == ""


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "prompt_token_ids is empty"),
        ([5, 49152], {}, "outside the vocabulary"),
        ([5, -1], {}, "outside the vocabulary"),
        ([5, "6"], {}, "must hold ints"),
        ([5] * 64, {}, "max_model_len=64"),
        ([5] * 60, {"output_token_ids": [6] * 4}, "plus output"),
        ([5], {"output_token_ids": [6] * 16}, "nothing is left to generate"),
    ],
)
def test_add_request_validation(tiny_llama: Any, prompt: list, kwargs: dict, message: str) -> None:
    engine = make_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, SamplingParams(max_tokens=16), **kwargs)
    assert not engine.has_unfinished()


def test_add_request_rejects_a_duplicate_id(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("r", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("r", [6], SamplingParams())


def test_max_model_len_is_capped_by_the_pool(tiny_llama: Any) -> None:
    assert make_engine(tiny_llama, num_kv_blocks=10, max_model_len=None).max_model_len == 40
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_engine(tiny_llama, max_model_len=4096)


def test_engine_is_exported_lazily() -> None:
    import worker.engine

    assert worker.engine.Engine is Engine and worker.engine.EngineConfig is EngineConfig
    assert {"Engine", "EngineConfig", "SamplingParams", "BatchingMode"} <= set(worker.engine.__all__)


def test_kv_pool_is_sized_from_the_config(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama, num_kv_blocks=None, max_num_seqs=2, max_model_len=100, block_size=16)
    assert engine.block_manager.num_blocks == 13  # ceil(2 * 100 / 16)
    budget = make_engine(tiny_llama, num_kv_blocks=None, max_model_len=1024, kv_cache_memory_gib=1 / 1024)
    per_block = engine.runner.kv_cache_bytes_per_token() * 4
    assert budget.block_manager.num_blocks == 2**20 // per_block
    assert budget.max_model_len == min(1024, budget.block_manager.num_blocks * 4)


def test_a_cpu_kv_pool_larger_than_the_memory_available_is_refused_with_its_size(
        tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import kv_memory

    per_block = make_engine(tiny_llama).runner.kv_cache_bytes_per_token() * 4
    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: 100 * per_block)
    assert make_engine(tiny_llama, num_kv_blocks=100).block_manager.num_blocks == 100
    with pytest.raises(ValueError, match=r"\(101 blocks of 4 tokens\), more than the .* GiB of "
                                         r"memory available on cpu: lower kv_cache_memory_gib"):
        make_engine(tiny_llama, num_kv_blocks=101)
    sized = {"num_kv_blocks": None, "max_num_seqs": 1, "max_model_len": 1024}
    with pytest.raises(ValueError, match="more than the"):
        make_engine(tiny_llama, **sized, kv_cache_memory_gib=1.0)  # the seat's 256 blocks
    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: None)  # not Linux
    assert make_engine(tiny_llama, **sized, kv_cache_memory_gib=1.0).block_manager.num_blocks == 256


def test_an_unset_kv_pool_cap_is_a_quarter_of_the_memory_on_a_cpu(
        tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import kv_memory

    gib = 2**30
    for available, cap in [(24 * gib, 6 * gib), (6 * gib, 2 * gib), (3 * gib, 3 * gib // 2), (None, 2 * gib)]:
        assert kv_memory.default_kv_pool_bytes(available) == cap, available  # None: a GPU, or not Linux
    per_block = make_engine(tiny_llama).runner.kv_cache_bytes_per_token() * 4
    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: 400 * per_block)
    sized = {"num_kv_blocks": None, "max_num_seqs": 1, "max_model_len": 1024}  # wants 256 blocks
    assert make_engine(tiny_llama, **sized).block_manager.num_blocks == 200  # half: 2 GiB is more
    assert make_engine(tiny_llama, **sized, kv_cache_memory_gib=1.0).block_manager.num_blocks == 256


def test_an_unset_kv_pool_cap_is_half_the_free_memory_on_a_gpu() -> None:
    from worker.engine import kv_memory

    gib = 2**30
    # 2 GiB, fixed, was the cap on every GPU: 4,096 tokens of a 7B Llama's K/V on an 80 GB card.
    for free, cap in [(64 * gib, 32 * gib), (3 * gib, 3 * gib // 2), (None, 2 * gib)]:
        assert kv_memory.default_kv_pool_bytes(free, "cuda") == cap, free
    assert kv_memory.default_kv_pool_bytes(64 * gib, "cpu") == 16 * gib


def test_the_memory_for_the_kv_pool_is_the_devices_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import kv_memory

    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: 12345)
    assert kv_memory.memory_for_kv(torch.device("cpu")) == 12345
    assert kv_memory.memory_for_kv(torch.device("meta")) is None
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(0)
        assert abs(kv_memory.memory_for_kv(torch.device("cuda", 0)) - free) < 256 * 2**20


_FREED_AND_RETURNED = """
from worker.engine import kv_memory
def anon_mb():
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))
chunks = [bytearray(64 * 1024) for _ in range(3000)]  # 192 MB in chunks malloc keeps in its heap
pin = bytearray(64 * 1024)  # above them: the heap's top is in use, so free() alone trims nothing
del chunks
freed = anon_mb()
kv_memory.return_free_memory()
print(freed, anon_mb())
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux only")
@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_the_allocators_free_pages_go_back_before_the_pool_is_sized(allocator: str) -> None:
    # The KV pool is sized from MemAvailable (kv_memory.memory_for_kv), which cannot see pages a
    # process freed while its allocator keeps them: the routing frees hundreds of MB so.
    import subprocess
    import sys

    from worker.model import process_preloads

    env = dict(os.environ)
    if allocator == "tcmalloc":
        library = process_preloads.tcmalloc_library()
        if library is None:
            pytest.skip("no tcmalloc here")
        env["LD_PRELOAD"] = str(library)
    out = subprocess.run([sys.executable, "-c", _FREED_AND_RETURNED], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[3]).stdout
    freed, returned = (int(value) for value in out.split())
    assert freed - returned >= 150, (freed, returned)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_engine_sizes_its_kv_pool_from_the_free_memory(tiny_llama: Any) -> None:
    from worker.engine import kv_memory

    gib = 2**30
    per_block = make_engine(tiny_llama, device="cuda").runner.kv_cache_bytes_per_token() * 4
    free = kv_memory.memory_for_kv(torch.device("cuda", 0))
    assert free is not None
    if free < 4 * gib:
        pytest.skip("needs 4 GiB of GPU memory free")
    # 3 GiB left free: half of it is less than the 2 GiB the engine wants (4,096 contexts of 1,024
    # tokens), which the fixed 2 GiB cap of before would have given it.
    hog = torch.empty(free - 3 * gib, dtype=torch.uint8, device="cuda")
    try:
        left = kv_memory.memory_for_kv(torch.device("cuda", 0))
        assert left is not None
        engine = make_engine(tiny_llama, device="cuda", num_kv_blocks=None, max_num_seqs=4096,
                             max_model_len=1024)
        assert 4096 * 1024 // 4 * per_block == 2 * gib
        assert (left - 2**28) // 2 // per_block <= engine.block_manager.num_blocks <= left // 2 // per_block
        with pytest.raises(ValueError, match=r"GiB of memory available on cuda"):
            make_engine(tiny_llama, device="cuda", num_kv_blocks=(left + gib) // per_block)
    finally:
        del hog
        torch.cuda.empty_cache()


def test_the_memory_available_is_the_smaller_of_meminfo_and_the_cgroup_limit(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import kv_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    v2_max, v2_current, v1_limit, v1_usage = (tmp_path / name for name in ("max", "current", "limit", "usage"))
    monkeypatch.setattr(kv_memory, "MEMINFO_PATH", str(meminfo))
    monkeypatch.setattr(kv_memory, "CGROUP_MEMORY_FILES",
                        ((str(v2_max), str(v2_current)), (str(v1_limit), str(v1_usage))))
    assert kv_memory.available_memory_bytes() == 20000000 * 1024  # no cgroup files: MemAvailable
    v2_max.write_text("max\n")
    v2_current.write_text("123\n")
    assert kv_memory.available_memory_bytes() == 20000000 * 1024  # v2, unlimited
    v2_max.write_text(f"{8 * 2**30}\n")
    v2_current.write_text(f"{3 * 2**30}\n")
    assert kv_memory.available_memory_bytes() == 5 * 2**30  # a container of 8 GiB, 3 used
    v2_max.unlink()
    v1_limit.write_text("9223372036854771712\n")  # v1, unlimited
    v1_usage.write_text(f"{10 * 2**30}\n")
    assert kv_memory.available_memory_bytes() == 20000000 * 1024
    v1_limit.write_text(f"{4 * 2**30}\n")
    v1_usage.write_text(f"{5 * 2**30}\n")  # past its limit: nothing left
    assert kv_memory.available_memory_bytes() == 0
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert kv_memory.available_memory_bytes() is None


def test_a_worker_whose_kv_pool_cannot_fit_exits_as_for_bad_settings(
        tiny_llama_dir: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from worker.__main__ import main as worker_main
    from worker.engine import kv_memory
    from worker.jobs.batching_worker import BatchingWorker

    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: 2**20)
    monkeypatch.setattr(BatchingWorker, "run", lambda self: 99)  # (had its engine been built)
    args = ["--model", str(tiny_llama_dir), "--redis-url", redis_url, "--dtype", "float32"]
    assert worker_main([*args, "--kv-cache-memory-gib", "1"]) == 2
    assert "more than the 0.00 GiB of memory available" in caplog.text
    assert worker_main(args) == 99  # unset, the cap is sized from the memory there is


def test_random_prompts_builder_is_deterministic() -> None:
    assert random_prompts(12, seed=1) == random_prompts(12, seed=1)


def test_cpu_kernels_switch_routes_the_linear_layers(tiny: TinyCase) -> None:
    from kernels import cpu_extension
    from worker.model.linear_layers import DispatchedLinear

    def linear_classes() -> set[type]:
        return {type(m) for m in tiny.loaded.model.modules() if isinstance(m, torch.nn.Linear)}

    def fused_modules() -> int:
        return sum(type(m).__name__.startswith("Fused") for m in tiny.loaded.model.modules())

    try:
        engine = make_engine(tiny.loaded, enable_cpu_kernels=False)
        assert not engine.runner.uses_cpu_kernels and linear_classes() == {torch.nn.Linear}
        assert fused_modules() == 0
        engine = make_engine(tiny.loaded)
        built = cpu_extension.load() is not None
        assert engine.runner.uses_cpu_kernels is built
        assert linear_classes() == ({DispatchedLinear} if built else {torch.nn.Linear})
        assert fused_modules() == (11 if built else 0)  # 2 layers x (2 norms + MLP + attention + layer) + final norm
    finally:
        make_engine(tiny.loaded)  # leave the shared model as the other tests expect it
