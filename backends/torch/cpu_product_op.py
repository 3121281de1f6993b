"""The compiled decode step's kernel products as C++ operators: inductor's C++ wrapper calls them through the
dispatcher, and they call tierlm's decode-product kernels (packed bf16: cpu_avx512_linear.py, cpu_amx_linear.py;
float32 / bf16-held: cpu_f32_gemv.py) with no Python in between.

Why: compiled, every product is a call of the ``tierlm::packed_linear`` op (compiled_decode.py), whose kernel is a
Python function: ~3.4 us from the dispatcher into Python and ~5.7 us of Python (shapes, the chunk table, ctypes)
around a kernel that runs 10-300 us. A decode step makes one per linear layer: 33 in llama-small, 97 in
Qwen2.5-0.5B.

How: a small C++ library built against torch's headers (g++ or clang++, ~6 s once; cached per source, compiler and
torch) defines ``tierlm_native::packed_linear`` with the same schema. It serves the common case itself: bf16 rows
at most the weight's ``fast_rows``, read in place, one thread's share of work (the rule of
onednn_packed_weight.run_in_block_slices), the K chunk the probe found for this row count (cpu_avx512_linear
.chunk_sizes, handed over per K and thread count), the packed weight's address and size from oneDNN's own ops.
Anything else (more rows, another dtype, a product big enough for helper threads, a K or thread count with no
chunk table) goes to ``tierlm::packed_linear``, the Python op, so the outputs are those of cpu_linear
.packed_product bit for bit in every case.

``tierlm_native::f32_linear`` does the same for cpu_f32_gemv.F32GemvLinear (``tierlm::f32_linear``): in decode
steps (the flag cpu_f32_gemv.decode_step sets here), 1..MAX_ROWS float32 rows, contiguous, one thread's share, it
calls the kernel's ``f32_linear``, ``f32_linear_bf16w`` or ``f32_linear_f16w`` (a 16-bit-held weight) itself;
anything else goes to the Python op. llama-small float32 capped at AVX2, one stream: ~32 products a step.

``tierlm_native::paged_attention`` does the same for a decode-only step's attention (cpu_decode_step.py): the step's
DecodeStep is planned before the compiled step runs and handed over (``decode_attention``), and each layer's call
runs cpu_paged_decode's ``paged_decode_step`` itself with those arguments; extends, mixed steps, sliding windows,
sinks and fp8 pages go to ``tierlm::paged_attention``, the Python op (the same C function or the general path).
In the server, alternated: llama-small bf16 one stream 4.41 -> 4.18 ms a step (median of 1000), the Qwen2.5-0.5B
shape at 8 streams 49.3 -> 48.1 ms. ``TIERLM_CPU_ATTENTION_OP=0`` keeps the Python op.

``tierlm_native::blocked_attention`` splits the blocked prefill attention's one-pass kernel
(cpu_blocked_scores.py) between torch's own OpenMP threads (at::parallel_for; the library is built with -fopenmp
and uses the libgomp torch loaded): Python helper threads lost their cores to the OpenMP workers that spin between
torch's parallel ops. A 2016-token llama-small layer's attention on two threads: 27.1 -> 15.9 ms.

Without a C++ compiler or torch's headers, or with ``TIERLM_CPU_PRODUCT_OP=0``, the Python op serves (logged, and
in /server_info's compile stats).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import weakref
from pathlib import Path
from typing import Iterator

import torch

from tierlm.backends.torch import (c_kernel_build, cpu_avx512_linear, cpu_blocked_scores, cpu_decode_step,
                                   cpu_f32_gemv, cpu_linear, cpu_paged_decode)
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.platforms.cpu_features import CpuFeatures

log = logging.getLogger(__name__)

ENV = "TIERLM_CPU_PRODUCT_OP"
ATTENTION_ENV = "TIERLM_CPU_ATTENTION_OP"  # 0: compiled decode steps call the attention through the Python op
_NAME = "product_op"
_FALLBACK = "compiled steps call the products through the Python op"

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace {

// the two kernels' signatures (cpu_avx512_linear.py: with the K chunk; cpu_amx_linear.py: without)
using ChunkedKernel = void (*)(const void *, long, long, long, const void *, const void *, void *, long, long, long,
                               long);
using PlainKernel = void (*)(const void *, long, long, long, const void *, const void *, void *, long, long, long);
using Product = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, int64_t,
                           int64_t);

void *kernel = nullptr;
int64_t block = 0;
std::atomic<int64_t> served{0};  // products this op ran itself (tests)
bool chunked = false;
std::mutex chunks_lock;
std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> chunks;  // (K, threads) -> K chunk by row count

constexpr int64_t kMinWeightsPerThread = 1 << 20;  // onednn_packed_weight.MIN_WEIGHTS_PER_THREAD
constexpr int64_t kKMultiple = 32;                 // onednn_packed_weight.K_MULTIPLE

at::Tensor python_op(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t n,
                     int64_t fast_rows) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::packed_linear", "").typed<Product>();
    return op.call(x, w, bias, n, fast_rows);
}

int64_t chunk_for(int64_t k, int64_t threads, int64_t rows) {
    std::lock_guard<std::mutex> guard(chunks_lock);
    const auto it = chunks.find({k, threads});
    return it == chunks.end() || rows >= (int64_t)it->second.size() ? 0 : it->second[rows];
}

at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t n,
                         int64_t fast_rows) {
    if (kernel == nullptr || fast_rows <= 0 || x.scalar_type() != at::kBFloat16 || x.layout() != at::kStrided ||
        x.device().type() != c10::DeviceType::CPU || x.dim() < 1 || n <= 0)
        return python_op(x, w, bias, n, fast_rows);
    const int64_t k = x.size(-1), numel = x.numel();
    if (k <= 0 || k % kKMultiple || numel == 0 || numel > fast_rows * k)
        return python_op(x, w, bias, n, fast_rows);
    if (bias.has_value() && (bias->scalar_type() != at::kBFloat16 || !bias->is_contiguous() || bias->numel() != n))
        return python_op(x, w, bias, n, fast_rows);
    const int64_t blocks = (n + block - 1) / block, threads = at::get_num_threads();
    if (std::min({threads, n * k / kMinWeightsPerThread, blocks}) > 1)  // the Python op splits it between threads
        return python_op(x, w, bias, n, fast_rows);
    const int64_t rows = numel / k;
    const int64_t kc = chunked ? chunk_for(k, threads, rows) : 0;
    if (chunked && kc == 0)
        return python_op(x, w, bias, n, fast_rows);
    static auto nbytes_op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "")
                                .typed<int64_t(const at::Tensor &)>();
    static auto address_op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "")
                                 .typed<int64_t(const at::Tensor &)>();
    const int64_t n_pad = blocks * block, nbytes = nbytes_op.call(w);
    if (nbytes % (2 * n_pad) || nbytes / (2 * n_pad) != k)  // not this width: oneDNN says what is wrong
        return python_op(x, w, bias, n, fast_rows);
    // rows read in place where they sit a fixed stride apart (onednn_packed_weight.rows_in_place)
    at::Tensor xr = x;
    int64_t lda = k;
    if (!x.is_contiguous()) {
        if (x.stride(-1) == 1 && (x.dim() == 2 || (x.dim() == 3 && (x.size(0) == 1 ||
                                                                     x.stride(0) == x.size(1) * x.stride(1)))))
            lda = x.stride(-2);
        else
            xr = x.contiguous();
    }
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options());
    const void *weights = reinterpret_cast<const void *>(address_op.call(w));
    const void *b = bias.has_value() ? bias->data_ptr() : nullptr;
    if (chunked)
        reinterpret_cast<ChunkedKernel>(kernel)(xr.data_ptr(), rows, k, lda, weights, b, y.data_ptr(), n, kc, 0,
                                                blocks);
    else
        reinterpret_cast<PlainKernel>(kernel)(xr.data_ptr(), rows, k, lda, weights, b, y.data_ptr(), n, 0, blocks);
    served.fetch_add(1, std::memory_order_relaxed);
    return y;
}

// float32 products (cpu_f32_gemv.py): its kernel's three entries, f32_linear(x, M, K, w, bias, y, N, n0, n1) for a
// float32 weight and f32_linear_bf16w / f32_linear_f16w for a bf16- / fp16-held one; only in decode steps (set
// per step from Python)
using F32Kernel = void (*)(const float *, long, long, const void *, const float *, float *, long, long, long);
using F32Product = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &);
void *f32_kernel = nullptr;
void *bf16w_kernel = nullptr;
void *f16w_kernel = nullptr;
bool decode_step = false;
std::atomic<int64_t> f32_served{0};
constexpr int64_t kF32MaxRows = 8;  // cpu_f32_gemv.MAX_ROWS

at::Tensor f32_python_op(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::f32_linear", "").typed<F32Product>();
    return op.call(x, w, bias);
}

// cpu_f32_gemv.product's kernel case, one thread's share of work; anything else goes to the Python op (the same
// outputs bit for bit)
at::Tensor f32_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    const auto wt = w.scalar_type();
    void *kern = wt == at::kFloat ? f32_kernel : wt == at::kBFloat16 ? bf16w_kernel : wt == at::kHalf ? f16w_kernel
                                                                                                     : nullptr;
    if (!decode_step || kern == nullptr || x.scalar_type() != at::kFloat || x.layout() != at::kStrided ||
        x.device().type() != c10::DeviceType::CPU || x.dim() < 1 || !x.is_contiguous() || w.dim() != 2 ||
        !w.is_contiguous() || w.device().type() != c10::DeviceType::CPU)
        return f32_python_op(x, w, bias);
    const int64_t k = x.size(-1), n = w.size(0), numel = x.numel();
    if (k <= 0 || w.size(1) != k || numel == 0 || numel > kF32MaxRows * k)
        return f32_python_op(x, w, bias);
    if (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->is_contiguous() || bias->numel() != n))
        return f32_python_op(x, w, bias);
    if (std::min<int64_t>(at::get_num_threads(), n * k / kMinWeightsPerThread) > 1)  // the Python op splits it
        return f32_python_op(x, w, bias);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options());
    const float *b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    reinterpret_cast<F32Kernel>(kern)(x.data_ptr<float>(), numel / k, k, w.data_ptr(), b, y.data_ptr<float>(), n, 0,
                                      n);
    f32_served.fetch_add(1, std::memory_order_relaxed);
    return y;
}

void set_f32_kernels(int64_t f32_address, int64_t bf16w_address, int64_t f16w_address) {
    f32_kernel = reinterpret_cast<void *>(f32_address);
    bf16w_kernel = reinterpret_cast<void *>(bf16w_address);
    f16w_kernel = reinterpret_cast<void *>(f16w_address);
}

void set_product_kernel(int64_t address, int64_t block_columns, bool takes_chunk) {
    block = block_columns;
    chunked = takes_chunk;
    kernel = reinterpret_cast<void *>(address);
}

void set_chunks(int64_t k, int64_t threads, std::vector<int64_t> by_rows) {
    std::lock_guard<std::mutex> guard(chunks_lock);
    chunks[{k, threads}] = std::move(by_rows);
}

// A decode-only step's attention (cpu_decode_step.py): paged_decode_step (cpu_paged_decode.py) with the step's fixed
// arguments, handed over from Python before the compiled step runs and taken back after it; the K/V pool's layer
// addresses, handed over when the pool changes. Anything else goes to the Python op (the same function: the same
// bytes in the pool and the same outputs).
using DecodeStepKernel = void (*)(const void *, long, long, const void *, long, long, const void *, long, long,
                                  const int64_t *, void *, void *, const int32_t *, int, const int32_t *, int, int,
                                  int, int, int, float, void *, float *, int, int);
using Attention = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, double, int64_t,
                             const std::optional<at::Tensor> &);
void *attention_kernel = nullptr;
// per thread: the step is handed over, run and taken back on the thread that runs it (the scheduler's), so two
// backends stepping on two threads never read each other's
thread_local std::vector<int64_t> k_layers, v_layers;
struct AttentionStep {
    bool active = false;
    const int64_t *slots = nullptr;
    const int32_t *table = nullptr;
    int table_stride = 0;
    const int32_t *kv_lens = nullptr;
    int R = 0, H = 0, Hkv = 0, D = 0, page_size = 0;
    float *work = nullptr;
    int max_len = 0;
    bool bf16 = false;
};
thread_local AttentionStep step;
std::atomic<int64_t> attention_served{0};

at::Tensor attention_python_op(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                               double scaling, int64_t window, const std::optional<at::Tensor> &s_aux) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::paged_attention", "").typed<Attention>();
    return op.call(q, k, v, layer, scaling, window, s_aux);
}

// q [1, H, R, D], k/v [1, Hkv, R, D] of the step's dtype on CPU, each head's D values contiguous (DecodeStep.fits)
bool fits(const at::Tensor &t, int heads) {
    return t.dim() == 4 && t.size(0) == 1 && t.size(1) == heads && t.size(2) == step.R && t.size(3) == step.D &&
           t.stride(3) == 1 && t.layout() == at::kStrided && t.device().type() == c10::DeviceType::CPU &&
           t.scalar_type() == (step.bf16 ? at::kBFloat16 : at::kFloat);
}

at::Tensor paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                           double scaling, int64_t window, const std::optional<at::Tensor> &s_aux) {
    if (!step.active || attention_kernel == nullptr || window != 0 || s_aux.has_value() || layer < 0 ||
        layer >= (int64_t)k_layers.size() || !fits(q, step.H) || !fits(k, step.Hkv) || !fits(v, step.Hkv))
        return attention_python_op(q, k, v, layer, scaling, window, s_aux);
    at::Tensor out = at::empty({1, step.R, step.H, step.D}, q.options());
    reinterpret_cast<DecodeStepKernel>(attention_kernel)(
        q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), k.stride(2), k.stride(1), v.data_ptr(), v.stride(2),
        v.stride(1), step.slots, reinterpret_cast<void *>(k_layers[layer]), reinterpret_cast<void *>(v_layers[layer]),
        step.table, step.table_stride, step.kv_lens, step.R, step.H, step.Hkv, step.D, step.page_size, (float)scaling,
        out.data_ptr(), step.work, step.max_len, step.bf16 ? 1 : 0);
    attention_served.fetch_add(1, std::memory_order_relaxed);
    return out;
}

void set_attention_step(int64_t slots, int64_t table, int64_t table_stride, int64_t kv_lens, int64_t R, int64_t H,
                        int64_t Hkv, int64_t D, int64_t page_size, int64_t work, int64_t max_len, bool bf16) {
    step.slots = reinterpret_cast<const int64_t *>(slots);
    step.table = reinterpret_cast<const int32_t *>(table);
    step.table_stride = (int)table_stride;
    step.kv_lens = reinterpret_cast<const int32_t *>(kv_lens);
    step.R = (int)R, step.H = (int)H, step.Hkv = (int)Hkv, step.D = (int)D, step.page_size = (int)page_size;
    step.work = reinterpret_cast<float *>(work);
    step.max_len = (int)max_len;
    step.bf16 = bf16;
    step.active = true;
}

// The blocked prefill attention's one-pass kernel (cpu_blocked_scores.py) split between torch's own intra-op
// threads: Python helper threads lost their cores to the OpenMP workers that spin between torch's parallel ops.
using BlockKernel = void (*)(const void *, const void *, const void *, void *, int, int, int, int, int, int, int,
                             const int32_t *, int, int, float, float *);
void *block_kernel = nullptr;

void blocked_attention(const at::Tensor &qb, const at::Tensor &kp, const at::Tensor &vp, const at::Tensor &out,
                       const at::Tensor &limits, int64_t E, int64_t Hkv, double scale, const at::Tensor &work,
                       int64_t grain) {
    TORCH_CHECK(block_kernel != nullptr, "tierlm_native::blocked_attention: no kernel was handed over");
    TORCH_CHECK(qb.is_contiguous() && kp.is_contiguous() && vp.is_contiguous() && out.is_contiguous() &&
                limits.is_contiguous() && work.is_contiguous() && work.size(0) >= at::get_num_threads(),
                "tierlm_native::blocked_attention: layout");
    const int B = (int)qb.size(0), M = (int)qb.size(1), D = (int)qb.size(2), Lp = (int)kp.size(2);
    const int b = (int)limits.size(1);
    const int64_t row_block = 4, slices = (M + row_block - 1) / row_block;  // the kernel's BS_QR
    const auto fn = reinterpret_cast<BlockKernel>(block_kernel);
    at::parallel_for(0, slices, std::max<int64_t>(1, grain), [&](int64_t s0, int64_t s1) {
        float *w = work.data_ptr<float>() + at::get_thread_num() * work.size(1);
        fn(qb.data_ptr(), kp.data_ptr(), vp.data_ptr(), out.data_ptr(), B, M,
           (int)std::min<int64_t>(M, s0 * row_block), (int)std::min<int64_t>(M, s1 * row_block), D, Lp, (int)E,
           limits.data_ptr<int32_t>(), (int)Hkv, b, (float)scale, w);
    });
}

}  // namespace

TORCH_LIBRARY(tierlm_native, m) {
    m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, int fast_rows) -> Tensor");
    m.def("set_product_kernel(int address, int block, bool chunked) -> ()", &set_product_kernel);
    m.def("set_chunks(int k, int threads, int[] by_rows) -> ()", &set_chunks);
    m.def("served() -> int", [] { return served.load(); });
    m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("set_f32_kernels(int f32, int bf16w, int f16w) -> ()", &set_f32_kernels);
    m.def("set_decode_step(bool decode) -> ()", [](bool decode) { decode_step = decode; });
    m.def("f32_served() -> int", [] { return f32_served.load(); });
    m.def("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, "
          "Tensor? s_aux) -> Tensor");
    m.def("set_attention_kernel(int address) -> ()", [](int64_t a) { attention_kernel = reinterpret_cast<void *>(a); });
    m.def("set_attention_pool(int[] k_layers, int[] v_layers) -> ()",
          [](std::vector<int64_t> k, std::vector<int64_t> v) {
              k_layers = std::move(k);
              v_layers = std::move(v);
          });
    m.def("set_attention_step(int slots, int table, int table_stride, int kv_lens, int R, int H, int Hkv, int D, "
          "int page_size, int work, int max_len, bool bf16) -> ()", &set_attention_step);
    m.def("clear_attention_step() -> ()", [] { step.active = false; });
    m.def("attention_served() -> int", [] { return attention_served.load(); });
    m.def("set_block_kernel(int address) -> ()", [](int64_t a) { block_kernel = reinterpret_cast<void *>(a); });
    m.def("blocked_attention(Tensor qb, Tensor kp, Tensor vp, Tensor(a!) out, Tensor limits, int E, int Hkv, "
          "float scale, Tensor(b!) work, int grain) -> ()", &blocked_attention);
}

TORCH_LIBRARY_IMPL(tierlm_native, CompositeExplicitAutograd, m) {
    m.impl("packed_linear", &packed_linear);
    m.impl("f32_linear", &f32_linear);
    m.impl("paged_attention", &paged_attention);
}
"""


