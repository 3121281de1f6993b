"""The step record: a compiled step's per-step state, handed to the C++ ops as an op argument (csrc/step_record.h).

One int64 tensor per compiled model, registered as a buffer on the layers whose compiled calls take it (the float32
linears, the attention modules), so the graph passes it to ``tierlm_native::f32_linear`` and
``tierlm_native::paged_attention`` like a weight: bound once, never copied. Before each compiled step ``step`` writes
the step's fields into it (whether it is a decode-only step; its DecodeStep's arguments where the attention op serves
it) and clears them after; the ops read nothing else. The field names come from the library
(``tierlm_step_record_fields``), so Python and C++ cannot disagree on the layout.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.ops import BUFFER


class StepRecord:
    """``attention``: whether the compiled step's attention ops read the record (the plan's compiled_attention)."""

    def __init__(self, lib: KernelLibrary, attention: bool) -> None:
        self.attention = attention
        names = lib.tierlm_step_record_fields().decode().rstrip(",").split(",")
        self.index = {name: i for i, name in enumerate(names)}
        self.tensor = torch.zeros(len(names), dtype=torch.int64)
        self._fields = self.tensor.numpy()  # the same memory: written without a torch op per field
        self._keep = None

    def attach(self, module: torch.nn.Module) -> None:
        """Give ``module`` the record as a buffer (not in its state dict): its compiled call passes it on."""
        module.register_buffer(BUFFER, self.tensor, persistent=False)

    def read(self, name: str) -> int:
        return int(self._fields[self.index[name]])

    @contextlib.contextmanager
    def step(self, decode: bool, attention=None) -> Iterator[None]:
        """While a compiled step runs: ``decode`` (every request one token) and ``attention`` (its DecodeStep, whose
        tensors stay alive until the step is over) in the record; cleared after."""
        f, i = self._fields, self.index
        f[:] = 0
        f[i["decode"]] = int(decode)
        if attention is not None:
            for name, value in attention.record().items():
                f[i[name]] = value
            self._keep = attention
        try:
            yield
        finally:
            f[i["decode"]] = f[i["attention"]] = 0
            self._keep = None
