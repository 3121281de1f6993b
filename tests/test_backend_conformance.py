"""One conformance suite, run on every backend: greedy output equals transformers' float32 reference token for
token (tiny families, stories260K), whatever the batch mix, chunking and page size; page copies to the host
tier and back are lossless."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from backend_driver import GreedyDriver, run_greedy
from backends_under_test import make_backend
from conftest import STORIES_FIRST_40, STORIES_PROMPT
from model_factory import build_tiny_model, reference_greedy

from tierlm.backends.base import HostKVPool, ModelBackend

NEW_TOKENS = 64


def prompts_of(model_dir: Path, lengths, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts over the model's vocabulary (ids 0-2 are special: left out)."""
    vocab = _config(model_dir)["vocab_size"]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def test_mixed_batch_matches_reference_on_every_family(backend_name, tiny_model):
    """Prompts of 1..33 tokens, joining one step apart, prefilled in 5-token chunks next to decodes."""
    backend = make_backend(backend_name, tiny_model)
    prompts = prompts_of(tiny_model, [1, 7, 33, 20])
    drivers: list[GreedyDriver] = []
    outputs = run_greedy(backend, prompts, NEW_TOKENS, page_size=4, chunk_size=5, driver_out=drivers)
    # The schedule really mixed prefill chunks with other requests' decode tokens in one forward.
    assert any(1 in shape and max(shape) > 1 for shape in drivers[0].batch_shapes)
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(tiny_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("page_size,chunk_size", [(1, 3), (4, 7), (16, 13), (16, None)])
def test_page_sizes_and_chunk_boundaries(backend_name, tiny_llama, page_size, chunk_size):
    """Chunks that straddle page boundaries, pages of one token and pages longer than a chunk."""
    backend = make_backend(backend_name, tiny_llama)
    prompts = prompts_of(tiny_llama, [29, 2, 17], seed=page_size)
    outputs = run_greedy(backend, prompts, 40, page_size=page_size, chunk_size=chunk_size, stagger=2)
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(tiny_llama, prompt, 40)


def test_requests_are_isolated_in_one_batch(backend_name, tiny_llama):
    """All requests start together (no stagger): identical prompts agree, different ones match alone."""
    backend = make_backend(backend_name, tiny_llama)
    prompts = prompts_of(tiny_llama, [9, 9, 30])
    prompts[1] = list(prompts[0])
    outputs = run_greedy(backend, prompts, 24, page_size=4, chunk_size=None, stagger=0)
    assert outputs[0] == outputs[1] == reference_greedy(tiny_llama, prompts[0], 24)
    assert outputs[2] == reference_greedy(tiny_llama, prompts[2], 24)


def test_greedy_rows_stay_exact_next_to_sampled_rows(backend_name, tiny_llama):
    """A seeded sampled request shares every forward with greedy ones: the greedy ones still match the
    reference, and the sampled one repeats its tokens when run again in a different batch mix."""
    backend = make_backend(backend_name, tiny_llama)
    prompts = prompts_of(tiny_llama, [6, 15, 6], seed=9)

    def run(order: list[int]) -> dict[int, list[int]]:
        driver = GreedyDriver(backend, page_size=4, num_pages=60, chunk_size=4)
        reqs, first = {}, 0
        for step, i in enumerate(order):
            n = driver.pages_needed(len(prompts[i]), 24)
            sampling = {"temperature": 1.0, "seed": 1234} if i == 1 else {}
            reqs[i] = driver.add(prompts[i], 24, list(range(first, first + n)), start_step=step, **sampling)
            first += n
        driver.run()
        return {i: r.output for i, r in reqs.items()}

    a, b = run([0, 1, 2]), run([1, 2])
    assert a[0] == reference_greedy(tiny_llama, prompts[0], 24)
    assert a[2] == b[2] == reference_greedy(tiny_llama, prompts[2], 24)
    assert a[1] == b[1]
    assert a[1] != reference_greedy(tiny_llama, prompts[1], 24)  # temperature 1 on random weights: not the argmax path


def _variant(root: Path, family: str, name: str, **config_changes) -> Path:
    """A copy of a tiny family model with some config.json entries changed (same weights)."""
    folder = root / name
    if not folder.exists():
        shutil.copytree(build_tiny_model(family, root / family), folder)
        config = _config(folder)
        for key, value in config_changes.items():
            config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def windowed_mistral(tiny_models_root) -> Path:
    """The tiny mistral with a 5-token sliding window, which transformers applies on every layer."""
    return _variant(tiny_models_root, "mistral", "mistral_window5", sliding_window=5)


@pytest.fixture(scope="module")
def llama_theta_5e5(tiny_models_root) -> Path:
    """The tiny llama with rope_theta 500000, written the transformers-5 way (nested in rope_parameters)."""
    return _variant(tiny_models_root, "llama", "llama_theta_5e5",
                    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})


