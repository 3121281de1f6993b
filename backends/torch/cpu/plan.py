"""A model's CPU execution plan together with the kernel library it runs on: what the backend decides at load
(platforms/cpu_plan.py decides, from the CPU, the model and the library) and every CPU call site reads."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu
from tierlm.platforms.cpu_plan import CpuPlan, LibraryFacts, ModelFacts


@dataclass(frozen=True)
class CpuKernels:
    """A model's plan and the library its kernels come from (None: torch's kernels serve everything). What each part
    of a step runs is worked out once (cached: every layer of every step asks)."""
    plan: CpuPlan
    lib: KernelLibrary | None

    def serves(self, field: str, value: str) -> KernelLibrary | None:
        """The library where the plan's ``field`` is ``value`` (and a library loaded), else None."""
        return self.lib if self.lib is not None and getattr(self.plan, field).value == value else None

    @functools.cached_property
    def decode(self) -> KernelLibrary | None:
        """The library when decode attention reads the pages in place."""
        return self.serves("decode_attention", "paged")

    @functools.cached_property
    def extend(self) -> KernelLibrary | None:
        """The library when short extends take the paged extend kernel (``plan.extend_kernel`` says which)."""
        return self.serves("extend_attention", "paged")

    @functools.cached_property
    def blocked(self) -> KernelLibrary | None:
        """The library when bf16 prefill / extend attention takes the blocked path (one pass or GEMMs)."""
        return self.lib if self.lib is not None and self.plan.prefill_attention.value in ("blocked", "one_pass") \
            else None

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "library": library.status()}


def library_facts(lib: KernelLibrary | None, cpu: CpuFeatures) -> LibraryFacts:
    """What the plan reads of the library: its level and kernels, and (where it has tile kernels and the CPU AMX)
    whether Linux grants this process the AMX tile state (asked once)."""
    if lib is None:
        status = library.status()
        return LibraryFacts(None, why=status["why"] if not status["loaded"] else "no kernel library for this model")
    tiles = (lib.has("amx_linear") or lib.has("paged_extend_amx")) and cpu.has("amx_bf16", "amx_tile")
    granted = bool(tiles and lib.amx_request_permission() == 1)
    return LibraryFacts(lib.level, lib.kernels, library.status()["why"], amx_granted=granted)


def model_facts(dtype: torch.dtype, kv_dtype: torch.dtype, heads: int = 0, kv_heads: int = 0, head_dim: int = 0,
                weight_format: str = "none") -> ModelFacts:
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return ModelFacts(name(dtype), name(kv_dtype), heads, kv_heads or heads, head_dim, weight_format)


def for_model(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, heads: int = 0, kv_heads: int = 0,
              head_dim: int = 0, weight_format: str = "none", env: Mapping[str, str] | None = None,
              lib: KernelLibrary | None | bool = True) -> CpuKernels:
    """The plan of a model of ``dtype`` (pages of ``kv_dtype``, default the same) on this CPU with the process's
    library (``lib``: another library, or None for none: tests). Raises cpu_plan.CpuPlanError on a bad override."""
    cpu = this_cpu()
    lib = library.load(cpu) if lib is True else lib
    facts = model_facts(dtype, kv_dtype if kv_dtype is not None else dtype, heads, kv_heads, head_dim,
                        weight_format)
    plan = cpu_plan.decide(cpu, facts, library_facts(lib, cpu), os.environ if env is None else env)
    return CpuKernels(plan, lib)
