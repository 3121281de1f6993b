"""A decode-only step's attention on CPU in one C call per layer (``paged_decode_step``, csrc/paged_decode.c).

The general path of paged_attention.py spends ~15 tensor ops and Python branches per layer around the C decode
kernel: slicing and transposing the new K/V, two ``index_copy_`` writes into the pool, a contiguous copy of the
queries, the output reshapes. At llama-small's size that was ~160 us a layer against ~20 us of kernel, about a
tenth of a compiled decode step. Here everything that does not change between layers (the slots, the page rows,
the lengths, the scratch) is set up once per step, and each layer is one ctypes call that stores the new K/V rows
at their slots, gathers the query rows and runs the same decode kernel: the same bytes in the pool and the same
outputs as the general path (tests/test_cpu_decode_step.py). A compiled step hands the same arguments to the C++
attention op through its step record (native_ops.py, step_record.py).

It serves steps of decode rows only (one query per request, in request order), on the torch_native CPU path, with
pages of the model's dtype (bf16 or float32; fp8 pages need their quantizing write), no sliding window and no
attention sinks: everything else takes the general path.
"""
from __future__ import annotations

import torch

from tierlm.backends.torch.cpu import paged_decode
from tierlm.backends.torch.cpu.library import KernelLibrary

# Set False to send every step through the general path (tests compare the two).
ENABLED = True


class DecodeStep:
    """One decode-only step's fixed arguments of ``paged_decode_step``, shared by every layer."""

    def __init__(self, lib: KernelLibrary, pool, slots: torch.Tensor, page_rows: torch.Tensor, kv_lens: torch.Tensor,
                 max_len: int, H: int, D: int, dtype: torch.dtype) -> None:
        R, self.H, self.D, self.dtype = int(page_rows.shape[0]), H, D, dtype
        self.R, self.Hkv = R, pool.num_kv_heads
        self.fn = lib.paged_decode_step
        self.work = torch.empty(lib.paged_decode_step_floats(R, H, D, max_len), dtype=torch.float32)
        self.k_ptrs, self.v_ptrs = pool.layer_pointers()
        self._pool = pool
        # kept alive with the step: their pointers are passed on every layer
        self._keep = (slots, page_rows, kv_lens)
        self.slots_ptr, self.rows_ptr, self.lens_ptr = slots.data_ptr(), page_rows.data_ptr(), kv_lens.data_ptr()
        self.rows_stride, self.page_size = int(page_rows.shape[1]), pool.page_size
        self.work_ptr, self.max_len, self.bf16 = self.work.data_ptr(), max_len, dtype == torch.bfloat16
        # paged_decode_step's arguments after the layer's K/V pools and before the scale, then after the output
        self.fixed = (self.rows_ptr, self.rows_stride, self.lens_ptr, R, H, self.Hkv, D, self.page_size)
        self.tail = (self.work_ptr, max_len, int(self.bf16))
        self.out_shape = (1, R, H, D)

    def record(self) -> dict[str, int]:
        """The same arguments as the step record's attention fields (step_record.py), for the C++ op of a compiled
        step (the layers' addresses: the pool's table of them, made once)."""
        layers = self._pool.layer_pointer_table()
        return {"attention": 1, "slots": self.slots_ptr, "table": self.rows_ptr, "table_stride": self.rows_stride,
                "kv_lens": self.lens_ptr, "rows": self.R, "heads": self.H, "kv_heads": self.Hkv, "head_dim": self.D,
                "page_size": self.page_size, "work": self.work_ptr, "max_len": self.max_len, "bf16": int(self.bf16),
                "k_layers": layers[0].data_ptr(), "v_layers": layers[1].data_ptr(),
                "layers": len(self.k_ptrs)}

    def fits(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """query [1, H, R, D], key/value [1, Hkv, R, D] of this step's dtype, each head's D values contiguous."""
        return query.shape == (1, self.H, self.R, self.D) and key.shape == value.shape == (1, self.Hkv, self.R, self.D) \
            and query.dtype == key.dtype == value.dtype == self.dtype \
            and query.stride(3) == 1 and key.stride(3) == 1 and value.stride(3) == 1

    def run(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scale: float) -> torch.Tensor:
        """Store this layer's new K/V and attend: -> [1, R, H, D] (paged_attention's output layout)."""
        out = torch.empty(self.out_shape, dtype=self.dtype)
        qs, ks, vs = query.stride(), key.stride(), value.stride()
        self.fn(query.data_ptr(), qs[2], qs[1], key.data_ptr(), ks[2], ks[1], value.data_ptr(), vs[2], vs[1],
                self.slots_ptr, self.k_ptrs[layer], self.v_ptrs[layer], *self.fixed, scale, out.data_ptr(),
                *self.tail)
        return out


def plan(meta, pool, query: torch.Tensor, lib: KernelLibrary | None) -> DecodeStep | None:
    """The step's DecodeStep when it qualifies (see the module doc), else None; ``meta`` is paged_attention's
    StepMeta, which caches the answer for its other layers; ``lib``: the library where the CPU plan reads decode
    attention from the pages (else None)."""
    return plan_for(meta, pool, query.shape[1], query.shape[3], query.dtype, query.device.type, lib)


def plan_for(meta, pool, H: int, D: int, dtype: torch.dtype, device_type: str,
             lib: KernelLibrary | None) -> DecodeStep | None:
    """``plan`` from the queries' heads, head size, dtype and device (known before the step runs: the compiled
    step writes its plan into the step record first, compile/compiled_decode.CompiledDecode.step)."""
    if lib is None or not ENABLED or meta.decode_rows is None or meta.attention_backend != "torch_native" or \
            device_type != "cpu":
        return None
    if pool.kv_dtype != dtype or pool.head_dim != D or \
            not paged_decode.supported(dtype, pool.kv_dtype, H, pool.num_kv_heads, D):
        return None
    page_rows, kv_lens, max_len = meta.decode_rows
    return DecodeStep(lib, pool, meta.slot_mapping, page_rows, kv_lens, max(1, max_len), H, D, dtype)
