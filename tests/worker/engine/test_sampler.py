from __future__ import annotations

import pytest
import torch

from protocol.generation import SamplingParams
from worker.engine.sampler import Sampler, SamplingMetadata, uniform_from_seed

VOCAB = 64


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> list[int]:
    metadata = SamplingMetadata.build(params, seeds, indices, logits.shape[-1])
    return Sampler().sample(logits, metadata).tolist()


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_uniforms_depend_on_seed_and_index_only() -> None:
    values = [uniform_from_seed(seed, index) for seed in range(50) for index in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert uniform_from_seed(7, 3) == uniform_from_seed(7, 3)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_greedy_is_argmax() -> None:
    logits = random_logits(5)
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy] * 5, [0] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = random_logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    tokens = sample(logits, params, [1, 2, 3, 4], [0] * 4)
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()


def test_top_k_1_and_a_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(32, seed=1)
    greedy = logits.argmax(-1).tolist()
    seeds, indices = list(range(32)), list(range(32))
    assert sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 32, seeds, indices) == greedy
    assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 32, seeds, indices) == greedy


def test_seeded_rows_do_not_depend_on_their_companions() -> None:
    logits = random_logits(6, seed=2)
    params = [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
        SamplingParams(temperature=1.0),
    ]
    seeds, indices = [11, 5, 6, 7, 8, 9], [4, 0, 1, 2, 3, 4]
    together = sample(logits, params, seeds, indices)
    for row in range(6):
        alone = sample(logits[row : row + 1], [params[row]], [seeds[row]], [indices[row]])
        assert alone == [together[row]], row


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    # One row per draw: the same distribution, told apart only by the output index.
    tokens = sample(logits.expand(draws, -1).contiguous(), [params] * draws, [42] * draws, list(range(draws)))
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / draws


def test_temperature_sampling_frequencies_match_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    for temperature in (1.0, 0.5, 2.0):
        observed = _frequencies(logits, SamplingParams(temperature=temperature), draws=40_000)
        expected = torch.softmax(logits[0].double() / temperature, dim=-1)
        assert (observed - expected).abs().max().item() < 0.01, temperature


def test_top_k_and_top_p_restrict_and_renormalise() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    observed = _frequencies(logits, SamplingParams(top_k=3), draws=30_000)
    kept = torch.tensor([0, 1, 6])
    expected = torch.zeros(8, dtype=torch.float64)
    expected[kept] = torch.softmax(logits[0, kept].double(), dim=-1)
    assert (observed - expected).abs().max().item() < 0.01
    probs = torch.softmax(logits[0].double(), dim=-1)  # sorted: 0 (.39), 6 (.24), 1 (.14), ...
    observed = _frequencies(logits, SamplingParams(top_p=0.6), draws=30_000)
    kept = torch.tensor([0, 6])  # .39 < 0.6 so 6 is still needed; .39 + .24 covers 0.6
    expected = torch.zeros(8, dtype=torch.float64)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert (observed - expected).abs().max().item() < 0.01


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 17] = 0.0
    logits[0, 40] = 0.0
    tokens = set(sample(logits.expand(500, -1).contiguous(), [SamplingParams()] * 500, [1] * 500, list(range(500))))
    assert tokens == {17, 40}


@pytest.mark.parametrize("vocab", [2, 49152])
def test_top_k_past_the_vocabulary_is_no_filter(vocab: int) -> None:
    logits = random_logits(3, vocab=vocab)
    params = [SamplingParams(top_k=vocab + 10, seed=1)] * 3
    unfiltered = [SamplingParams(seed=1)] * 3
    assert sample(logits, params, [1, 2, 3], [0, 0, 0]) == sample(logits, unfiltered, [1, 2, 3], [0, 0, 0])


