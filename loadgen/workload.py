"""The benchmark workload: chat requests with long-tailed prompt and output lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUESTIONS = (
    "What is 2+2?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "List five tips for staying focused while studying.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Describe how a bicycle works.",
    "What are the benefits of regular exercise?",
    "Write an email asking a colleague for feedback on a report.",
    "Explain recursion to a ten year old.",
    "What causes the seasons on Earth?",
)


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    messages: list[dict[str, str]]
    max_tokens: int  # generated exactly (ignore_eos), so every system does the same work


def build_workload(num_requests: int, seed: int = 0, max_output: int = 256) -> list[WorkloadItem]:
    """Most answers short, a few long: output lengths from a lognormal clipped to [8, max_output].

    Prompts vary too: a question, sometimes with extra context sentences before it.
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=3.3, sigma=0.9, size=num_requests), 8, max_output)
    items = []
    for i in range(num_requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        context = " ".join(QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(1, int(rng.integers(0, 6)) + 1))
        content = f"Some context: {context}\n{question}" if context else question
        items.append(WorkloadItem(messages=[{"role": "user", "content": content}],
                                  max_tokens=int(lengths[i])))
    return items
