#!/usr/bin/env python3
"""Build the standard Carpool benchmark workload (offline batch generation).

The workload is a JSON list of requests::

    [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...]

* Prompts and output lengths: loadgen/workload.py (the one definition every
  benchmark shares). The model's chat template is applied with
  ``apply_chat_template(add_generation_prompt=True)`` and the result is
  tokenized (token ids are stored, so any engine sees exactly the same input).
* Seed 0, 128 requests: median 40 output tokens, 2 clipped at 256, 7595
  output tokens in total. Engines must run with ``ignore_eos``.

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadgen.workload import build_workload as build_chat_workload  # noqa: E402  (the one definition)

DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/carpool/models/smollm2")


def build_workload(num_requests: int = 128, seed: int = 0,
                   model_dir: str = DEFAULT_MODEL_DIR) -> list[dict]:
    """Return ``[{"prompt_token_ids": [...], "max_tokens": N}, ...]``.

    Deterministic for a given (num_requests, seed, tokenizer).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out = []
    for item in build_chat_workload(num_requests, seed):
        max_tokens = item.max_tokens
        ids = tok.apply_chat_template(
            item.messages,
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
