"""allowed_token_ids and bad_words in LogitsProcessing: the exact logits they leave, against vLLM's
rules (v1/sample/sampler.py's order; ops/bad_words.py's matching against the output only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.generation import SamplingParams
from worker.engine.logits_processing import LogitsProcessing
from worker.engine.sampler import Sampler, SamplingMetadata

VOCAB = 10
INF = float("-inf")


def base_logits(num_rows: int) -> torch.Tensor:
    # Distinct values, row by row, so that any cell moved or missed shows.
    return torch.arange(num_rows * VOCAB, dtype=torch.float32).reshape(num_rows, VOCAB) / 10


def processed(params: list[SamplingParams], token_ids: list[list[int]], num_prompt_tokens: list[int],
              bad_words: Sequence[Sequence[tuple[int, ...]]] = (),
              eos: frozenset[int] = frozenset()) -> torch.Tensor:
    output_indices = [len(t) - n for t, n in zip(token_ids, num_prompt_tokens)]
    processing = LogitsProcessing.build(params, output_indices, token_ids, num_prompt_tokens, eos,
                                        VOCAB, bad_words_token_ids=bad_words)
    assert processing is not None
    return processing.apply(base_logits(len(params)))


def masked(row: torch.Tensor, banned: Sequence[int] = (), kept: Sequence[int] | None = None) -> list[float]:
    """`row` with `banned` at -inf, or (kept given) everything but `kept` at -inf."""
    values = row.tolist()
    if kept is not None:
        banned = [i for i in range(VOCAB) if i not in kept]
    return [INF if i in banned else v for i, v in enumerate(values)]


def test_allowed_token_ids_leave_only_those_logits_in_their_own_rows() -> None:
    params = [SamplingParams(), SamplingParams(allowed_token_ids=(2, 5, 5)),
              SamplingParams(allowed_token_ids=(0, 9))]
    got = processed(params, [[1]] * 3, [1] * 3)
    want = base_logits(3)
    assert got[0].tolist() == want[0].tolist()  # a row without a whitelist is untouched
    assert got[1].tolist() == masked(want[1], kept=(2, 5))
    assert got[2].tolist() == masked(want[2], kept=(0, 9))


def test_allowed_mask_comes_before_bias_min_tokens_and_penalties() -> None:
    """vLLM's order: a bias cannot revive a token the whitelist removed; min_tokens still bans an
    allowed EOS; the bias and a penalty apply to the allowed tokens as usual."""
    params = [SamplingParams(allowed_token_ids=(1, 3, 4), logit_bias=((1, 2.0), (7, 100.0)),
                             min_tokens=2, presence_penalty=0.5)]
    got = processed(params, [[8, 3]], [1], eos=frozenset({4}))  # output [3]: index 1 < min_tokens
    want = base_logits(1)[0]
    want[1] += 2.0  # the bias
    want[3] -= 0.5  # the presence penalty: 3 is in the output
    assert got[0].tolist() == masked(want, kept=(1, 3))  # 4 (EOS) allowed but held off; 7 never


def test_a_one_token_bad_word_is_always_banned() -> None:
    params = [SamplingParams(bad_words=("x",))]
    for token_ids, num_prompt in (([5], 1), ([5, 6, 7], 1)):  # first token, and later
        got = processed(params, [token_ids], [num_prompt], bad_words=[((4,),)])
        assert got[0].tolist() == masked(base_logits(1)[0], banned=(4,))


def test_a_multi_token_bad_word_bans_its_last_token_after_its_prefix_in_the_output() -> None:
    words = ((2, 3, 6), (3, 8))
    params = [SamplingParams(bad_words=("w",))] * 5
    rows = [
        ([1, 2, 3], 1),  # output [2, 3] ends with (2, 3) and with (3,): 6 and 8 banned
        ([1, 9, 3], 1),  # output [9, 3] ends with (3,) only: 8 banned
        ([2, 3], 2),  # the prompt ends with (2, 3), the output is empty: nothing (prompt never counts)
        ([1, 2, 3], 2),  # (2, 3) spans prompt and output: only (3,) counts, 8 banned
        ([1, 2, 3, 5], 1),  # the output moved past the prefix: nothing
    ]
    got = processed(params, [r[0] for r in rows], [r[1] for r in rows], bad_words=[words] * 5)
    want = base_logits(5)
    assert got[0].tolist() == masked(want[0], banned=(6, 8))
    assert got[1].tolist() == masked(want[1], banned=(8,))
    assert got[2].tolist() == want[2].tolist()
    assert got[3].tolist() == masked(want[3], banned=(8,))
    assert got[4].tolist() == want[4].tolist()


def test_bad_words_touch_only_their_own_rows_and_combine_with_the_whitelist() -> None:
    params = [SamplingParams(), SamplingParams(bad_words=("w",), allowed_token_ids=(4, 5, 6))]
    got = processed(params, [[4, 5], [4, 5]], [1, 1], bad_words=[(), ((5, 6), (2,))])
    want = base_logits(2)
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == masked(want[1], kept=(4, 5))  # 6 follows 5: banned; 2 never allowed


def test_the_sampler_passes_bad_words_through_and_greedy_avoids_them() -> None:
    logits = base_logits(1)  # the greedy pick is 9, the last id
    params = [SamplingParams(temperature=0.0, bad_words=("w",))]
    metadata = SamplingMetadata.build(params, [0], [1], VOCAB, token_ids=[[1, 7]], num_prompt_tokens=[1],
                                      bad_words_token_ids=[((7, 9), (8,))])
    assert Sampler().sample(logits, metadata).tolist() == [7]  # 9 follows 7, 8 is banned outright
    allowed = [SamplingParams(temperature=0.0, allowed_token_ids=(3, 1))]
    assert Sampler().sample(base_logits(1), SamplingMetadata.build(allowed, [0], [0], VOCAB)).tolist() == [3]
