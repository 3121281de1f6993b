"""CPU decode attention that reads bf16 KV pages in place, through the page table (a small C kernel).

torch has no paged attention on CPU: the torch_native path gathers each request's pages per layer, and the bf16
matmuls then copy the gathered K/V again; at 3.9k cached tokens that was ~13 ms of a 28 ms llama-small step,
against ~4 MB of K/V per layer to read. This kernel reads each K and V row once, straight from the pool.

Numerics follow transformers' bf16 eager attention, so bf16 outputs stay those of transformers' bf16 model:
scores are rounded to bf16 (the matmul's output), scaled and rounded again, softmax runs in float32, the
probabilities are rounded to bf16, and the weighted sum of V accumulates in float32 and is rounded once.

The source below is compiled once per machine with the system C compiler (``cc``/``gcc``, -O3 -march=native)
into the user cache folder and loaded with ctypes; without a compiler (or on any build error) the torch path is
used, as before (logged once). ``TIERLM_CPU_PAGED_DECODE=0`` turns the kernel off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf(uint16_t b) { uint32_t x = (uint32_t)b << 16; float f; memcpy(&f, &x, 4); return f; }
static inline uint16_t to_bf(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  /* NaN stays NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
static inline float round_bf(float f) { return bf(to_bf(f)); }

/* q [R, H, D] bf16; k, v: one layer of the pool, [slots, Hkv, D] bf16; table [R, table_stride] int32 pages;
   kv_lens [R]; out [R, H, D] bf16; work: H * max_len + 2 * H * D + H floats of scratch.
   Token-major passes: each K and V row (all KV heads of one token, contiguous) is read once from memory. */
void paged_decode_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *table,
                       int table_stride, const int32_t *kv_lens, int R, int H, int Hkv, int D, int page_size,
                       float scale, uint16_t *out, float *work, int max_len) {
    const int n = H / Hkv;
    float *scores = work;                       /* [H, max_len] */
    float *qf = scores + (long)H * max_len;     /* [H, D] */
    float *acc = qf + (long)H * D;              /* [H, D] */
    float *mx = acc + (long)H * D;              /* [H] */
    for (int r = 0; r < R; r++) {
        const int L = kv_lens[r];
        const int32_t *pages = table + (long)r * table_stride;
        for (int i = 0; i < H * D; i++) qf[i] = bf(q[(long)r * H * D + i]);
        for (int h = 0; h < H; h++) mx[h] = -INFINITY;
        for (int t = 0; t < L; t++) {
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;
            const uint16_t *kr = k + slot * Hkv * D;
            for (int h = 0; h < H; h++) {
                const uint16_t *kh = kr + (h / n) * D;
                const float *qh = qf + (long)h * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qh[d] * bf(kh[d]);
                s = round_bf(round_bf(s) * scale);
                scores[(long)h * max_len + t] = s;
                if (s > mx[h]) mx[h] = s;
            }
        }
        for (int h = 0; h < H; h++) {
            float *sh = scores + (long)h * max_len;
            float sum = 0.f;
            for (int t = 0; t < L; t++) { sh[t] = expf(sh[t] - mx[h]); sum += sh[t]; }
            const float inv = 1.f / sum;
            for (int t = 0; t < L; t++) sh[t] = round_bf(sh[t] * inv);
        }
        for (int i = 0; i < H * D; i++) acc[i] = 0.f;
        for (int t = 0; t < L; t++) {
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;
            const uint16_t *vr = v + slot * Hkv * D;
            for (int h = 0; h < H; h++) {
                const uint16_t *vh = vr + (h / n) * D;
                const float p = scores[(long)h * max_len + t];
                float *ah = acc + (long)h * D;
                for (int d = 0; d < D; d++) ah[d] += p * bf(vh[d]);
            }
        }
        for (int i = 0; i < H * D; i++) out[(long)r * H * D + i] = to_bf(acc[i]);
    }
}
"""
# Vectorized dot products need reassociated float sums; infinities (the running max starts at -inf) stay defined.
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierlm")) / "kernels"


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None when it cannot be built here (then torch's path)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("TIERLM_CPU_PAGED_DECODE", "1") == "0":
            log.info("CPU paged decode kernel: off (TIERLM_CPU_PAGED_DECODE=0)")
            return None
        cc = _compiler()
        if cc is None:
            log.info("CPU paged decode kernel: no C compiler (cc/gcc/clang); bf16 decode attention uses torch")
            return None
        tag = hashlib.sha256((_SOURCE + cc + " ".join(CFLAGS) + os.uname().machine).encode()).hexdigest()[:16]
        lib_path = _cache_dir() / f"paged_decode_{tag}.so"
        try:
            if not lib_path.exists():
                lib_path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory() as tmp:
                    src = Path(tmp) / "paged_decode.c"
                    src.write_text(_SOURCE)
                    built = Path(tmp) / lib_path.name
                    subprocess.run([cc, *CFLAGS, "-o", str(built), str(src), "-lm"], check=True,
                                   capture_output=True, timeout=120)
                    os.replace(built, lib_path)  # atomic: a concurrent server never loads half a file
            lib = ctypes.CDLL(str(lib_path))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("CPU paged decode kernel: could not build or load it (%s %s); bf16 decode attention uses "
                        "torch", e, detail.decode(errors="replace")[-300:])
            return None
        fn = lib.paged_decode_bf16
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 5 + [
            ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        log.info("CPU paged decode kernel: built with %s (%s)", cc, lib_path)
        _lib = lib
        return lib


def supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel handles (bf16 queries over bf16 pages, no window, no sinks: the caller)."""
    return q_dtype == torch.bfloat16 and kv_dtype == torch.bfloat16 and heads % kv_heads == 0


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """q [R, H, D] bf16 (one query per request) over each request's kv_lens[r] keys in the pool layer
    ``k_slots``/``v_slots`` [slots, Hkv, D] bf16, pages from ``page_table`` [R, P] int32 -> [R, H, D] bf16."""
    R, H, D = q.shape
    Hkv = k_slots.shape[1]
    q = q.contiguous()
    table = page_table.contiguous()
    lens = kv_lens.contiguous()
    out = torch.empty_like(q)
    max_len = max(1, int(lens.max()))
    work = torch.empty(H * max_len + 2 * H * D + H, dtype=torch.float32)
    lib.paged_decode_bf16(q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), table.data_ptr(), table.shape[1],
                          lens.data_ptr(), R, H, Hkv, D, page_size, float(scale), out.data_ptr(), work.data_ptr(),
                          max_len)
    return out
