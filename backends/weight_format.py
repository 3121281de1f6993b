"""Weight formats: the load-time quantization flags (--torchao-config, --quantization) and a checkpoint's own
``quantization_config``, parsed and checked without torch or mlx (the server, doctor and both backends share it).

A weight format is named by one label ("none", "torchao:int8wo", "torchao:int8wo+embedding" (on CPU),
"mlx:q4-g64", "checkpoint:mxfp4", "checkpoint:compressed-tensors-w4a16-g128", ...): it is reported in /server_info
and ``tierlm doctor`` and is part of the L3 namespace (backends/base.kv_namespace), so pages written under one
weight format are never read under another.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierlm.backends import compressed_tensors_scheme

# --torchao-config names (SGLang's); int4wo takes its group size: int4wo-32|64|128|256.
TORCHAO_CONFIGS = ("int8wo", "int8dq", "int4wo-<group>", "fp8wo", "fp8dq-per_row")
INT4_GROUPS = (32, 64, 128, 256)
# --quantization names SGLang uses that torchao has an equivalent for (torch backend).
SGLANG_QUANTIZATION = {"w8a8_int8": "int8dq", "fp8": "fp8dq-per_row"}
# --quantization names of the mlx backend: mlx.nn.quantize's affine mode, q<bits>[-g<group>] (group 64 by default).
MLX_BITS = (4, 8)
MLX_GROUPS = (32, 64, 128)
MLX_DEFAULT_GROUP = 64
MLX_QUANTIZATION = ("q4", "q8", "q4-g<group>", "q8-g<group>")

# Checkpoint quantization_config methods each backend loads (anything else stops startup, never loads silently
# dequantized to something else). "mlx" is mlx-lm's own {"bits", "group_size"} block (no quant_method).
CHECKPOINT_METHODS = {"torch": ("mxfp4", "compressed-tensors"), "mlx": ("mlx", "mxfp4")}
# Methods transformers loads only through a package with CUDA extensions (gptqmodel: a source build): named in the
# refusal with the way round it.
CUDA_EXTENSION_METHODS = {"gptq": "gptqmodel", "awq": "gptqmodel"}


# gpt-oss MXFP4 experts on the torch backend: "packed" (backends/torch/weights/mxfp4_experts.py: 4.25 bits per weight
# resident, the router's experts dequantized per forward) or "dequantized" (to the serving dtype while loading).
MXFP4_EXPERTS_ENV = "TIERLM_MXFP4_EXPERTS"
MXFP4_EXPERTS_MODES = ("packed", "dequantized")


# TIERLM_CPU_QUANT_LINEAR=0: int8wo on CPU through torchao's own path instead (benchmarks compare the two).
NATIVE_ENV = "TIERLM_CPU_QUANT_LINEAR"
# Appended to the label where the CPU weight-only path also quantizes the input embedding (llama.cpp's token_embd;
# backends/torch/weights/quant_embedding.py): other numerics than torchao's int8wo/int4wo (embedding in the model
# dtype, as on CUDA and as tierlm held it before), so another L3 namespace.
EMBEDDING_SUFFIX = "+embedding"
INPUT_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight")  # the input embedding's tensor, by family
FP8_MATMUL_CAPABILITY = (8, 9)  # CUDA compute capability with fp8 matmuls (Ada, Hopper, Blackwell)


class WeightFormatError(ValueError):
    """A weight format this backend or device cannot run; the message names the flag and what to use instead."""


@dataclass(frozen=True)
class WeightQuant:
    """A load-time quantization: ``kind`` "torchao" (torch backend) or "mlx"; ``name`` canonical
    (int8wo, int8dq, int4wo-128, fp8wo, fp8dq-per_row; q4-g64, q8-g32); ``flag`` as the user gave it."""
    kind: str
    name: str
    flag: str
    bits: int = 8
    group_size: int | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_weight_quant(quantization: str | None, torchao_config: str | None) -> WeightQuant | None:
    """The load-time quantization the two flags ask for (None: the checkpoint's weights as they are).

    Raises ValueError naming the flag and the accepted names."""
    if quantization is not None and torchao_config is not None:
        raise ValueError(f"--quantization {quantization} and --torchao-config {torchao_config}: pass one of them")
    if torchao_config is not None:
        return _torchao(torchao_config, f"--torchao-config {torchao_config}")
    if quantization is None:
        return None
    flag = f"--quantization {quantization}"
    if quantization in SGLANG_QUANTIZATION:
        return _torchao(SGLANG_QUANTIZATION[quantization], flag)
    m = re.fullmatch(r"q(\d+)(?:-g(\d+))?", quantization)
    if m:
        bits, group = int(m.group(1)), int(m.group(2) or MLX_DEFAULT_GROUP)
        if bits in MLX_BITS and group in MLX_GROUPS:
            return WeightQuant("mlx", f"q{bits}-g{group}", flag, bits, group)
    raise ValueError(f"{flag}: use one of {', '.join(SGLANG_QUANTIZATION)} (torch backend, through torchao), "
                     f"{', '.join(MLX_QUANTIZATION)} (mlx backend; group in {MLX_GROUPS}), or --torchao-config "
                     f"{'|'.join(TORCHAO_CONFIGS)}")


def _torchao(name: str, flag: str) -> WeightQuant:
    if name in ("int8wo", "int8dq"):
        return WeightQuant("torchao", name, flag, 8)
    if name in ("fp8wo", "fp8dq-per_row"):
        return WeightQuant("torchao", name, flag, 8)
    m = re.fullmatch(r"int4wo-(\d+)", name)
    if m and int(m.group(1)) in INT4_GROUPS:
        return WeightQuant("torchao", name, flag, 4, int(m.group(1)))
    raise ValueError(f"{flag}: use one of {', '.join(TORCHAO_CONFIGS)} (int4wo group in {INT4_GROUPS})")


def cpu_weight_only(quant: WeightQuant | None, device: str | None, env: Mapping[str, str]) -> bool:
    """Whether the torch backend runs ``quant`` with torch's CPU weight-only kernels (int8wo, int4wo-<group> on
    the CPU; int8wo goes through torchao instead under TIERLM_CPU_QUANT_LINEAR=0): linears and the input embedding
    quantized, the embedding sharing a tied lm_head's table."""
    if quant is None or device != "cpu" or quant.kind != "torchao":
        return False
    if quant.name.startswith("int4wo"):
        return True  # torchao has no CPU int4 weight-only path outside its prototypes
    return quant.name == "int8wo" and env.get(NATIVE_ENV, "1") != "0"