def test_rope_theta_from_rope_parameters(backend_name, llama_theta_5e5):
    backend = make_backend(backend_name, llama_theta_5e5)
    prompt = prompts_of(llama_theta_5e5, [30], seed=11)[0]
    assert run_greedy(backend, [prompt], 40, page_size=4, chunk_size=8)[0] == reference_greedy(llama_theta_5e5, prompt, 40)


def test_sliding_window_matches_reference(backend_name, windowed_mistral):
    backend = make_backend(backend_name, windowed_mistral)
    assert backend.info.sliding_window == 5
    prompts = prompts_of(windowed_mistral, [12, 3], seed=5)
    outputs = run_greedy(backend, prompts, 40, page_size=4, chunk_size=7)
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(windowed_mistral, prompt, 40)


def test_stories260k_greedy_text(backend_name, stories_dir):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(stories_dir)(STORIES_PROMPT).input_ids
    backend = make_backend(backend_name, stories_dir)
    out = run_greedy(backend, [prompt, prompt[:2]], 40, page_size=16, chunk_size=3)
    assert out[0] == STORIES_FIRST_40
    assert out[1] == reference_greedy(stories_dir, prompt[:2], 40)


def _host_pool(backend: ModelBackend, page_size: int, num_pages: int, layout: str) -> HostKVPool:
    return HostKVPool(num_pages=num_pages, page_bytes=backend.kv_bytes_per_token() * page_size,
                      num_layers=backend.info.num_layers, layout=layout)


