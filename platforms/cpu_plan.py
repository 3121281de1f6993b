"""The CPU execution plan: which kernel each part of a step runs, decided once when a model loads, each with its reason.

Every CPU decision of the torch backend is a field of one frozen record (``CpuPlan``), decided here from facts alone:
the CPU's features (platforms/cpu_features.py, after a TIERLM_CPU_ISA cap), the model (``ModelFacts``: dtype, KV
dtype, heads, weight format; no weights needed), and the kernel library that loaded (``LibraryFacts``: its level and
the kernels its build has, backends/torch/cpu/library.py). The backend builds it at load and every call site reads
it (backends/torch/cpu/); ``tierlm doctor`` builds it before any model loads, from the install's manifest, and
/server_info prints the one the server runs. Tests build it from recorded cpuinfo texts.

Overrides: ``TIERLM_CPU_PLAN="field=value,..."`` sets fields to one of their values (``OVERRIDES`` lists them; a
value the plan cannot run here is refused with the reason, not silently kept). It is the one switch of the plan,
read only here; the per-kernel switches of earlier versions are read here too, as the field they set, with a
warning (``RENAMED``). docs/cpu-plan.md has the table.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Mapping

from tierlm.platforms.cpu_features import CpuFeatures

log = logging.getLogger(__name__)

PLAN_ENV = "TIERLM_CPU_PLAN"
KERNELS_ENV = "TIERLM_CPU_KERNELS"  # 0: load no kernel library (torch's kernels everywhere)

# field -> (values an override may set, what each means)
OVERRIDES: dict[str, dict[str, str]] = {
    "decode_attention": {"paged": "tierlm's C kernel over the pool's pages in place",
                         "torch": "torch over pages gathered per layer"},
    "extend_attention": {"paged": "tierlm's C extend kernel over the pool's pages (AMX tiles, AVX-512 or float32)",
                         "torch": "the prefill path over gathered pages"},
    "prefill_attention": {"one_pass": "blocks of query rows in one AVX512-BF16 C pass each",
                          "blocked": "blocks of query rows: two bf16 GEMMs and the C row softmax",
                          "sdpa": "torch's fused SDPA"},
    "bf16_linear": {"packed": "oneDNN-prepacked bf16 weights", "torch": "torch's plain bf16 F.linear"},
    "decode_products": {"amx": "tierlm's AMX tile kernel over the packed weight (up to 32 rows)",
                        "avx512_bf16": "tierlm's AVX512-BF16 kernel over the packed weight (up to 32 rows)",
                        "onednn": "oneDNN's packed product at every row count"},
    "pack_tied_lm_head": {"yes": "a tied lm_head packed as a copy beside the embedding", "no": "kept plain"},
    "f32_products": {"gemv": "tierlm's float32 decode-product kernel (1-8 rows of decode steps)",
                     "mkl": "torch's F.linear (MKL)"},
    "f32_16bit_weights": {"yes": "a bf16/fp16 checkpoint's linear weights held in 16 bits", "no": "float32 weights"},
    "int8_products": {"gemv": "tierlm's int8 weight-only streaming kernel", "torch": "torch's _weight_int8pack_mm"},
    "compiled_ops": {"native": "compiled steps call the kernels from C++ ops", "python": "through the Python ops"},
    "compiled_attention": {"native": "a compiled decode-only step's attention from the C++ op",
                           "python": "through the Python op"},
    "fused_projections": {"yes": "q/k/v and gate/up as one linear each", "no": "transformers' own projections"},
}

# Decisions made where their facts are, not by ``decide``: each reads its override with ``override``. Only the
# values that rule something out (or, for ``compile``, lift the size floor): the default is what runs otherwise.
ELSEWHERE: dict[str, dict[str, str]] = {
    "compile": {"yes": "compile the decode step whatever the weights' size (where the default may compile)",
                "no": "no compiled decode unless --enable-torch-compile (backends/torch/compile/policy.py)"},
    "compile_wrapper": {"python": "inductor's Python wrapper instead of its C++ one"},
    "compile_guards": {"all": "dynamo runs every guard on every step (not only the inputs' of tested families)"},
    "compile_call": {"dynamo": "ready steps go through dynamo, not the compiled graph called straight"},
    "huge_pages": {"no": "the weights stay on 4 KB pages (platforms/huge_pages.py)"},
}
FIELDS = {**OVERRIDES, **ELSEWHERE}

# The value of each field that runs no tierlm kernel: what an override may ask for on a model the field does not
# apply to (nothing to turn off); any other value there is refused.
OFF = {"decode_attention": "torch", "extend_attention": "torch", "prefill_attention": "sdpa", "bf16_linear": "torch",
       "decode_products": "onednn", "pack_tied_lm_head": "no", "f32_products": "mkl", "f32_16bit_weights": "no",
       "int8_products": "torch", "compiled_ops": "python", "compiled_attention": "python", "fused_projections": "no"}

# The switches of earlier versions: name -> {value: the overrides it stands for}. "!v" rules the value v out (the
# field takes the next choice it can run), as the switch did: it turned one kernel off, whatever ran instead.
RENAMED: dict[str, dict[str, dict[str, str]]] = {
    "TIERLM_CPU_PAGED_DECODE": {"0": {"decode_attention": "!paged", "extend_attention": "!paged",
                                      "prefill_attention": "!blocked,!one_pass"}},
    "TIERLM_CPU_PREFILL_ATTENTION": {"blocked": {"prefill_attention": "blocked"},
                                     "sdpa": {"prefill_attention": "sdpa"}, "auto": {}},
    "TIERLM_CPU_BLOCKED_SCORES": {"0": {"prefill_attention": "!one_pass"}},
    "TIERLM_CPU_AMX_LINEAR": {"0": {"decode_products": "!amx"}},
    "TIERLM_CPU_AVX512_LINEAR": {"0": {"decode_products": "!avx512_bf16"}},
    "TIERLM_CPU_PACKED_LINEAR": {"0": {"bf16_linear": "torch"}},
    "TIERLM_CPU_PACK_TIED_LM_HEAD": {"0": {"pack_tied_lm_head": "no"}},
    "TIERLM_CPU_F32_GEMV": {"0": {"f32_products": "mkl"}},
    "TIERLM_CPU_16BIT_WEIGHTS": {"0": {"f32_16bit_weights": "no"}},
    "TIERLM_CPU_INT8_GEMV": {"0": {"int8_products": "torch"}},
    "TIERLM_CPU_PRODUCT_OP": {"0": {"compiled_ops": "python"}},
    "TIERLM_CPU_ATTENTION_OP": {"0": {"compiled_attention": "python"}},
    "TIERLM_CPU_FUSED_PROJECTIONS": {"0": {"fused_projections": "no"}},
    "TIERLM_CPU_COMPILE": {"0": {"compile": "no"}, "1": {"compile": "yes"}},
    "TIERLM_CPU_COMPILE_CPP_WRAPPER": {"0": {"compile_wrapper": "python"}},
    "TIERLM_CPU_COMPILE_SKIP_GUARDS": {"0": {"compile_guards": "all"}},
    "TIERLM_CPU_COMPILE_DIRECT_CALL": {"0": {"compile_call": "dynamo"}},
    "TIERLM_HUGE_PAGES": {"0": {"huge_pages": "no"}},
}


class CpuPlanError(ValueError):
    """An override names no field or value of the plan: the message lists them."""


def kernels_override(env: Mapping[str, str]) -> str:
    """Why no kernel library is loaded when TIERLM_CPU_KERNELS=0 says so, else ""."""
    value = (env.get(KERNELS_ENV) or "").strip()
    if value not in ("", "0", "1"):
        raise CpuPlanError(f"{KERNELS_ENV}={value}: use 0 (torch's kernels only) or 1")
    return f"{KERNELS_ENV}=0" if value == "0" else ""


_WARNED: set[str] = set()  # the renamed switches already warned about (a start reads the overrides several times)


def read_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """field -> (value, which variable set it), from TIERLM_CPU_PLAN and the renamed switches (each warned about
    once); raises CpuPlanError on anything it does not know. Switches that set one field together combine as the
    switches did: their ruled-out values add up, and a value one of them sets that another rules out stays ruled out
    (TIERLM_CPU_PAGED_DECODE=0 with TIERLM_CPU_PREFILL_ATTENTION=blocked: not blocked). TIERLM_CPU_PLAN wins."""
    found: dict[str, tuple[str, str]] = {}
    for name, meanings in RENAMED.items():
        value = (env.get(name) or "").strip().lower()
        if not value or value == "1" and "1" not in meanings:
            continue
        if value not in meanings:
            raise CpuPlanError(f"{name}={value}: use one of {', '.join(meanings)} (or set {PLAN_ENV})")
        sets = meanings[value]
        if sets and f"{name}={value}" not in _WARNED:
            _WARNED.add(f"{name}={value}")
            log.warning("%s=%s is read as %s", name, value, "; ".join(
                f"{k} not {v.replace('!', '').replace(',', ' nor ')}" if v.startswith("!") else f"{PLAN_ENV}={k}={v}"
                for k, v in sets.items()))
        for k, v in sets.items():
            source = f"{name}={value}"
            if k in found:
                (was, was_source), out = found[k], set()
                for each in (was, v):
                    if each.startswith("!"):
                        out |= set(each.split(","))
                chosen = next((each for each in (was, v) if not each.startswith("!") and f"!{each}" not in out), None)
                v = chosen if chosen is not None else ",".join(sorted(out))
                source = f"{was_source} and {source}"
            found[k] = (v, source)
    for item in (env.get(PLAN_ENV) or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip().lower() for s in item.partition("="))
        if not sep or key not in FIELDS:
            raise CpuPlanError(f"{PLAN_ENV}: {item.strip()!r} is not field=value; fields: {', '.join(FIELDS)}")
        if value not in FIELDS[key]:
            raise CpuPlanError(f"{PLAN_ENV}: {key} takes {', '.join(FIELDS[key])}, not {value!r}")
        found[key] = (value, f"{PLAN_ENV} {key}={value}")
    return found


def override(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """(value, the setting that asked for it) where ``name`` (a field of ``FIELDS``) is overridden, else None; a
    value "!v[,!w]" rules values out instead of setting one (the switches of earlier versions)."""
    return read_overrides(env).get(name)


@dataclass(frozen=True)
class Choice:
    value: str
    why: str

    def __str__(self) -> str:
        return f"{self.value} ({self.why})"


@dataclass(frozen=True)
class ModelFacts:
    """What the plan reads of a model: no weights. ``dtype``/``kv_dtype``: "bfloat16", "float32", "float16", or the
    page dtype ("float8_e4m3fn": dequantized to the model dtype for attention)."""
    dtype: str
    kv_dtype: str
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    weight_format: str = "none"


@dataclass(frozen=True)
class LibraryFacts:
    """The kernel library as loaded: its level (None: no library, ``why`` says why), the kernels its build has, and
    whether Linux granted the AMX tile state (where the library has tile kernels)."""
    level: str | None
    kernels: frozenset[str] = frozenset()
    why: str = ""
    amx_granted: bool = False

    def has(self, kernel: str) -> bool:
        return self.level is not None and kernel in self.kernels


@dataclass(frozen=True)
class CpuPlan:
    """One model's CPU execution plan (see the module doc). Fields hold a value and its reason."""
    cpu: Choice  # the level the decisions were made for
    kernels: Choice  # the library: its level, or "none"
    bf16_linear: Choice  # packed | torch | n/a
    decode_products: Choice  # amx | avx512_bf16 | onednn | n/a
    pack_tied_lm_head: Choice
    f32_products: Choice  # gemv | mkl | n/a
    f32_16bit_weights: Choice
    int8_products: Choice  # gemv | torch | n/a
    decode_attention: Choice  # paged | torch
    extend_attention: Choice  # paged (amx | avx512 | f32 in its why) | torch
    extend_kernel: Choice  # amx | avx512 | f32 | none: which extend kernel "paged" runs
    prefill_attention: Choice  # one_pass | blocked | sdpa
    compiled_ops: Choice  # native | python
    compiled_attention: Choice  # native | python
    fused_projections: Choice
    extra: dict = field(default_factory=dict, compare=False)  # decided elsewhere at load: threads, huge pages, compile

    def with_decision(self, name: str, choice: Choice) -> "CpuPlan":
        """The plan with one more decision made at load outside it (threads, huge pages, compile), for the report."""
        return dataclasses.replace(self, extra={**self.extra, name: choice})

    def to_dict(self) -> dict[str, dict[str, str]]:
        out = {f.name: {"value": getattr(self, f.name).value, "why": getattr(self, f.name).why}
               for f in dataclasses.fields(self) if f.name != "extra"}
        out.update({k: {"value": c.value, "why": c.why} for k, c in self.extra.items()})
        return out


