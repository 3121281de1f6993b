"""Shared fixtures: tiny seeded models per family, the real stories260K model when ../shared is present, the
backend under test (``backend_name``, torch and mlx), and the ``mlx`` marker's skip."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))

from backends_under_test import BACKENDS, MLX_MISSING, mlx_importable  # noqa: E402
from model_factory import FAMILIES, build_tiny_model  # noqa: E402

REPO_ROOT = TESTS_DIR.parent
STORIES_DIR = REPO_ROOT.parent / "shared" / "models" / "stories260K"


def pytest_report_header(config) -> str:
    """The CPU class this run tests on: CPU-feature tests skip, and kernels dispatch, by it."""
    from tierlm.platforms.cpu_features import this_cpu

    cpu = this_cpu().to_dict()
    cap = f", capped by TIERLM_CPU_ISA={cpu['cap']}" if cpu["cap"] else ""
    return (f"tierlm CPU: {cpu['model_name'] or cpu['arch']}, level {cpu['level']}{cap}, native bf16 "
            f"{cpu['native_bf16'] or 'none'}, oneDNN bf16 prepacking {'yes' if cpu['onednn_bf16_prepack'] else 'no'}")


@pytest.fixture(autouse=True)
def _torch_threads_kept() -> Iterator[None]:
    """A torch backend sets torch's thread count for the whole process when it loads (backends/torch/cpu/threads.py,
    as a server should): every test ends with the count it began with."""
    if "torch" not in sys.modules:  # a test that never imports torch changes no thread count
        yield
        return
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch computes with ``n`` intra-op threads inside the block."""
    import torch

    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_model(request, tiny_models_root) -> Path:
    """A seeded random model folder of each family (llama, qwen2, qwen3, mistral)."""
    return build_tiny_model(request.param, tiny_models_root / request.param)


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_root) -> Path:
    return build_tiny_model("llama", tiny_models_root / "llama")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES_DIR / "config.json").exists():
        pytest.skip(f"real test model not found at {STORIES_DIR} (../shared/models is absent)")
    return STORIES_DIR


# From ../shared/models/README.md: llama2.c run.c at temperature 0 and transformers greedy agree on these.
STORIES_PROMPT = "Once upon a time"
STORIES_FIRST_40 = [int(x) for x in (
    "432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292 "
    "411 322 265 282 295 433 426 385 328 432 358 394 261 370 432 352 266 268 388 426").split()]
STORIES_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. "
                "One day, she saw a big, red ball.")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The ``mlx`` marker means "needs MLX": such tests are skipped, with one reason, where mlx does not import
    and under TIERLM_TEST_DEVICE=cuda (the GPU check runs the torch backend only)."""
    if os.environ.get("TIERLM_TEST_DEVICE", "").strip().lower() == "cuda":
        reason = "TIERLM_TEST_DEVICE=cuda: the MLX backend does not run on CUDA"
    elif not mlx_importable():
        reason = MLX_MISSING
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("mlx") is not None:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def backend_name(request) -> str:
    """Runs a test once per backend ("torch", "mlx"); pass it to make_backend or start_engine."""
    return request.param


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """The L3 folder a server started in this test uses (SGLang's env var); test files of the storage layer
    itself define their own ``store`` (a FileKVStorage)."""
    d = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(d))
    return d
