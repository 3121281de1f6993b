// The compiled decode step's kernel calls as torch operators (backends/torch/cpu/native_ops.py): inductor's C++
// wrapper calls them through the dispatcher, and they call this library's kernels (kernels.h) with no Python in
// between. Each serves the common case itself and hands anything else to tierlm's Python op of the same name
// (backends/torch/ops.py), so the outputs are the Python path's bit for bit in every case.
//
// - packed_linear: bf16 rows (at most the weight's fast_rows) over oneDNN's packed weight, one thread's share of work
//   (the rule of onednn_packed_weight.run_in_block_slices): avx512_linear.c with the weight's K chunk for the row
//   count (block 64), or amx_linear.c (block 32); the weight's address and size from oneDNN's own ops.
// - f32_linear: 1..8 float32 rows of a decode step (the step record's DECODE field) on f32_gemv.c.
// - paged_attention: a decode-only step's layer (the step record's ATTENTION fields) on paged_decode_step.
// - blocked_attention: the one-pass blocked prefill attention (blocked_attention.c) split between torch's own OpenMP
//   threads (at::parallel_for: Python helper threads lost their cores to the OpenMP workers that spin between
//   torch's parallel ops).
//
// Per-weight facts (the kernel's block, its K chunks) and per-step state (the step record, step_record.h) arrive as
// op arguments; the ops keep no state but the counters of what they served.
#include "kernels.h"
#include "step_record.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <vector>

namespace {

using Product = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, int64_t,
                           int64_t, int64_t);

std::atomic<int64_t> packed_served{0}, f32_served{0}, attention_served{0};  // what the ops ran themselves (tests)

constexpr int64_t kMinWeightsPerThread = 1 << 20;  // onednn_packed_weight.MIN_WEIGHTS_PER_THREAD
constexpr int64_t kKMultiple = 32;                 // onednn_packed_weight.K_MULTIPLE
constexpr int64_t kF32MaxRows = 8;                 // f32_gemv.MAX_ROWS
constexpr int64_t kBlockRows = 4;                  // blocked_one_pass.ROWS (blocked_attention.c's BS_QR)

at::Tensor python_packed_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias,
                                int64_t n, int64_t fast_rows, int64_t block) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::packed_linear", "").typed<Product>();
    return op.call(x, w, bias, n, fast_rows, block);
}

// block: the packed weight's column block, which names its kernel (64: avx512_linear, 32: amx_linear, 0: none);
// k_chunks (avx512_linear): [the intra-op thread count they were probed at, the K chunk for 1 row, ..., for 32]
at::Tensor op_packed_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t n,
                         int64_t fast_rows, int64_t block, at::IntArrayRef k_chunks) {
    const tierlm_kernel_table *kernels = tierlm_kernels();
    const bool chunked = block == 64 && kernels->avx512_linear != nullptr;
    const bool tiles = block == 32 && kernels->amx_linear != nullptr;
    if (!(chunked || tiles) || fast_rows <= 0 || x.scalar_type() != at::kBFloat16 || x.layout() != at::kStrided ||
        x.device().type() != c10::DeviceType::CPU || x.dim() < 1 || n <= 0)
        return python_packed_linear(x, w, bias, n, fast_rows, block);
    const int64_t k = x.size(-1), numel = x.numel();
    if (k <= 0 || k % kKMultiple || numel == 0 || numel > fast_rows * k)
        return python_packed_linear(x, w, bias, n, fast_rows, block);
    if (bias.has_value() && (bias->scalar_type() != at::kBFloat16 || !bias->is_contiguous() || bias->numel() != n))
        return python_packed_linear(x, w, bias, n, fast_rows, block);
    const int64_t blocks = (n + block - 1) / block, threads = at::get_num_threads();
    if (std::min({threads, n * k / kMinWeightsPerThread, blocks}) > 1)  // the Python op splits it between threads
        return python_packed_linear(x, w, bias, n, fast_rows, block);
    const int64_t rows = numel / k;
    int64_t kc = 0;
    if (chunked) {
        if (k_chunks.empty() || k_chunks[0] != threads || rows >= (int64_t)k_chunks.size() || k_chunks[rows] == 0)
            return python_packed_linear(x, w, bias, n, fast_rows, block);
        kc = k_chunks[rows];
    }
    static auto nbytes_op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "")
                                .typed<int64_t(const at::Tensor &)>();
    static auto address_op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "")
                                 .typed<int64_t(const at::Tensor &)>();
    const int64_t n_pad = blocks * block, nbytes = nbytes_op.call(w);
    if (nbytes % (2 * n_pad) || nbytes / (2 * n_pad) != k)  // not this width: oneDNN says what is wrong
        return python_packed_linear(x, w, bias, n, fast_rows, block);
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
    const auto *weights = reinterpret_cast<const uint16_t *>(address_op.call(w));
    const auto *b = bias.has_value() ? static_cast<const uint16_t *>(bias->data_ptr()) : nullptr;
    const auto *xp = static_cast<const uint16_t *>(xr.data_ptr());
    auto *yp = static_cast<uint16_t *>(y.data_ptr());
    if (chunked)
        kernels->avx512_linear(xp, rows, k, lda, weights, b, yp, n, kc, 0, blocks);
    else
        kernels->amx_linear(xp, rows, k, lda, weights, b, yp, n, 0, blocks);
    packed_served.fetch_add(1, std::memory_order_relaxed);
    return y;
}

