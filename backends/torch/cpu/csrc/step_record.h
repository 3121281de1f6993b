/* The step record: a compiled step's per-step state, as the torch ops of torch_ops.cpp take it.

   One int64 CPU tensor per compiled model (backends/torch/cpu/step_record.py), passed by the compiled graph to
   tierlm_native::paged_attention and tierlm_native::f32_linear as an argument (bound once, like a weight); Python
   writes the step's fields into it before the step runs and clears DECODE and ATTENTION after. Addresses are those
   of tensors the Python side keeps alive for the step (the slots, the page rows, the lengths, the scratch) and of
   the KV pool's layers. */
#ifndef TIERLM_STEP_RECORD_H
#define TIERLM_STEP_RECORD_H

/* X(field): the fields in order; their names are what Python reads (tierlm_step_record_fields) */
#define TIERLM_STEP_RECORD(X)                                                                                       \
    X(decode)       /* 1: a decode-only step (every request one token): the float32 products may take the kernel */ \
    X(attention)    /* 1: the fields below hold the step's decode attention (paged_decode_step's arguments) */      \
    X(slots)        /* int64 [R]: each request's new K/V slot */                                                    \
    X(table)        /* int32 [R, table_stride]: each request's pages */                                             \
    X(table_stride)                                                                                                 \
    X(kv_lens)      /* int32 [R] */                                                                                 \
    X(rows)         /* R */                                                                                         \
    X(heads)        /* H */                                                                                         \
    X(kv_heads)     /* Hkv */                                                                                       \
    X(head_dim)     /* D */                                                                                         \
    X(page_size)                                                                                                    \
    X(work)         /* float32 scratch of paged_decode_step_floats(R, H, D, max_len) */                             \
    X(max_len)                                                                                                      \
    X(bf16)         /* 1: bf16 pages and queries, 0: float32 */                                                     \
    X(k_layers)     /* int64 [layers]: the address of each layer's K in the pool */                                 \
    X(v_layers)                                                                                                     \
    X(layers)

#define TIERLM_STEP_FIELD(name) TIERLM_STEP_##name,
enum { TIERLM_STEP_RECORD(TIERLM_STEP_FIELD) TIERLM_STEP_FIELDS };
#undef TIERLM_STEP_FIELD

#endif
