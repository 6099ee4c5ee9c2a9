"""The Hugging Face side of the worker: loading, device/dtype/kernel routing, the paged attention
backend, linear and fused layers. Knows no scheduling and no Redis."""

from worker.model.loader import LoadedModel, ModelLoadError, load_model, resolve_model_dir

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_model_dir"]