// The step record as an op argument: an int64 CPU tensor of at least the fields step_record.h names
const int64_t *step_fields(const at::Tensor &step) {
    TORCH_CHECK(step.scalar_type() == at::kLong && step.device().type() == c10::DeviceType::CPU &&
                    step.is_contiguous() && step.numel() >= TIERLM_STEP_FIELDS,
                "tierlm_native: the step record must be a contiguous int64 CPU tensor of ", TIERLM_STEP_FIELDS,
                " fields (backends/torch/cpu/step_record.py)");
    return step.data_ptr<int64_t>();
}

using F32Product = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &);

at::Tensor python_f32_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::f32_linear", "").typed<F32Product>();
    return op.call(x, w, bias);
}

// f32_gemv.product's kernel case in a decode step, one thread's share of work; anything else goes to the Python op
// (the same outputs bit for bit)
at::Tensor op_f32_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias,
                      const at::Tensor &step) {
    const tierlm_kernel_table *kernels = tierlm_kernels();
    const auto wt = w.scalar_type();
    const auto kern = wt == at::kFloat ? kernels->f32 : nullptr;
    const auto held = wt == at::kBFloat16 ? kernels->f32_bf16w : wt == at::kHalf ? kernels->f32_f16w : nullptr;
    if (step_fields(step)[TIERLM_STEP_decode] != 1 || (kern == nullptr && held == nullptr) ||
        x.scalar_type() != at::kFloat || x.layout() != at::kStrided || x.device().type() != c10::DeviceType::CPU ||
        x.dim() < 1 || !x.is_contiguous() || w.dim() != 2 || !w.is_contiguous() ||
        w.device().type() != c10::DeviceType::CPU)
        return python_f32_linear(x, w, bias);
    const int64_t k = x.size(-1), n = w.size(0), numel = x.numel();
    if (k <= 0 || w.size(1) != k || numel == 0 || numel > kF32MaxRows * k)
        return python_f32_linear(x, w, bias);
    if (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->is_contiguous() || bias->numel() != n))
        return python_f32_linear(x, w, bias);
    if (std::min<int64_t>(at::get_num_threads(), n * k / kMinWeightsPerThread) > 1)  // the Python op splits it
        return python_f32_linear(x, w, bias);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options());
    const float *b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    if (kern != nullptr)
        kern(x.data_ptr<float>(), numel / k, k, w.data_ptr<float>(), b, y.data_ptr<float>(), n, 0, n);
    else
        held(x.data_ptr<float>(), numel / k, k, static_cast<const uint16_t *>(w.data_ptr()), b, y.data_ptr<float>(),
             n, 0, n);
    f32_served.fetch_add(1, std::memory_order_relaxed);
    return y;
}

using Attention = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, double, int64_t,
                             const std::optional<at::Tensor> &);

at::Tensor python_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                            double scaling, int64_t window, const std::optional<at::Tensor> &s_aux) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tierlm::paged_attention", "").typed<Attention>();
    return op.call(q, k, v, layer, scaling, window, s_aux);
}

