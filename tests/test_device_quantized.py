"""Quantized checkpoints on the device under test (the GPU check's ``quantized`` step runs this file with
TIERLM_TEST_DEVICE=cuda; unset, the CPU): a tiny MXFP4 gpt-oss (experts in the device's default mode: packed on a
GPU, weight_format.mxfp4_experts_mode) and a tiny compressed-tensors FP8-dynamic Llama (transformers' scaled_mm
layers on a GPU with fp8, dequantized elsewhere), each greedy against its reference, with the resident weight
bytes printed next to what `tierlm doctor` counts from the folder. float32, the references' dtype."""
from __future__ import annotations

import os

import pytest
from backend_driver import device_under_test, run_greedy
from model_factory import build_tiny_gpt_oss
from test_gpt_oss import PS, mxfp4_reference, prompts

from tierlm.backends.model_source.folder_facts import weight_bytes
from tierlm.backends.weight_format import mxfp4_experts_mode


def _report(capsys, what: str, backend, doctor_bytes: int) -> None:
    with capsys.disabled():  # into the step's log, not pytest's capture
        print(f"\nRESIDENT {what} on {backend.device}: {backend.weight_bytes()} bytes of weights "
              f"(doctor counts {doctor_bytes}), weight format {backend.info.weight_format}")


def test_mxfp4_gpt_oss_greedy_and_resident_bytes(tiny_models_root, capsys):
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.backends.torch.weights.mxfp4_experts import PackedMxfp4Experts

    folder = build_tiny_gpt_oss(tiny_models_root / "gpt_oss_mxfp4", mxfp4=True)
    device = device_under_test()
    mode, _ = mxfp4_experts_mode(device, os.environ)
    backend = TorchBackend(folder, dtype="float32", device=device)
    assert isinstance(backend.model.model.layers[0].mlp.experts, PackedMxfp4Experts) == (mode == "packed")
    ps = prompts([7, 33], seed=4)
    outputs = run_greedy(backend, ps, 24, page_size=PS, chunk_size=9)
    for prompt, out in zip(ps, outputs):
        assert out == mxfp4_reference(folder, prompt, 24), f"prompt of {len(prompt)} tokens"
    doctor = weight_bytes(folder, "float32", mxfp4_dequantized=mode == "dequantized")
    _report(capsys, f"mxfp4 gpt-oss (experts {mode})", backend, doctor)
    assert backend.weight_bytes() == doctor


def test_compressed_tensors_fp8_greedy_and_resident_bytes(tiny_models_root, capsys):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: pip install 'tierlm[quant]'")
    from test_compressed_tensors import ACTIVATION_TOLERANCE, PROMPTS, _checkpoint, _transformers_gaps

    from tierlm.backends.torch.backend import TorchBackend

    folder = _checkpoint(tiny_models_root, "llama", "FP8_DYNAMIC")
    backend = TorchBackend(folder, dtype="float32", device=device_under_test())
    assert backend.info.weight_format == "checkpoint:compressed-tensors-fp8-dynamic"
    got = run_greedy(backend, PROMPTS, 24)
    # Activations rounded to fp8 per token: within the stated logit tolerance of transformers' choice (float32,
    # CPU), nearly always exactly it (tests/test_compressed_tensors.py says why).
    gaps = [g for prompt, tokens in zip(PROMPTS, got) for g in _transformers_gaps(folder, prompt, tokens)]
    # Where fp8 matmuls run the weights stay fp8; elsewhere they are dequantized, and doctor counts them so.
    doctor = weight_bytes(folder, "float32", fp8_dequantized=device_under_test() != "cuda")
    _report(capsys, "compressed-tensors fp8-dynamic llama", backend, doctor)
    assert max(gaps) <= ACTIVATION_TOLERANCE and sum(g == 0 for g in gaps) >= 0.9 * len(gaps)
    assert abs(backend.weight_bytes() - doctor) <= 0.02 * backend.weight_bytes()