def _onednn_cap(env: Mapping[str, str]) -> str:
    """ONEDNN_MAX_CPU_ISA as oneDNN reads it ("" when unset or unlimited)."""
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or "").upper()
    return "" if cap in ("", "ALL", "DEFAULT") else cap


def int8_weights(weight_format: str) -> bool:
    """Whether a weight format's linears are tierlm's int8 weight-only layers (backends/torch/weights/quant_linear.py):
    --torchao-config int8wo on tierlm's CPU path (its label carries "+embedding") and compressed-tensors int8
    per-channel symmetric checkpoints (w8a8-int8, w8a16-channel; grouped or asymmetric int8 loads dequantized)."""
    if weight_format.startswith("checkpoint:compressed-tensors-"):
        scheme = weight_format.removeprefix("checkpoint:compressed-tensors-")
        return "-asym" not in scheme and (scheme == "w8a8-int8" or scheme.startswith(("w8a16-channel",
                                                                                         "w8int-channel-")))
    return weight_format == "torchao:int8wo+embedding"


class _Decider:
    """Each field's decision; an override replaces the value where the plan can run it, else is refused."""

    def __init__(self, cpu: CpuFeatures, model: ModelFacts, lib: LibraryFacts, env: Mapping[str, str]) -> None:
        self.cpu, self.model, self.lib, self.env = cpu, model, lib, env
        self.overrides = read_overrides(env)

    def pick(self, name: str, decided: Choice, runnable: Mapping[str, str], order: tuple[str, ...] = ()) -> Choice:
        """``decided``, unless an override names another value: then that value where ``runnable`` (value -> why
        it cannot run, "" where it can) allows it, else CpuPlanError. An override that rules values out takes the
        first other value of ``order`` (best first) that can run."""
        if name not in self.overrides:
            return decided
        value, source = self.overrides[name]
        if value.startswith("!"):
            out = {v.removeprefix("!") for v in value.split(",")}
            if decided.value not in out:
                return decided
            instead = next((v for v in order if v not in out and not runnable.get(v, "not a choice here")), None)
            if instead is None:  # nothing else can run: a field with an off value always can
                raise CpuPlanError(f"{source}: {name} has nothing but {decided.value} to run here")
            return Choice(instead, f"{source} rules {decided.value} out")
        if value == decided.value:
            return Choice(value, source)
        blocked = runnable.get(value, "not a choice here")
        if blocked:
            raise CpuPlanError(f"{source}: {name}={value} cannot run here ({blocked}); it is {decided}")
        return Choice(value, source)

    def na(self, name: str, why: str) -> Choice:
        """The field does not apply to this model: "n/a" with why. An override that asks it to run a kernel here is
        refused (one that turns it off, or rules a kernel out, has nothing to do)."""
        value, source = self.overrides.get(name, ("", ""))
        if value and not value.startswith("!") and value != OFF[name]:
            raise CpuPlanError(f"{source}: {name}={value} does not apply to this model ({why})")
        return Choice("n/a", why)

    # --- linears ---
    def bf16_linear(self) -> Choice:
        """The plain bf16 linears: every one of a bf16 model, those an int8 checkpoint leaves unquantized (its
        lm_head); a load-time quantization (torchao) replaces them all."""
        if self.model.dtype != "bfloat16" or self.model.weight_format.startswith("torchao:"):
            return self.na("bf16_linear", f"{self.model.dtype} weights" if self.model.dtype != "bfloat16" else
                           f"{self.model.weight_format} layers")
        ok, why = self.cpu.onednn_bf16_prepack
        decided = Choice("packed" if ok else "torch", why)
        return self.pick("bf16_linear", decided, {"torch": "", "packed": "" if decided.value == "packed" else
                                                  decided.why})

    def decode_products(self, bf16_linear: Choice) -> Choice:
        if bf16_linear.value != "packed":
            return self.na("decode_products", "no packed bf16 weights")
        cap = _onednn_cap(self.env)
        amx_cpu = self.cpu.has("amx_bf16", "amx_tile")
        can: dict[str, str] = {"onednn": ""}
        if not amx_cpu:
            can["amx"] = "no AMX-BF16 on this CPU"
        elif cap and "AMX" not in cap:
            can["amx"] = f"ONEDNN_MAX_CPU_ISA={cap} rules AMX out of oneDNN"
        elif not self.lib.has("amx_linear"):
            can["amx"] = f"the kernel library ({self.lib.level or 'none'}) has no AMX kernel"
        elif not self.lib.amx_granted:
            can["amx"] = "Linux refused the AMX tile state (arch_prctl)"
        else:
            can["amx"] = ""
        if not self.cpu.has("avx512_bf16", "avx512bw", "avx512vl"):
            can["avx512_bf16"] = "no AVX512-BF16 on this CPU"
        elif cap and not any(t in cap for t in ("BF16", "FP16", "AMX", "AVX10")):
            can["avx512_bf16"] = f"ONEDNN_MAX_CPU_ISA={cap} rules AVX512-BF16 out of oneDNN"
        elif amx_cpu and (not cap or "AMX" in cap):
            can["avx512_bf16"] = "oneDNN packs for AMX tiles here (the AMX kernel reads that layout)"
        elif not self.lib.has("avx512_linear"):
            can["avx512_bf16"] = f"the kernel library ({self.lib.level or 'none'}) has no AVX512-BF16 kernel"
        else:
            can["avx512_bf16"] = ""
        if not can["amx"]:
            decided = Choice("amx", "AMX-BF16: tile products read from oneDNN's packed weight, the same bits, "
                                    "~1.7x its speed at decode")
        elif not can["avx512_bf16"]:
            decided = Choice("avx512_bf16", "AVX512-BF16 dot products over oneDNN's packed weight, the same bits, "
                                            f"~1.7x at one row (AMX: {can['amx']})")
        else:
            decided = Choice("onednn", f"AMX: {can['amx']}; AVX512-BF16: {can['avx512_bf16']}")
        return self.pick("decode_products", decided, can, ("amx", "avx512_bf16", "onednn"))

    def pack_tied(self, bf16_linear: Choice) -> Choice:
        if bf16_linear.value != "packed":
            return self.na("pack_tied_lm_head", "no packed bf16 weights")
        return self.pick("pack_tied_lm_head", Choice("yes", "eager bf16 F.linear reorders a plain weight on every "
                                                            "call; the packed copy costs its bytes once"),
                         {"yes": "", "no": ""})

    def f32_products(self) -> Choice:
        if self.model.dtype != "float32" or self.model.weight_format != "none":
            return self.na("f32_products", "not float32 weights" if self.model.dtype != "float32" else
                           f"{self.model.weight_format} weights")
        why = "" if self.lib.has("f32_gemv") else f"no kernel library ({self.lib.why})" if self.lib.level is None \
            else f"the {self.lib.level} library has no AVX2/AVX-512 float32 kernel (plain C is slower than MKL)"
        decided = Choice("gemv", "1-8 decode rows streamed with the weight prefetched (MKL's one-row product is "
                                 "slow on AMD)") if not why else Choice("mkl", why)
        return self.pick("f32_products", decided, {"gemv": why, "mkl": ""})

    def f32_16bit(self, f32: Choice) -> Choice:
        if f32.value != "gemv":
            return self.na("f32_16bit_weights", "the float32 kernel does not serve this model")
        return self.pick("f32_16bit_weights", Choice("yes", "a bf16/fp16 checkpoint's weights kept in their 16 bits "
                                                            "(exact), widened in registers"), {"yes": "", "no": ""})

    def int8_products(self) -> Choice:
        if not int8_weights(self.model.weight_format):
            return self.na("int8_products", "no int8 weight-only layers")
        if self.model.dtype not in ("bfloat16", "float32"):
            why = f"the C kernel takes bfloat16 or float32 activations, not {self.model.dtype}"
        elif not self.lib.has("int8_gemv"):
            why = f"the kernel library ({self.lib.level or 'none'}) has no AVX2/AVX-512 int8 kernel"
        else:
            why = ""
        decided = Choice("gemv", "the int8 weight streamed at memory speed (1.9-2.3x oneDNN's bf16 GEMV)") \
            if not why else Choice("torch", why)
        return self.pick("int8_products", decided, {"gemv": why, "torch": ""})

    # --- attention ---
    def attention_dtype(self) -> str:
        """What the C kernels see: the model dtype where pages hold it (fp8 pages take the torch path here)."""
        return self.model.dtype if self.model.kv_dtype == self.model.dtype else ""

    def decode_attention(self) -> Choice:
        d = self.attention_dtype()
        if self.lib.level is None:
            why = f"no kernel library ({self.lib.why})"
        elif d not in ("bfloat16", "float32"):
            why = f"the C kernel reads bf16 or float32 queries over pages of the same dtype (pages " \
                  f"{self.model.kv_dtype}, model {self.model.dtype})"
        elif self.model.kv_heads and self.model.heads % self.model.kv_heads:
            why = f"{self.model.heads} query heads over {self.model.kv_heads} KV heads"
        else:
            why = ""
        decided = Choice("paged", f"the pool's pages read in place ({self.lib.level} library)") if not why \
            else Choice("torch", why)
        return self.pick("decode_attention", decided, {"paged": why, "torch": ""}, ("paged", "torch"))

    def prefill_attention(self) -> Choice:
        if self.model.dtype != "bfloat16":
            why = f"the blocked path is for bf16, this model is {self.model.dtype}"
            return self.pick("prefill_attention", Choice("sdpa", f"torch's SDPA: {why}"),
                             {"sdpa": "", "blocked": why, "one_pass": why}, ("one_pass", "blocked", "sdpa"))
        amx = self.cpu.arch == "x86_64" and self.cpu.has("amx_bf16", "amx_tile")
        no_lib = "" if self.lib.level is not None else f"no kernel library ({self.lib.why})"
        one_pass = no_lib or ("" if self.lib.has("blocked_attention") else
                              f"the {self.lib.level} library has no AVX512-BF16 block kernel")
        if one_pass == "" and self.model.head_dim % 16:
            one_pass = f"head size {self.model.head_dim} is not a multiple of 16"
        can = {"sdpa": "", "blocked": no_lib, "one_pass": one_pass}
        if amx:
            decided = Choice("sdpa", "torch's fused SDPA multiplies on AMX tiles here: ~3x the blocked path")
        elif no_lib:
            decided = Choice("sdpa", no_lib)
        elif not one_pass:
            decided = Choice("one_pass", "each block's scores, softmax and P.V in one AVX512-BF16 pass: -7 % of a "
                                         "prefill against the blocked GEMMs (torch's SDPA ran bf16 ~2.6x slower "
                                         "without AMX)")
        else:
            decided = Choice("blocked", f"torch's fused SDPA ran bf16 ~2.6x slower without AMX ({one_pass})")
        return self.pick("prefill_attention", decided, can, ("one_pass", "blocked", "sdpa"))

    def extend_attention(self, prefill: Choice) -> tuple[Choice, Choice]:
        d, D = self.attention_dtype(), self.model.head_dim
        no_amx = "" if self.lib.has("paged_extend_amx") and self.cpu.has("amx_bf16", "amx_tile") and \
            self.lib.amx_granted and D % 32 == 0 else "no AMX tile kernel here (the CPU, the library, Linux's " \
                                                      "tile state, or a head size not a multiple of 32)"
        if self.lib.level is None:
            kernel, why = "none", f"no kernel library ({self.lib.why})"
        elif self.model.kv_heads and self.model.heads % self.model.kv_heads:
            kernel, why = "none", f"{self.model.heads} query heads over {self.model.kv_heads} KV heads"
        elif d == "float32":
            ok = self.lib.has("paged_extend_f32") and D % 8 == 0
            kernel, why = ("f32", "") if ok else ("none", f"the {self.lib.level} library has no float32 extend "
                                                           "kernel (AVX2/AVX-512), or the head size is not a "
                                                           "multiple of 8")
        elif d == "bfloat16":
            if not no_amx:
                kernel, why = "amx", ""
            elif self.lib.has("paged_extend_bf16") and D % 16 == 0 and prefill.value in ("blocked", "one_pass"):
                kernel, why = "avx512", ""
            else:
                kernel, why = "none", f"{no_amx}; the AVX-512 kernel runs where prefill takes the blocked path"
        else:
            kernel, why = "none", f"pages {self.model.kv_dtype} under a {self.model.dtype} model"
        label = {"amx": "AMX tiles: 1.9x torch's SDPA at 16 rows over 2000 keys",
                 "avx512": "AVX-512: 1.8x the blocked path at 16 rows", "f32": "float32 in AVX2/AVX-512 lanes"}
        decided = Choice("paged", label[kernel]) if kernel != "none" else Choice("torch", why)
        chosen = self.pick("extend_attention", decided, {"paged": why, "torch": ""}, ("paged", "torch"))
        return chosen, Choice(kernel if chosen.value == "paged" else "none", chosen.why)

    # --- compiled steps ---
    def compiled_ops(self) -> tuple[Choice, Choice]:
        why = "" if self.lib.has("torch_ops") else f"no kernel library with torch ops ({self.lib.why})"
        ops = self.pick("compiled_ops", Choice("native", "the kernels called from C++ ops, no Python between")
                        if not why else Choice("python", why), {"native": why, "python": ""})
        attn_why = why or ("" if ops.value == "native" else "the C++ ops are off")
        attn = self.pick("compiled_attention", Choice("native", "a decode-only step's layers in C++ (~25 us a layer "
                                                                "less)") if not attn_why else
                         Choice("python", attn_why), {"native": attn_why, "python": ""})
        return ops, attn

    def fused(self) -> Choice:
        return self.pick("fused_projections", Choice("yes", "q/k/v and gate/up as one linear each (llama, qwen2, "
                                                            "qwen3, mistral; bit-identical)"), {"yes": "", "no": ""})