// q [1, H, R, D], k/v [1, Hkv, R, D] of the step's dtype on CPU, each head's D values contiguous (DecodeStep.fits)
bool fits(const at::Tensor &t, const int64_t *s, int64_t heads) {
    return t.dim() == 4 && t.size(0) == 1 && t.size(1) == heads && t.size(2) == s[TIERLM_STEP_rows] &&
           t.size(3) == s[TIERLM_STEP_head_dim] && t.stride(3) == 1 && t.layout() == at::kStrided &&
           t.device().type() == c10::DeviceType::CPU &&
           t.scalar_type() == (s[TIERLM_STEP_bf16] ? at::kBFloat16 : at::kFloat);
}

// A decode-only step's layer: paged_decode_step (paged_decode.c) with the step's arguments from the step record;
// anything else goes to the Python op (the same function: the same bytes in the pool and the same outputs)
at::Tensor op_paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                           double scaling, int64_t window, const std::optional<at::Tensor> &s_aux,
                           const at::Tensor &step) {
    const int64_t *s = step_fields(step);
    if (s[TIERLM_STEP_attention] != 1 || window != 0 || s_aux.has_value() || layer < 0 ||
        layer >= s[TIERLM_STEP_layers] || !fits(q, s, s[TIERLM_STEP_heads]) || !fits(k, s, s[TIERLM_STEP_kv_heads]) ||
        !fits(v, s, s[TIERLM_STEP_kv_heads]))
        return python_attention(q, k, v, layer, scaling, window, s_aux);
    const int R = (int)s[TIERLM_STEP_rows], H = (int)s[TIERLM_STEP_heads], D = (int)s[TIERLM_STEP_head_dim];
    const auto *k_layers = reinterpret_cast<const int64_t *>(s[TIERLM_STEP_k_layers]);
    const auto *v_layers = reinterpret_cast<const int64_t *>(s[TIERLM_STEP_v_layers]);
    at::Tensor out = at::empty({1, R, H, D}, q.options());
    tierlm_kernels()->decode_step(
        q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), k.stride(2), k.stride(1), v.data_ptr(), v.stride(2),
        v.stride(1), reinterpret_cast<const int64_t *>(s[TIERLM_STEP_slots]),
        reinterpret_cast<void *>(k_layers[layer]), reinterpret_cast<void *>(v_layers[layer]),
        reinterpret_cast<const int32_t *>(s[TIERLM_STEP_table]), (int)s[TIERLM_STEP_table_stride],
        reinterpret_cast<const int32_t *>(s[TIERLM_STEP_kv_lens]), R, H, (int)s[TIERLM_STEP_kv_heads], D,
        (int)s[TIERLM_STEP_page_size], (float)scaling, out.data_ptr(), reinterpret_cast<float *>(s[TIERLM_STEP_work]),
        (int)s[TIERLM_STEP_max_len], (int)s[TIERLM_STEP_bf16]);
    attention_served.fetch_add(1, std::memory_order_relaxed);
    return out;
}

