"""A model directory with a real model's shapes and tokenizer but random weights, for speed runs
where the weights cannot travel (the GPU check's machine is offline, and what travels there is
capped far below SmolLM2's 270 MB).

    python scripts/random_weights_model.py --shape-of smollm2 DIR   # here: config + tokenizer, no weights
    python scripts/random_weights_model.py DIR                      # there: adds seeded random weights

Throughput does not depend on the weights' values when EOS is ignored (every benchmark here does),
so tok/s on such a model is the real model's; its text is noise, and greedy-token comparisons
between systems still hold (they run the same weights).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# The files of a Hugging Face directory that are not weights.
SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def write_shape(source: str, directory: Path) -> None:
    from worker.model.loader import resolve_model_dir

    source_dir = resolve_model_dir(source)
    directory.mkdir(parents=True, exist_ok=True)
    copied = [name for name in SHAPE_FILES if (source_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(source_dir / name, directory / name)
    print(f"wrote {', '.join(copied)} of {source_dir} to {directory}")


def fill_weights(directory: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(directory.glob("*.safetensors")):
        print(f"{directory} has weights already")
        return
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {params / 1e6:.1f} M random parameters (seed {seed}) to {directory}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape-of", default=None,
                        help="a bundled model name or model directory: copy its config and tokenizer only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.shape_of is not None:
        write_shape(args.shape_of, args.directory)
        return 0
    if not (args.directory / "config.json").is_file():
        print(f"{args.directory} has no config.json: write it first with --shape-of", file=sys.stderr)
        return 2
    fill_weights(args.directory, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