def _decode_until(driver: GreedyDriver, req, n: int) -> None:
    while len(req.output) < n:
        driver.step()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_survive_a_round_trip_through_the_host_tier(backend_name, tiny_llama, layout):
    """Decode a while, copy the request's pages to the host (and through L3-style bytes into a pool of the
    other layout), load them into *different* device pages, continue there: the output is unchanged."""
    backend = make_backend(backend_name, tiny_llama)
    page_size, prompt = 4, prompts_of(tiny_llama, [13], seed=3)[0]
    driver = GreedyDriver(backend, page_size, num_pages=40, chunk_size=6)
    n_pages = driver.pages_needed(len(prompt), NEW_TOKENS)
    req = driver.add(prompt, NEW_TOKENS, pages=list(range(n_pages)))
    _decode_until(driver, req, 10)
    used = -(-req.kv_len // page_size)  # the last page is partly filled: it must move too

    host = _host_pool(backend, page_size, 16, layout)
    host_pages = np.arange(5, 5 + used)
    backend.copy_pages_to_host(np.arange(used), host, host_pages)
    other = _host_pool(backend, page_size, 16, "layer_first" if layout == "page_first" else "page_first")
    other_pages = host_pages[::-1] + 1
    for src, dst in zip(host_pages, other_pages):
        other.page_from_bytes(int(dst), host.page_to_bytes(int(src)))

    new_pages = list(range(20, 20 + n_pages))  # never written: zeros unless the copy lands
    backend.copy_pages_from_host(other, other_pages, np.array(new_pages[:used]))
    req.pages = new_pages
    driver.run()
    assert req.output == reference_greedy(tiny_llama, prompt, NEW_TOKENS)


def test_copy_to_host_is_byte_exact_in_bfloat16(backend_name, tiny_llama):
    """bfloat16 pages travel as their raw 2-byte values: device -> host -> device -> host is the identity."""
    backend = make_backend(backend_name, tiny_llama, dtype="bfloat16")
    info = backend.info
    assert info.dtype == "bfloat16"
    assert backend.kv_bytes_per_token() == info.num_layers * 2 * info.num_kv_heads * info.head_dim * 2
    driver = GreedyDriver(backend, page_size=4, num_pages=12)
    driver.add(prompts_of(tiny_llama, [11])[0], 2, pages=[0, 1, 2])
    driver.run()
    first = _host_pool(backend, 4, 6, "page_first")
    backend.copy_pages_to_host(np.array([0, 1, 2]), first, np.array([0, 1, 2]))
    assert np.count_nonzero(first.data[:3]) > 0
    backend.copy_pages_from_host(first, np.array([0, 1, 2]), np.array([9, 10, 11]))
    second = _host_pool(backend, 4, 6, "layer_first")
    backend.copy_pages_to_host(np.array([9, 10, 11]), second, np.array([3, 4, 5]))
    for i in range(3):
        assert second.page_to_bytes(3 + i) == first.page_to_bytes(i)


@pytest.mark.mlx
@pytest.mark.parametrize("writer_name,reader_name", [("torch", "mlx"), ("mlx", "torch")])
def test_pages_written_by_one_backend_continue_on_the_other(tiny_llama, writer_name, reader_name):
    """Both pools store post-RoPE K/V as [layer, K/V, token, head, dim] float32: a page one backend wrote
    continues on the other with the reference output (what a shared L3 namespace would rely on)."""
    writer, reader = make_backend(writer_name, tiny_llama), make_backend(reader_name, tiny_llama)
    page_size, prompt = 4, prompts_of(tiny_llama, [10], seed=7)[0]
    first = GreedyDriver(writer, page_size, num_pages=24)
    n_pages = first.pages_needed(len(prompt), 32)
    req = first.add(prompt, 32, pages=list(range(n_pages)))
    _decode_until(first, req, 6)
    used = -(-req.kv_len // page_size)
    host = _host_pool(writer, page_size, 8, "page_first")
    assert host.page_bytes == _host_pool(reader, page_size, 8, "page_first").page_bytes
    writer.copy_pages_to_host(np.arange(used), host, np.arange(used))

    second = GreedyDriver(reader, page_size, num_pages=24)
    reader.copy_pages_from_host(host, np.arange(used), np.arange(used))
    second.requests.append(req)  # same request state: prompt, outputs so far, kv_len
    second.run()
    assert req.output == reference_greedy(tiny_llama, prompt, 32)


def test_model_info_and_sizes(backend_name, tiny_model):
    backend = make_backend(backend_name, tiny_model)
    info = backend.info
    config = _config(tiny_model)
    assert info.num_layers == config["num_hidden_layers"] and info.vocab_size == config["vocab_size"]
    assert info.num_kv_heads == config["num_key_value_heads"]
    assert info.head_dim == config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert info.eos_token_ids == [2] and info.dtype == "float32" and len(info.fingerprint) == 64
    assert backend.kv_bytes_per_token() == info.num_layers * 2 * info.num_kv_heads * info.head_dim * 4
    n_params = sum(int(np.prod(v)) for v in _param_shapes(tiny_model).values())
    assert backend.weight_bytes() == 4 * n_params


def test_sizes_read_from_the_folder_match_the_loaded_backend(backend_name, tiny_model):
    """doctor and bench size a model from its folder; the numbers are the ones the backend really uses."""
    from tierlm.backends.model_source.folder_facts import model_size

    backend = make_backend(backend_name, tiny_model)
    size = model_size(tiny_model, "float32")
    assert size.kv_bytes_per_token == backend.kv_bytes_per_token()
    assert size.weight_bytes == backend.weight_bytes()
    assert size.vocab_size == backend.info.vocab_size
    assert model_size(tiny_model, "bfloat16").kv_bytes_per_token * 2 == size.kv_bytes_per_token


def _param_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}