def find_cxx_compiler(env) -> str | None:
    """$CXX, else c++, g++, clang++ (None: none installed)."""
    return next((c for c in (env.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)


def _build(cxx: str, cache_dir: Path) -> Path:
    """The library's path, compiled first when the cache does not hold it (keyed by the source, the compiler, torch
    and its headers' ABI). C++20 as torch's own build, else C++17 (older compilers: torch's headers still build)."""
    from torch.utils import cpp_extension

    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for (blocked_attention) runs on torch's OpenMP threads; the library links libgomp.so.1,
    # which resolves to the copy torch loaded (its rpath), so there is one OpenMP runtime in the process
    flags = ["-O2", "-fPIC", "-shared", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    libs = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    key = "\0".join((_SOURCE, c_kernel_build.compiler_identity(cxx), torch.__version__, torch_lib, " ".join(flags)))
    path = cache_dir / f"{_NAME}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"

    def build(folder: Path, built: Path) -> None:
        src = folder / f"{_NAME}.cpp"
        src.write_text(_SOURCE)
        for std in ("-std=c++20", "-std=c++17"):
            try:
                subprocess.run([cxx, std, *flags, str(src), "-o", str(built), *libs], check=True,
                               capture_output=True, timeout=300)
                return
            except subprocess.CalledProcessError:
                if std == "-std=c++17":
                    raise

    return c_kernel_build.build_into_cache(path, build)


def _load(cpu: CpuFeatures) -> KernelBuild:
    if os.environ.get(ENV, "1") == "0":
        return KernelBuild(None, None, f"off ({ENV}=0); {_FALLBACK}")
    kernel = cpu_linear.decode_kernel()
    if kernel is None and cpu_f32_gemv.load(cpu) is None:
        return KernelBuild(None, None, f"no decode-product kernel runs here; {_FALLBACK}")
    cxx = find_cxx_compiler(os.environ)
    if cxx is None:
        return KernelBuild(None, None, f"no C++ compiler (c++/g++/clang++); {_FALLBACK}")
    from torch.utils import cpp_extension

    if not any((Path(p) / "torch" / "library.h").exists() for p in cpp_extension.include_paths()):
        return KernelBuild(None, None, f"this torch has no C++ headers; {_FALLBACK}")
    try:
        path = _build(cxx, default_cache_dir())
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-300:]
        return KernelBuild(None, None, f"could not build it ({e} {detail}); {_FALLBACK}")
    # once per process: a second TORCH_LIBRARY of the namespace (a reload, another cache folder) would fail
    if not hasattr(torch.ops.tierlm_native, "packed_linear"):
        torch.ops.load_library(str(path))
        torch.library.register_fake("tierlm_native::packed_linear")(
            lambda x, packed_weight, bias, out_features, fast_rows: x.new_empty((*x.shape[:-1], out_features)))
        torch.library.register_fake("tierlm_native::f32_linear")(
            lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))
        torch.library.register_fake("tierlm_native::paged_attention")(
            lambda query, key, value, layer, scaling, sliding_window, s_aux:
            query.new_empty((1, query.shape[2], query.shape[1], query.shape[3])))
    named = f"the {kernel.NAME} kernel" if kernel is not None else "the float32 decode-product kernel"
    if kernel is not None:
        chunked = kernel is cpu_avx512_linear
        fn = kernel.load().avx512_linear_bf16 if chunked else kernel.load().amx_linear_bf16
        torch.ops.tierlm_native.set_product_kernel(ctypes.cast(fn, ctypes.c_void_p).value, kernel.BLOCK, chunked)
    # the float32 kernel is handed over by ready() to a model that has its layers (built for them, not here)
    # LoadOnce keeps ``lib`` as "it loaded": the library lives in torch.ops, not in a ctypes handle
    return KernelBuild(True, cpu.level, f"{named} called from C++, built with {cxx}: {path}")


_op = c_kernel_build.LoadOnce(_load, "CPU compiled-step products", _FALLBACK, warn_when_missing=False)


def ready(model: torch.nn.Module) -> tuple[bool, str]:
    """(whether the C++ op serves ``model``'s kernel products in compiled steps, why): built and loaded once per
    process, then handed the float32 kernel where the model has its layers, and the chunk table of each of the
    model's packed widths at the current thread count."""
    packed = any(isinstance(m, cpu_linear.PackedLinear) and m.fast_rows for m in model.modules())
    f32 = any(isinstance(m, cpu_f32_gemv.F32GemvLinear) for m in model.modules())
    if not packed and not f32:
        return False, "no product of this model runs on tierlm's decode-product kernels"
    if _op() is None:
        return False, _op.build.why
    f32_lib = cpu_f32_gemv.load() if f32 else None  # loaded: the model got its layers where it did
    if f32_lib is not None:
        torch.ops.tierlm_native.set_f32_kernels(*(ctypes.cast(fn, ctypes.c_void_p).value for fn in (
            f32_lib.f32_linear, f32_lib.f32_linear_bf16w, f32_lib.f32_linear_f16w)))
        cpu_f32_gemv.on_decode_step(torch.ops.tierlm_native.set_decode_step)  # the op reads the step's kind
    _ATTENTION["ready"] = _hand_attention_kernel()
    _hand_block_kernel()
    if packed and cpu_linear.decode_kernel() is cpu_avx512_linear:
        threads = torch.get_num_threads()
        for k in sorted({m.in_features for m in model.modules()
                         if isinstance(m, cpu_linear.PackedLinear) and m.fast_rows}):
            torch.ops.tierlm_native.set_chunks(k, threads, list(cpu_avx512_linear.chunk_sizes(k, threads)))
    return True, _op.build.why


def _hand_attention_kernel() -> bool:
    """Give the C++ attention op cpu_paged_decode's ``paged_decode_step`` (where that library loads and the op is not
    switched off); whether it has it."""
    if os.environ.get(ATTENTION_ENV, "1") == "0":
        return False
    lib = cpu_paged_decode.load()
    if lib is None:
        return False
    torch.ops.tierlm_native.set_attention_kernel(ctypes.cast(lib.paged_decode_step, ctypes.c_void_p).value)
    return True


def _hand_block_kernel() -> None:
    """Give the C++ op cpu_paged_decode's ``blocked_attention_rows_bf16`` (an AVX512-BF16 build), and
    cpu_blocked_scores the op, which splits it between torch's own threads."""
    lib = cpu_paged_decode.load()
    if lib is None or not hasattr(lib, "blocked_attention_rows_bf16"):
        return
    torch.ops.tierlm_native.set_block_kernel(ctypes.cast(lib.blocked_attention_rows_bf16, ctypes.c_void_p).value)
    cpu_blocked_scores.use_torch_threads(torch.ops.tierlm_native.blocked_attention)


# whether compiled steps record the C++ attention op (decided by ready(), before any trace)
_ATTENTION: dict = {"ready": False}
# per thread, as the op's own state: the pool whose layer addresses the op holds (a weak reference: a pool is never
# kept alive for this)
_HANDED = threading.local()


def attention_loaded() -> bool:
    """Whether compiled steps call ``tierlm_native::paged_attention`` (ready() decided it)."""
    return loaded() and _ATTENTION["ready"]


@contextlib.contextmanager
def decode_attention(meta, pool, heads: int, head_dim: int, dtype: torch.dtype, device_type: str) -> Iterator[None]:
    """While a compiled decode-only step runs, its DecodeStep (cpu_decode_step.py, planned here before the first
    layer) is handed to the C++ attention op, which runs each layer's ``paged_decode_step`` with no Python in
    between (~25 us a layer through the Python op: ~3 % of a llama-small one-stream step); taken back after. Other
    steps (extends, mixed, fp8 pages, windows) leave the op to the Python path."""
    step = None
    if attention_loaded() and meta.decode_rows is not None:
        if meta.decode_step is False:
            meta.decode_step = cpu_decode_step.plan_for(meta, pool, heads, head_dim, dtype, device_type)
        step = meta.decode_step
    if step is None:
        yield
        return
    held = getattr(_HANDED, "pool", None)
    if held is None or held() is not pool:
        torch.ops.tierlm_native.set_attention_pool(*(list(p) for p in pool.layer_pointers()))
        _HANDED.pool = weakref.ref(pool)
    torch.ops.tierlm_native.set_attention_step(*step.native_args())
    try:
        yield
    finally:
        torch.ops.tierlm_native.clear_attention_step()


def attention_served() -> int:
    """Layers the C++ attention op has run itself in this process (not handed to the Python op)."""
    return int(torch.ops.tierlm_native.attention_served()) if loaded() else 0


def loaded() -> bool:
    """Whether ``tierlm_native::packed_linear`` exists in this process (``ready`` loads it)."""
    return _op.lib is not None


def served() -> int:
    """Products the C++ op has run itself in this process (not handed to the Python op): packed bf16 and float32."""
    return int(torch.ops.tierlm_native.served()) + int(torch.ops.tierlm_native.f32_served()) if loaded() else 0


def describe() -> dict[str, str | None]:
    """The op as loaded (for /server_info and doctor): the level and why, or why not."""
    return _op.describe()
