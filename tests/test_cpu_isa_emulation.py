"""The AVX2 path, run for real on an AVX-512/AMX machine: a process started with TIERLM_CPU_ISA=avx2 caps tierlm's
decisions *and* torch's own kernels (ATen's capability, oneDNN's maximum ISA, set by the entry points before torch
loads), so torch refuses the bf16 weight reorder exactly as on an AVX2-only CPU. bf16 and float32 must still load
and give transformers' greedy output; a process where only oneDNN is capped (tierlm's cpuinfo still says AVX-512)
must not crash either: torch's own refusal is probed before any weight is packed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierlm.platforms.cpu_features import this_cpu

pytestmark = pytest.mark.skipif(this_cpu().arch != "x86_64", reason="the capped levels here are x86_64 levels")

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from tierlm.cli import cap_torch_isa
cap_torch_isa()  # what `tierlm serve` and launch_server do first
import torch
from backend_driver import run_greedy
from tierlm.backends.torch.backend import TorchBackend
from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.cpu.linear import PackedLinear
from transformers import AutoModelForCausalLM

try:
    torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    refused = False
except RuntimeError:
    refused = True
out = {"capability": torch.backends.cpu.get_cpu_capability(), "torch_refuses_reorder": refused}
prompt = [1, 72, 101, 108, 108, 111, 44, 32, 119]
for dtype in ("bfloat16", "float32"):
    backend = TorchBackend(sys.argv[1], dtype=dtype)
    ours = run_greedy(backend, [prompt], 8)[0]
    hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, dtype), attn_implementation="eager")
    with torch.inference_mode():
        ref = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    out[dtype] = {"equal": ours == ref, "packed": any(isinstance(m, PackedLinear) for m in backend.model.modules()),
                  "kernels": backend.kernels()}
lib = library.load()
out["kernel_level"], out["kernel_library"] = (lib.level if lib is not None else None), library.status()["why"]
for path in sys.argv[3:]:  # 16-bit checkpoints served in float32: their weights held so, read by the float32 kernel
    backend = TorchBackend(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        ref = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    out[path] = {"equal": run_greedy(backend, [prompt], 8)[0] == ref, "kernels": backend.kernels()}
print("RESULT " + json.dumps(out))
"""


def _run(tiny_llama: Path, env_extra: dict[str, str], checkpoints: tuple[Path, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIERLM_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")} | env_extra
    extra = [str(p) for p in checkpoints]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama), str(Path(__file__).parent), *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_process_capped_at_avx2_runs_bf16_and_float32_like_an_avx2_machine(tiny_llama, tmp_path):
    from test_cpu_16bit_stored_weights import _checkpoint_in_16bit

    import torch

    half = {dtype: _checkpoint_in_16bit(tiny_llama, tmp_path / dtype, getattr(torch, dtype))
            for dtype in ("bfloat16", "float16")}
    out = _run(tiny_llama, {"TIERLM_CPU_ISA": "avx2"}, tuple(half.values()))
    assert out["capability"] == "AVX2" and out["torch_refuses_reorder"]  # torch now behaves as on an AVX2 CPU
    for dtype in ("bfloat16", "float32"):
        assert out[dtype]["equal"], f"{dtype} greedy differs from transformers under the AVX2 cap"
        assert not out[dtype]["packed"]
    assert "needs AVX-512 BW/VL/DQ" in out["bfloat16"]["kernels"]["linear"]
    # None: no kernel library here (none installed and no first-use build: the torch path then serves)
    assert out["kernel_level"] in ("avx2", None), out["kernel_library"]
    # what --dtype auto serves there for a bf16 or fp16 checkpoint: float32 on weights held in their 16 bits (fp16
    # widened by F16C's conversion), transformers' output
    for dtype, path in half.items():
        held = out[str(path)]
        assert held["equal"], f"a {dtype} checkpoint in float32 differs from transformers under the AVX2 cap"
        if out["kernel_level"] is not None:
            assert "built for avx2" in held["kernels"]["linear"] and f"held as {dtype}" in held["kernels"]["linear"]


@pytest.fixture(scope="module")
def torch_capped_alone(tiny_llama) -> dict:
    """A process where only torch is capped (ATen's capability, oneDNN's ISA): tierlm's cpuinfo still says AVX-512."""
    return _run(tiny_llama, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})


def test_torch_capped_alone_is_caught_by_the_reorder_probe(torch_capped_alone):
    out = torch_capped_alone
    assert out["torch_refuses_reorder"]
    assert out["bfloat16"]["equal"] and not out["bfloat16"]["packed"]


def test_torch_capped_alone_says_torch_refused_the_reorder(torch_capped_alone):
    linear = torch_capped_alone["bfloat16"]["kernels"]["linear"]
    assert "torch refuses the oneDNN bf16 reorder" in linear \
        or "needs AVX-512 BW/VL/DQ" in linear  # a real AVX2-only machine


@pytest.mark.skipif(not this_cpu().has("avx512_bf16", "avx512bw", "avx512vl"), reason="needs AVX512-BF16")
def test_a_process_capped_at_avx512_bf16_runs_the_avx512_bf16_products(tiny_llama):
    """On an AMX machine this is the AVX512-BF16 class all the way down: oneDNN packs for its AVX512-BF16 kernels
    and tierlm's own decode products read that layout; on an AVX512-BF16 machine it is the machine itself."""
    out = _run(tiny_llama, {"TIERLM_CPU_ISA": "avx512_bf16"})
    assert out["bfloat16"]["equal"] and out["float32"]["equal"] and out["bfloat16"]["packed"]
    linear = out["bfloat16"]["kernels"]["linear"]
    if "no C compiler" not in linear:
        assert "AVX512-BF16 kernel" in linear, linear