// The one-pass blocked prefill attention (blocked_attention.c) over the query rows of qb [B, M, D], split in slices
// of whole row blocks between torch's intra-op threads; work [threads, floats] float32 scratch
void op_blocked_attention(const at::Tensor &qb, const at::Tensor &kp, const at::Tensor &vp, const at::Tensor &out,
                       const at::Tensor &limits, int64_t E, int64_t Hkv, double scale, const at::Tensor &work,
                       int64_t grain) {
    const auto fn = tierlm_kernels()->blocked_rows_bf16;
    TORCH_CHECK(fn != nullptr, "tierlm_native::blocked_attention: this library's level (", tierlm_library_level(),
                ") has no AVX512-BF16 block kernel");
    TORCH_CHECK(qb.dim() == 3 && kp.dim() == 3 && vp.dim() == 3 && limits.dim() == 2 && work.dim() == 2,
                "tierlm_native::blocked_attention: qb [B, M, D], kp [B, D/2, Lp], vp [B, Lp/2, D], limits [G, b], "
                "work [threads, floats]");
    TORCH_CHECK(qb.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                    kp.scalar_type() == at::kInt && vp.scalar_type() == at::kInt &&
                    limits.scalar_type() == at::kInt && work.scalar_type() == at::kFloat,
                "tierlm_native::blocked_attention: bf16 queries and output, int32 pairs and limits, float32 work");
    TORCH_CHECK(qb.is_contiguous() && kp.is_contiguous() && vp.is_contiguous() && out.is_contiguous() &&
                    limits.is_contiguous() && work.is_contiguous() && work.size(0) >= at::get_num_threads(),
                "tierlm_native::blocked_attention: layout");
    const int B = (int)qb.size(0), M = (int)qb.size(1), D = (int)qb.size(2), Lp = (int)kp.size(2);
    const int b = (int)limits.size(1);
    TORCH_CHECK(out.sizes() == qb.sizes() && D % 16 == 0 && kp.size(0) == B && kp.size(1) == D / 2 &&
                    vp.size(0) == B && vp.size(1) == Lp / 2 && vp.size(2) == D && Lp % 64 == 0 && E >= 1 && E <= Lp &&
                    Hkv >= 1 && B % Hkv == 0 && limits.size(0) >= B / Hkv && b >= 1 &&
                    work.size(1) >= (int64_t)(kBlockRows + kBlockRows / 2) * Lp,
                "tierlm_native::blocked_attention: shapes (blocked_one_pass.py makes them)");
    const int64_t slices = (M + kBlockRows - 1) / kBlockRows;
    at::parallel_for(0, slices, std::max<int64_t>(1, grain), [&](int64_t s0, int64_t s1) {
        float *w = work.data_ptr<float>() + at::get_thread_num() * work.size(1);
        fn(static_cast<const uint16_t *>(qb.data_ptr()), static_cast<const uint32_t *>(kp.data_ptr()),
           static_cast<const uint32_t *>(vp.data_ptr()), static_cast<uint16_t *>(out.data_ptr()), B, M,
           (int)std::min<int64_t>(M, s0 * kBlockRows), (int)std::min<int64_t>(M, s1 * kBlockRows), D, Lp, (int)E,
           limits.data_ptr<int32_t>(), (int)Hkv, b, (float)scale, w);
    });
}

std::vector<int64_t> served() { return {packed_served.load(), f32_served.load(), attention_served.load()}; }

}  // namespace

extern "C" int tierlm_register_torch_ops(void) {
    // Called through ctypes: nothing may escape as a C++ exception (it would end the process).
    static std::atomic<bool> registered{false};
    if (registered.load()) return -1;
    try {
        // Held for the life of the process, as TORCH_LIBRARY's static objects are: the ops stay registered.
        auto def = std::make_unique<torch::Library>(torch::Library::DEF, "tierlm_native", std::nullopt, __FILE__,
                                                    __LINE__);
        def->def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, int fast_rows, "
                 "int block, int[] k_chunks) -> Tensor");
        def->def("f32_linear(Tensor x, Tensor weight, Tensor? bias, Tensor step) -> Tensor");
        def->def("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, "
                 "int sliding_window, Tensor? s_aux, Tensor step) -> Tensor");
        def->def("blocked_attention(Tensor qb, Tensor kp, Tensor vp, Tensor(a!) out, Tensor limits, int E, int Hkv, "
                 "float scale, Tensor(b!) work, int grain) -> ()",
                 &op_blocked_attention);
        def->def("served() -> int[]", &served);
        auto impl = std::make_unique<torch::Library>(torch::Library::IMPL, "tierlm_native",
                                                     c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
        impl->impl("packed_linear", TORCH_FN(op_packed_linear));
        impl->impl("f32_linear", TORCH_FN(op_f32_linear));
        impl->impl("paged_attention", TORCH_FN(op_paged_attention));
        def.release();
        impl.release();
    } catch (const std::exception &e) {
        std::fprintf(stderr, "tierlm_native: the torch ops could not be registered: %s\n", e.what());
        return -2;
    }
    registered.store(true);
    return 0;
}

extern "C" const char *tierlm_step_record_fields(void) {
#define TIERLM_STEP_NAME(name) #name ","
    return TIERLM_STEP_RECORD(TIERLM_STEP_NAME);
#undef TIERLM_STEP_NAME
}
