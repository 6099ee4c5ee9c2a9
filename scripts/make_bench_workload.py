#!/usr/bin/env python3
"""Build the standard Carpool benchmark workload (offline batch generation).

The workload is a JSON list of requests::

    [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...]

* Prompts: short chat requests. A fixed list of realistic user questions and
  instructions is cycled; from the second pass on each prompt gets a small
  variation (a suffix such as "Keep it brief."), so the token sequences are
  not all identical but the prompt-length distribution stays short and
  realistic. The model's chat template is applied with
  ``apply_chat_template(add_generation_prompt=True)`` and the result is
  tokenized (token ids are stored, so any engine sees exactly the same input).
* Output lengths: long-tailed. ``numpy.random.default_rng(seed).lognormal(
  mean=LOGNORMAL_MEAN, sigma=LOGNORMAL_SIGMA)`` rounded and clipped to
  ``[MIN_TOKENS, MAX_TOKENS]`` = [8, 256]; most requests are short and a few
  reach 256 (seed 0, 128 requests: median 40, 57 requests <= 32, 2 clipped
  at 256, 7595 output tokens in total). Engines must run with ``ignore_eos``
  so the totals are comparable.

Dependencies: numpy and transformers (tokenizer only, ``local_files_only``).
Runs with the Carpool venv::

    /work/main/.venv/bin/python scripts/make_bench_workload.py --out W.json \
        [--num-requests 128] [--seed 0] [--model /root/.cache/carpool/models/smollm2]

Library use (the engine benchmark reuses this)::

    from make_bench_workload import build_workload
    reqs = build_workload(128, 0)   # -> list[dict]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

DEFAULT_MODEL_DIR = "/root/.cache/carpool/models/smollm2"
MIN_TOKENS = 8
MAX_TOKENS = 256
LOGNORMAL_MEAN = 3.6  # exp(3.6) ~ 37 tokens median before clipping
LOGNORMAL_SIGMA = 1.0

BASE_PROMPTS = [
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
]

VARIATIONS = [
    "",
    " Keep it brief.",
    " Please answer in detail.",
    " Explain it step by step.",
    " Use simple words.",
    " Answer in one paragraph.",
    " Give an example.",
]


def _prompt_texts(num_requests: int) -> list[str]:
    """Cycle BASE_PROMPTS; pass k (k >= 1) appends VARIATIONS[k % len]."""
    texts = []
    n = len(BASE_PROMPTS)
    for i in range(num_requests):
        k = i // n
        suffix = VARIATIONS[k % len(VARIATIONS)] if k > 0 else ""
        texts.append(BASE_PROMPTS[i % n] + suffix)
    return texts


def output_lengths(num_requests: int, seed: int = 0) -> list[int]:
    """Seeded long-tailed output lengths in [MIN_TOKENS, MAX_TOKENS]."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=LOGNORMAL_MEAN, sigma=LOGNORMAL_SIGMA, size=num_requests)
    return [int(x) for x in np.clip(np.rint(raw), MIN_TOKENS, MAX_TOKENS)]


def build_workload(num_requests: int = 128, seed: int = 0,
                   model_dir: str = DEFAULT_MODEL_DIR) -> list[dict]:
    """Return ``[{"prompt_token_ids": [...], "max_tokens": N}, ...]``.

    Deterministic for a given (num_requests, seed, tokenizer).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    lengths = output_lengths(num_requests, seed)
    out = []
    for text, max_tokens in zip(_prompt_texts(num_requests), lengths):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
        )
        # transformers 5 may return a BatchEncoding/dict instead of a list.
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        out.append({"prompt_token_ids": [int(t) for t in ids], "max_tokens": max_tokens})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR, help="tokenizer dir")
    args = ap.parse_args(argv)

    reqs = build_workload(args.num_requests, args.seed, args.model)
    with open(args.out, "w") as f:
        json.dump(reqs, f)
    plens = [len(r["prompt_token_ids"]) for r in reqs]
    olens = [r["max_tokens"] for r in reqs]
    print(
        f"wrote {len(reqs)} requests to {args.out}: prompt tokens "
        f"min/mean/max {min(plens)}/{sum(plens) / len(plens):.1f}/{max(plens)}, "
        f"output tokens min/median/max {min(olens)}/{int(np.median(olens))}/{max(olens)}, "
        f"total output {sum(olens)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
