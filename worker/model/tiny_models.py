"""Tiny random models built from a config, for fast tests and local experiments.

They borrow the bundled SmolLM2 tokenizer (and so its vocabulary and chat template), so that
text, stop strings and chat prompts behave as with the real model while a forward pass costs
microseconds. Random weights make outputs meaningless but deterministic for a given seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from worker.model.loader import DEFAULT_CACHE_DIR, resolve_model_dir

TINY_ARCHITECTURES = ("llama", "qwen2")


def build_tiny_model(
    directory: Path,
    architecture: str = "llama",
    seed: int = 0,
    tokenizer_source: str = "smollm2",
    cache_dir: Path = DEFAULT_CACHE_DIR,
) -> Path:
    """Write a tiny random causal LM (config, safetensors, tokenizer) to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tokenizer_dir = resolve_model_dir(tokenizer_source, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied and a wider init than the default 0.02: random tied weights collapse onto one
        # repeated token, which would let a broken engine pass an equality test.
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    if architecture == "llama":
        config = LlamaConfig(head_dim=16, **common)
    elif architecture == "qwen2":
        config = Qwen2Config(**common)  # Qwen2 adds biases on q/k/v: a second code path
    else:
        raise ValueError(f"unknown tiny architecture {architecture!r}; use one of {TINY_ARCHITECTURES}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    template = tokenizer_dir / "chat_template.jinja"
    if template.is_file():
        shutil.copy(template, directory / "chat_template.jinja")
    return directory