def check_backend_kind(quant: WeightQuant | None, backend: str) -> None:
    """Refuse a load-time quantization meant for the other backend, naming the equivalent."""
    if quant is None:
        return
    if backend == "torch" and quant.kind != "torchao":
        raise WeightFormatError(f"{quant.flag}: mlx.nn.quantize names work on the mlx backend only; on the torch "
                                f"backend use --torchao-config int8wo|int8dq|int4wo-<group> or --quantization "
                                f"w8a8_int8|fp8")
    if backend == "mlx" and quant.kind != "mlx":
        raise WeightFormatError(f"{quant.flag}: torchao runs on the torch backend only; on the mlx backend use "
                                f"--quantization q8 (8-bit) or q4 (4-bit), optionally with -g<group>")


def device_refusal(quant: WeightQuant, device: str, capability: tuple[int, int] | None) -> str | None:
    """Why ``device`` ("cpu", "cuda", ...; ``capability`` CUDA's compute capability) cannot run a torchao
    quantization, naming the flag and what to use instead; None when it can. The torch backend refuses with it
    before any weights load, and ``tierlm doctor`` reports it."""
    if quant.kind != "torchao":
        return None
    if quant.name.startswith("int4wo") and device not in ("cuda", "cpu"):
        return (f"{quant.flag}: int4 weight-only runs on a CUDA GPU (torchao) or the CPU (torch's kernel); on "
                f"{device} use --torchao-config int8dq (int8 weights and activations) or int8wo")
    if quant.name.startswith("fp8") and (device != "cuda" or capability is None
                                         or tuple(capability) < FP8_MATMUL_CAPABILITY):
        where = (f"this GPU (compute capability {capability[0]}.{capability[1]})" if device == "cuda" and capability
                 else f"the {device} device")
        return (f"{quant.flag}: torchao's fp8 matmuls need a CUDA GPU with compute capability 8.9+ (Ada, Hopper); "
                f"{where} has none: use --torchao-config int8dq (--quantization w8a8_int8) or int8wo")
    return None