def test_sampling_params_validation() -> None:
    cases = [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an int"),
        ({"temperature": -0.1}, "temperature must be at least 0.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0.0, 1.0\]"),
        ({"top_k": -1}, "top_k must be at least 0"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": "1"}, "seed must be an int"),
        ({"stop": "END"}, "stop must be a tuple of strings"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
        ({"stop": ("x" * 300,)}, "at most 256 characters"),
        ({"stop": tuple("abcdefghijklmnopq")}, "at most 16 strings"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).is_greedy


def test_greedy_takes_the_first_of_tied_maxima_like_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    params = [SamplingParams(temperature=0.0)] * 3
    metadata = SamplingMetadata.build(params, [0, 0, 0], [0, 0, 0], vocab_size=4)
    assert Sampler().sample(logits, metadata).tolist() == [1, 0, 0] == logits.argmax(dim=-1).tolist()


def test_a_batch_without_processing_builds_none_of_it() -> None:
    """Cheap when unused: no penalties, bias, min_tokens, min_p or logprobs, no tensors for them."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, seed=1)]
    metadata = SamplingMetadata.build(params, [1, 2], [0, 0], VOCAB, token_ids=[[1, 2], [3]],
                                      num_prompt_tokens=[1, 1], eos_token_ids=frozenset({0}))
    assert metadata.processing is None and metadata.logprobs is None and metadata.min_p is None


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    params = SamplingParams(temperature=1.0, min_p=0.35)  # keeps p >= 0.175: tokens 0 and 1
    metadata = SamplingMetadata.build([params], [0], [0], 4)
    kept = Sampler().probabilities(logits, metadata)
    assert kept[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    draws = {sample(logits, [params], [seed], [0])[0] for seed in range(200)}
    assert draws == {0, 1}


def test_processing_touches_only_its_own_rows() -> None:
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,))]
    logits[2, 7] = 50.0  # the stop token would win: min_tokens masks it (and EOS, id 0)
    metadata = SamplingMetadata.build(params, [0] * 3, [0, 0, 1], VOCAB, token_ids=[[1], [1], [1]],
                                      num_prompt_tokens=[1, 1, 1], eos_token_ids=frozenset({0}))
    expected_row2 = logits[2].clone()
    expected_row2[[0, 7]] = float("-inf")
    tokens = Sampler().sample(logits.clone(), metadata).tolist()
    assert tokens == [logits[0].argmax().item(), 5, expected_row2.argmax().item()]


def test_typical_p_keeps_the_tokens_nearest_the_entropy_not_the_likeliest() -> None:
    # Entropy 1.142 nats; surprises 0.69, 1.20, 1.90, 3.00: token 1 is the most typical, then 0.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    narrow = SamplingParams(temperature=1.0, typical_p=0.2)  # token 1's 0.3 covers it alone
    kept = Sampler().probabilities(logits, SamplingMetadata.build([narrow], [0], [0], 4))
    assert kept[0].tolist() == pytest.approx([0.0, 0.3, 0.0, 0.0])  # (drawn from, not renormalised)
    assert {sample(logits, [narrow], [seed], [0])[0] for seed in range(100)} == {1}
    wider = SamplingParams(temperature=1.0, typical_p=0.5)  # 0.3 < 0.5: token 0 joins
    kept = Sampler().probabilities(logits, SamplingMetadata.build([wider], [0], [0], 4))
    assert (kept[0] / kept[0].sum()).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_typical_p_keeps_what_transformers_typical_warper_keeps() -> None:
    from transformers.generation.logits_process import TypicalLogitsWarper

    logits = random_logits(6, seed=3)
    masses = [0.2, 0.5, 0.9, 0.95, 0.3, 0.7]
    params = [SamplingParams(temperature=1.0, typical_p=mass) for mass in masses]
    kept = Sampler().probabilities(logits, SamplingMetadata.build(params, [0] * 6, [0] * 6, VOCAB)) > 0
    for row, mass in enumerate(masses):
        theirs = TypicalLogitsWarper(mass)(torch.zeros(1, 1, dtype=torch.long), logits[row:row + 1])
        assert kept[row].tolist() == torch.isfinite(theirs[0]).tolist(), mass


def test_typical_p_leaves_greedy_and_other_rows_alone() -> None:
    logits = random_logits(3, seed=5)
    params = [SamplingParams(temperature=0.0, typical_p=0.2), SamplingParams(seed=4),
              SamplingParams(typical_p=0.2, seed=4)]
    plain = SamplingMetadata.build(params[:2], [4, 4], [0, 0], VOCAB)
    mixed = SamplingMetadata.build(params, [4, 4, 4], [0, 0, 0], VOCAB)
    assert Sampler().probabilities(logits[:2], plain).tolist() == Sampler().probabilities(logits, mixed)[:2].tolist()
    assert sample(logits, params, [4, 4, 4], [0, 0, 0])[0] == logits[0].argmax().item()


def test_the_logprobs_mode_is_a_worker_setting() -> None:
    from pydantic import ValidationError

    from worker.__main__ import _parser
    from worker.engine.config import EngineConfig, LogprobsMode
    from worker.jobs.settings import WorkerSettings

    assert WorkerSettings(model="synthetic").engine_config().logprobs_mode is LogprobsMode.RAW
    args = vars(_parser().parse_args(["--logprobs-mode", "processed_logprobs"]))
    chosen = WorkerSettings(model="synthetic", logprobs_mode=args["logprobs_mode"])
    assert chosen.engine_config().logprobs_mode is LogprobsMode.PROCESSED
    with pytest.raises(ValidationError, match="raw_logprobs"):
        WorkerSettings(model="synthetic", logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineConfig(logprobs_mode="raw_logits")
