"""The backends the tests run on: their parameter list (MLX marked ``mlx``), whether MLX imports here, and one
factory that loads a backend by name (cached, so a module's tests load each model once)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from backend_driver import device_under_test

from tierlm.backends.base import ModelBackend

# Why an ``mlx``-marked test is skipped here (conftest's collection hook applies it).
MLX_MISSING = "mlx cannot be imported here (pip install 'mlx[cpu]' mlx-lm on Linux)"


@functools.cache
def mlx_importable() -> bool:
    """mlx and mlx-lm (the MLX backend loads models with it) both import."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - ImportError, or a broken native library
        return False


BACKEND_NAMES = ("torch", "mlx")


def backend_params(names=BACKEND_NAMES) -> list:
    """Parametrize values for backend names; MLX carries the ``mlx`` marker (skipped where it cannot run)."""
    return [pytest.param(n, marks=pytest.mark.mlx) if n == "mlx" else n for n in names]


BACKENDS = backend_params()

_LOADED: dict[tuple, ModelBackend] = {}


def make_backend(name: str, model_dir: Path, dtype: str = "float32", kv_cache_dtype: str = "auto",
                 device: str | None = None, cached: bool = True) -> ModelBackend:
    """A loaded ``name`` backend ("torch" | "mlx") over ``model_dir``; torch runs on ``device`` (default: the
    device under test). Cached per arguments unless ``cached`` is False (drivers re-initialise the KV pool)."""
    key = (name, str(model_dir), dtype, kv_cache_dtype, device)
    if cached and key in _LOADED:
        return _LOADED[key]
    if name == "mlx":
        from tierlm.backends.mlx.backend import MLXBackend

        backend: ModelBackend = MLXBackend(model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    else:
        from tierlm.backends.torch.backend import TorchBackend

        backend = TorchBackend(model_dir, dtype=dtype, device=device or device_under_test(),
                               kv_cache_dtype=kv_cache_dtype)
    if cached:
        _LOADED[key] = backend
    return backend