def checkpoint_method(config: Mapping[str, Any]) -> str | None:
    """The quantization method of a checkpoint from its config.json (None: unquantized); mlx-lm's own block
    ({"bits", "group_size"}, under "quantization" or "quantization_config") is "mlx"."""
    for key in ("quantization_config", "quantization"):
        q = config.get(key)
        if isinstance(q, Mapping) and q:
            method = q.get("quant_method")
            if method:
                return str(method).lower()
            if "bits" in q and "group_size" in q:
                return "mlx"
            return "unknown"
    text = config.get("text_config")
    return checkpoint_method(text) if isinstance(text, Mapping) else None


def checkpoint_label(config: Mapping[str, Any]) -> str:
    """The label of a checkpoint's own quantization, e.g. "checkpoint:mlx-affine-q4-g64"."""
    method = checkpoint_method(config)
    if method == compressed_tensors_scheme.METHOD:  # the scheme too: W8A8, W4A16 and FP8 pages never mix
        return f"checkpoint:{method}-{compressed_tensors_scheme.scheme_label(_quantization_config(config))}"
    if method != "mlx":
        return f"checkpoint:{method}"
    q = config.get("quantization") or config.get("quantization_config")
    return f"checkpoint:mlx-{q.get('mode', 'affine')}-q{q['bits']}-g{q['group_size']}"


def weight_format_label(config: Mapping[str, Any], quant: WeightQuant | None, device: str | None = None,
                        env: Mapping[str, str] | None = None) -> str:
    """The label of the weights a backend serves: the load-time quantization's, else the checkpoint's, else
    "none". gpt-oss MXFP4 is "checkpoint:mxfp4" on both backends and in both torch modes (mxfp4_experts_mode):
    torch's packed experts compute exactly what its experts dequantized while loading compute, to the values MLX
    computes with packed, so all share the label and L3 pages. ``device``: the torch backend's (with ``env``,
    default os.environ): its CPU weight-only path quantizes the embedding too, so the label says so
    ("torchao:int8wo+embedding")."""
    if quant is not None:
        env = os.environ if env is None else env
        return quant.label + (EMBEDDING_SUFFIX if cpu_weight_only(quant, device, env) else "")
    return checkpoint_label(config) if checkpoint_method(config) else "none"


def mxfp4_experts_mode(device: str, env: Mapping[str, str]) -> tuple[str, str]:
    """("packed" | "dequantized", why) for gpt-oss MXFP4 experts on the torch backend's ``device``; the torch
    backend loads by it and ``tierlm doctor`` sizes the weights by it. TIERLM_MXFP4_EXPERTS overrides."""
    forced = env.get(MXFP4_EXPERTS_ENV)
    if forced:
        if forced not in MXFP4_EXPERTS_MODES:
            raise WeightFormatError(f"{MXFP4_EXPERTS_ENV}={forced}: use one of {', '.join(MXFP4_EXPERTS_MODES)}")
        return forced, f"{MXFP4_EXPERTS_ENV}={forced}"
    if device == "cpu":
        # scripts/bench_mxfp4_experts.py, one run: packed decode 0.03x of dequantized (hidden 1024, 32 experts
        # top-4, bf16, AVX-512 EPYC) and 0.7x on the tests' tiny model; decoding the routed experts every step is
        # compute-bound on a CPU, where a dense copy is read at memory speed.
        return "dequantized", (f"CPU default: dequantized to the serving dtype while loading (packed decode measured "
                               f"~30x slower here); {MXFP4_EXPERTS_ENV}=packed keeps 4.25 bits per expert weight "
                               "resident when RAM is short")
    return "packed", (f"{device} default: 4.25 bits per expert weight resident (gpt-oss-20b's weights ~13.8 GB "
                      f"instead of ~42 GB), the routed experts dequantized per step; {MXFP4_EXPERTS_ENV}=dequantized "
                      "trades that memory for speed")


