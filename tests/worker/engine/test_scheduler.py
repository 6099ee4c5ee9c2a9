"""Scheduler tests with a stand-in model: no torch, milliseconds each."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.generation import FinishReason
from tests.worker.conftest import EOS, check_block_accounting, fake_step, make_scheduler, make_seq
from worker.engine.config import BatchingMode
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus


def test_scheduler_and_block_manager_do_not_import_torch() -> None:
    code = (
        "import sys, worker.engine.scheduler, worker.engine.block_manager, worker.engine.sequence;"
        "import worker.engine.detokenizer, worker.engine.outputs;"
        "import worker.engine.config, protocol.generation;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_prompt_is_prefilled_then_decoded_one_token_a_step() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", num_prompt_tokens=5, max_tokens=3)
    scheduler.add(seq)
    out, finished = fake_step(scheduler)
    assert (out.num_scheduled_tokens, out.is_sampling, out.num_prefill_tokens) == ([5], [True], 5)
    assert seq.num_computed_tokens == 5 and seq.output_token_ids == [7]
    out, _ = fake_step(scheduler)
    assert (out.num_computed_tokens, out.num_scheduled_tokens, out.num_decode_tokens) == ([5], [1], 1)
    out, finished = fake_step(scheduler)
    assert finished == [seq] and seq.finish_reason is FinishReason.LENGTH
    assert seq.output_token_ids == [7, 7, 7]
    assert scheduler.block_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished()


def test_long_prompts_are_chunked_and_sample_only_at_the_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq("a", num_prompt_tokens=20, max_tokens=2)
    scheduler.add(seq)
    chunks = []
    for _ in range(3):
        out, _ = fake_step(scheduler)
        chunks.append((out.num_computed_tokens[0], out.num_scheduled_tokens[0], out.is_sampling[0]))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert seq.output_token_ids == [7]


def test_decodes_go_first_and_a_long_prompt_takes_the_leftover_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    first = make_seq("first", num_prompt_tokens=3, max_tokens=10)
    scheduler.add(first)
    fake_step(scheduler)
    long = make_seq("long", num_prompt_tokens=30, max_tokens=2)
    scheduler.add(long)
    for step in range(4):
        out, _ = fake_step(scheduler)
        assert out.seqs[0] is first and out.num_scheduled_tokens[0] == 1, step
        assert out.total_num_scheduled_tokens <= 8
    assert long.num_computed_tokens == 7 * 4
    assert first.num_output_tokens == 5


def test_admission_respects_max_num_seqs_and_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(str(i), num_prompt_tokens=4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.num_free_slots() == 0
    out, _ = fake_step(scheduler)
    assert out.seqs == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]]


def test_the_youngest_running_sequence_is_preempted_and_requeued_in_front() -> None:
    # 6 blocks of 2 slots; three sequences of 3 prompt tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b, c = (make_seq(name, num_prompt_tokens=3, max_tokens=8) for name in "abc")
    late = make_seq("late", num_prompt_tokens=1)
    for seq in (a, b, c):
        scheduler.add(seq)
    fake_step(scheduler)
    scheduler.add(late)
    out, _ = fake_step(scheduler)  # every sequence now holds 4 tokens in 2 blocks: the pool is full
    assert out.preempted == []
    out, _ = fake_step(scheduler)  # a needs a third block: c, the youngest, goes
    assert out.preempted == [c]
    assert out.seqs == [a, b]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.output_token_ids == [7, 7] and c.num_preemptions == 1
    assert list(scheduler.waiting) == [c, late]
    check_block_accounting(scheduler)


def test_a_background_sequence_is_preempted_first_even_when_older() -> None:
    # As above, but a (the oldest) is a background request: it goes, not c, the youngest.
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b, c = (make_seq(name, num_prompt_tokens=3, max_tokens=8) for name in "abc")
    a.preempt_first = True
    late = make_seq("late", num_prompt_tokens=1)
    for seq in (a, b, c):
        scheduler.add(seq)
    fake_step(scheduler)
    scheduler.add(late)
    fake_step(scheduler)  # the pool is full
    out, _ = fake_step(scheduler)  # a (oldest) needs a third block first: it steps aside itself
    assert out.preempted == [a]
    assert out.seqs == [b, c]
    assert a.status is SequenceStatus.WAITING and a.num_preemptions == 1
    assert c.num_preemptions == 0
    check_block_accounting(scheduler)


def test_a_background_sequence_only_preempts_younger_ones() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b, c = (make_seq(name, num_prompt_tokens=3, max_tokens=8) for name in "abc")
    a.preempt_first = b.preempt_first = True
    for seq in (a, b, c):
        scheduler.add(seq)
    fake_step(scheduler)
    fake_step(scheduler)
    out, _ = fake_step(scheduler)  # a (background) needs a block: b, younger and background, goes
    assert out.preempted == [b]
    assert out.seqs == [a, c]
    check_block_accounting(scheduler)


def test_a_sequence_preempts_itself_when_it_is_the_youngest_holder() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, max_num_batched_tokens=64)
    a, b = make_seq("a", 2, max_tokens=8), make_seq("b", 1, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)  # a: 2 tokens in block 1, b: 1 token in block 2 (+1 sampled each)
    out, _ = fake_step(scheduler)  # a needs a block and preempts b
    assert out.preempted == [b] and out.seqs == [a]
    check_block_accounting(scheduler)


def test_preempted_requests_are_handed_back_when_not_requeued() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, requeue_preempted=False)
    a, b = make_seq("a", 2, max_tokens=8), make_seq("b", 1, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)
    out, _ = fake_step(scheduler)
    assert out.preempted == [b]
    assert list(scheduler.waiting) == [] and scheduler.get("b") is None
    check_block_accounting(scheduler)


def test_a_lone_sequence_that_outgrows_the_pool_finishes_with_length() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, max_model_len=100)
    seq = make_seq("a", 3, max_tokens=50)
    scheduler.add(seq)
    reasons = []
    for _ in range(10):
        _, finished = fake_step(scheduler)
        reasons += [s.finish_reason for s in finished]
        if not scheduler.has_unfinished():
            break
    assert reasons == [FinishReason.LENGTH]
    assert seq.num_tokens == 5  # four slots computed, then one more token sampled
    assert scheduler.block_manager.num_free_blocks == 2


def test_a_request_that_can_never_fit_is_finished_not_looped() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, max_model_len=100)
    too_long = make_seq("too-long", num_prompt_tokens=5)
    fits = make_seq("fits", num_prompt_tokens=2, max_tokens=1)
    scheduler.add(too_long)
    scheduler.add(fits)
    _, finished = fake_step(scheduler)
    assert finished == [too_long, fits]
    assert too_long.finish_reason is FinishReason.LENGTH and too_long.num_output_tokens == 0


def test_stop_reasons_eos_max_tokens_and_context() -> None:
    scheduler = make_scheduler(max_model_len=6)
    eos = make_seq("eos", 2, max_tokens=10, ignore_eos=False)
    ignored = make_seq("ignored", 2, max_tokens=2, ignore_eos=True)
    context = make_seq("context", 4, max_tokens=10)
    for seq in (eos, ignored, context):
        scheduler.add(seq)
    _, finished = fake_step(scheduler, token_id=EOS)
    assert finished == [eos] and eos.finish_reason is FinishReason.STOP
    _, finished = fake_step(scheduler, token_id=EOS)
    assert set(finished) == {ignored, context}
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.output_token_ids == [EOS, EOS]
    assert context.finish_reason is FinishReason.LENGTH and context.num_tokens == 6


def test_a_resumed_sequence_recomputes_its_output_and_continues() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", 3, max_tokens=4, output=[9, 9])
    scheduler.add(seq)
    out, _ = fake_step(scheduler)
    assert out.num_scheduled_tokens == [5] and out.is_sampling == [True]
    assert seq.output_token_ids == [9, 9, 7]


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=4)
    running, waiting = make_seq("running", 5), make_seq("waiting", 3)
    scheduler.add(running)
    fake_step(scheduler)
    scheduler.add(waiting)
    assert scheduler.block_manager.num_used_blocks == 2
    assert scheduler.abort("running") is running
    assert scheduler.abort("waiting") is waiting
    assert scheduler.abort("waiting") is None
    assert running.finish_reason is FinishReason.CANCELED and waiting.finish_reason is FinishReason.CANCELED
    assert scheduler.block_manager.num_free_blocks == 4
    assert not scheduler.has_unfinished()


def test_static_batches_admit_nobody_until_the_last_member_finishes() -> None:
    scheduler = make_scheduler(mode=BatchingMode.STATIC, max_num_seqs=2)
    short, long = make_seq("short", 2, max_tokens=1), make_seq("long", 2, max_tokens=4)
    scheduler.add(short)
    scheduler.add(long)
    assert scheduler.num_free_slots() == 0
    fake_step(scheduler)
    assert scheduler.num_free_slots() == 0
    late = make_seq("late", 2, max_tokens=1)
    scheduler.add(late)
    for _ in range(3):
        out, _ = fake_step(scheduler)
        assert out.seqs == [long]
    out, _ = fake_step(scheduler)
    assert out.seqs == [late]
    fake_step(scheduler)
    assert scheduler.num_free_slots() == 2


def test_sequential_mode_runs_one_request_at_a_time() -> None:
    scheduler = make_scheduler(mode=BatchingMode.SEQUENTIAL, max_num_seqs=8)
    seqs = [make_seq(str(i), 2, max_tokens=2) for i in range(3)]
    assert scheduler.num_free_slots() == 1
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.num_free_slots() == 0
    order = []
    while scheduler.has_unfinished():
        out, _ = fake_step(scheduler)
        assert len(out.seqs) == 1
        order.append(out.seqs[0].request_id)
    assert order == ["0", "0", "1", "1", "2", "2"]


# -- property: exact accounting and progress under any mix of add / abort / step ---------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 8), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_ops,
    num_blocks=st.integers(1, 8),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    extra_len=st.integers(-4, 4),
    mode=st.sampled_from(list(BatchingMode)),
    requeue_preempted=st.booleans(),
    enable_prefix_caching=st.booleans(),
)
def test_block_accounting_is_exact_after_every_step(
    ops: list[tuple],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    extra_len: int,
    mode: BatchingMode,
    requeue_preempted: bool,
    enable_prefix_caching: bool,
) -> None:
    # max_model_len around the pool's size: past it the scheduler's own guards must hold.
    max_model_len = max(2, num_blocks * block_size + extra_len)
    scheduler = make_scheduler(
        num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, mode,
        requeue_preempted, enable_prefix_caching,
    )
    seqs: list[Sequence] = []
    handed_back: list[Sequence] = []

    def step(token_id: int) -> None:
        out, finished = fake_step(scheduler, token_id)
        assert out.total_num_scheduled_tokens <= max_num_batched_tokens
        for seq in finished:
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is not None
        handed_back.extend(s for s in out.preempted if not requeue_preempted)
        check_block_accounting(scheduler)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, num_output = op
            # As the engine admits them: room for one more token, below max_tokens.
            num_output = min(num_output, max_tokens - 1, max_model_len - 2)
            prompt_len = min(prompt_len, max_model_len - 1 - num_output)
            seq = make_seq(f"r{len(seqs)}", prompt_len, max_tokens, [7] * num_output, ignore_eos=False)
            seqs.append(seq)
            scheduler.add(seq)
        elif op[0] == "abort":
            if seqs:
                scheduler.abort(seqs[op[1] % len(seqs)].request_id)
        else:
            step(EOS if op[1] == 0 else 7)  # some EOS, mostly not
        check_block_accounting(scheduler)

    # Progress: whatever happened, the work drains in bounded steps and every block comes back.
    for _ in range(2000):
        if not scheduler.has_unfinished():
            if not handed_back:
                break
            resumed = handed_back.pop()  # what the Redis worker does with a preempted job
            scheduler.add(resumed)
        step(7)
    assert not scheduler.has_unfinished() and not handed_back, "the scheduler made no progress"
    assert scheduler.block_manager.num_free_blocks == num_blocks
    check_block_accounting(scheduler)
    for seq in seqs:
        if seq.status is SequenceStatus.FINISHED and seq.finish_reason is not FinishReason.CANCELED:
            assert seq.num_output_tokens <= seq.params.max_tokens
            assert seq.num_tokens <= max_model_len


def test_a_cached_prompt_prefix_is_not_computed_again() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    first = make_seq("first", num_prompt_tokens=10, max_tokens=1)
    scheduler.add(first)
    fake_step(scheduler)
    second = make_seq("second", num_prompt_tokens=11, max_tokens=2)  # same first 10 tokens
    scheduler.add(second)
    out, _ = fake_step(scheduler)
    assert out.num_cached_tokens == 8 and out.num_computed_tokens == [8]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)  # usage's cached_tokens
    assert out.num_scheduled_tokens == [3] and out.is_sampling == [True]
    assert scheduler.block_manager.block_table("second")[:2] == [0, 1]
    check_block_accounting(scheduler)


def test_a_preempted_sequence_resumes_from_its_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a, b = make_seq("a", 3, max_tokens=8), make_seq("b", 2, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)
    fake_step(scheduler)  # a: 4 computed (2 blocks), b: 3 computed (2 blocks): the pool is full
    out, _ = fake_step(scheduler)
    assert out.preempted == [b]
    scheduler.abort("a")
    out, _ = fake_step(scheduler)
    assert out.seqs == [b] and out.num_cached_tokens == 2 and out.num_scheduled_tokens == [2]
    assert b.num_cached_tokens == 2  # its whole 2-token prompt (a resumed hit counts the prompt only)
    check_block_accounting(scheduler)


def test_scheduler_is_constructible_from_the_builders() -> None:
    assert isinstance(make_scheduler(), Scheduler)