def decide(cpu: CpuFeatures, model: ModelFacts, lib: LibraryFacts, env: Mapping[str, str]) -> CpuPlan:
    """The plan for ``model`` on ``cpu`` with ``lib`` loaded; raises CpuPlanError on a bad or impossible override."""
    d = _Decider(cpu, model, lib, env)
    bf16 = d.bf16_linear()
    f32 = d.f32_products()
    prefill = d.prefill_attention()
    extend, extend_kernel = d.extend_attention(prefill)
    ops, attn = d.compiled_ops()
    cap = f" (capped by TIERLM_CPU_ISA={cpu.cap})" if cpu.cap else ""
    return CpuPlan(
        cpu=Choice(cpu.level, f"{cpu.model_name or cpu.arch}{cap}"),
        kernels=Choice(lib.level or "none", lib.why),
        bf16_linear=bf16, decode_products=d.decode_products(bf16), pack_tied_lm_head=d.pack_tied(bf16),
        f32_products=f32, f32_16bit_weights=d.f32_16bit(f32), int8_products=d.int8_products(),
        decode_attention=d.decode_attention(), extend_attention=extend, extend_kernel=extend_kernel,
        prefill_attention=prefill, compiled_ops=ops, compiled_attention=attn, fused_projections=d.fused())


def packs_tied_lm_head(cpu: CpuFeatures, model: ModelFacts, env: Mapping[str, str]) -> bool:
    """Whether ``model``'s plan packs a tied lm_head as a copy (bf16_linear=packed, pack_tied_lm_head=yes: decided
    without the library, which neither reads): the bytes ``tierlm doctor`` adds to the weights. Raises CpuPlanError
    as ``decide`` does."""
    d = _Decider(cpu, model, LibraryFacts(None), env)
    return d.pack_tied(d.bf16_linear()).value == "yes"