def check_checkpoint(config: Mapping[str, Any], backend: str, quant: WeightQuant | None) -> str | None:
    """Refuse a checkpoint quantization this backend cannot load (naming the method and the supported list), or
    a load-time quantization on top of one; returns the checkpoint's method (None: unquantized)."""
    method = checkpoint_method(config)
    if method is None:
        return None
    supported = CHECKPOINT_METHODS[backend]
    if method not in supported:
        hint = " (an mlx-lm quantized checkpoint: serve it with the mlx backend)" if method == "mlx" else ""
        if method in CUDA_EXTENSION_METHODS:
            hint = (f" (transformers loads {method.upper()} only through {CUDA_EXTENSION_METHODS[method]}, a source "
                    "build with CUDA extensions; the same model quantized by llm-compressor, in compressed-tensors "
                    "format, loads)")
        raise WeightFormatError(
            f"the checkpoint's quantization_config method {method!r} is not supported by the {backend} backend"
            f"{hint}; supported checkpoint methods: {', '.join(supported)}; or load an unquantized checkpoint and "
            f"quantize at load time (docs/models.md, weight formats)")
    if quant is not None:
        raise WeightFormatError(f"{quant.flag}: the checkpoint is already quantized ({method}); drop the flag")
    if method == compressed_tensors_scheme.METHOD:
        qcfg = _quantization_config(config)
        why = compressed_tensors_scheme.refusal(qcfg)
        if why:
            raise WeightFormatError(
                f"the checkpoint's quantization_config method {method!r} "
                f"({compressed_tensors_scheme.scheme_label(qcfg)}) is not supported by the {backend} backend: {why}; "
                f"supported compressed-tensors schemes: {'; '.join(compressed_tensors_scheme.SUPPORTED)}; other "
                f"checkpoint methods: {', '.join(m for m in supported if m != method)}")
    return method


def _quantization_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The quantization_config block, at the top level or in text_config (multimodal configs)."""
    q = config.get("quantization_config")
    if isinstance(q, Mapping) and q:
        return q
    text = config.get("text_config")
    return _quantization_config(text) if isinstance(text, Mapping) else {}


def quantized_bytes(tensors: list[tuple[str, tuple[int, ...]]], float_bytes: int, quant: WeightQuant,
                    device: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """Resident bytes of a model's weights after ``quant``, from its tensors' (name, shape) as stored: what
    ``tierlm doctor`` sizes the KV tiers from before anything loads (the loaded backend reports the real bytes).

    Quantized: 2-D ``*.weight`` tensors, the linear layers (torchao quantizes every nn.Linear; mlx also the
    embeddings, where the group divides the row; torch's CPU weight-only path (``cpu_weight_only``, on ``device``)
    the input embedding, whose table a tied lm_head shares); the rest stays ``float_bytes`` per value. Otherwise a
    tied lm_head (no ``lm_head`` tensor stored) gets its own quantized copy on the torch backend while the
    embedding stays float."""
    shared_table = cpu_weight_only(quant, device, os.environ if env is None else env)
    total = 0
    for name, shape in tensors:
        embed = "embed" in name or "wte" in name
        input_embed = name.endswith(INPUT_EMBEDDING_NAMES)
        quantized = len(shape) == 2 and name.endswith(".weight") and \
            (quant.kind == "mlx" or not embed or (shared_table and input_embed))
        if quant.kind == "mlx" and quantized and shape[-1] % quant.group_size:
            quantized = False
        total += _quantized_tensor_bytes(shape, float_bytes, quant) if quantized else math.prod(shape) * float_bytes
    if quant.kind == "torchao" and not shared_table and not any("lm_head" in name for name, _ in tensors):
        tied = input_embedding_shape(tensors)
        if tied is not None:
            total += _quantized_tensor_bytes(tied, float_bytes, quant)
    return total


def input_embedding_shape(tensors: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The [vocab, hidden] shape of the input embedding among a checkpoint's (name, shape) tensors, or None."""
    return next((shape for name, shape in tensors if name.endswith(INPUT_EMBEDDING_NAMES) and len(shape) == 2), None)


def _quantized_tensor_bytes(shape: tuple[int, ...], float_bytes: int, quant: WeightQuant) -> int:
    numel = math.prod(shape)
    if quant.kind == "mlx":  # packed values + a scale and a bias per group, in the float dtype
        return numel * quant.bits // 8 + numel // quant.group_size * 2 * float_bytes
    if quant.group_size:  # int4: packed values + a scale and a zero point per group, in the float dtype
        return numel // 2 + numel // quant.group_size * 2 * float_bytes
    return numel + int(shape[0]) * 4  # int8 / fp8: one byte per value + one scale per output row


def safetensors_shapes(files: list[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the safetensors files, from their headers (no tensor bytes read)."""
    out = []
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out += [(k, tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"]
    return out
