/* The KV write of one layer on the CPU: each new token's K and V rows (all its KV heads, one
   contiguous run of Hkv * D elements in the qkv projection's output) copied into its cache
   slot. Replaces two index_copy_ calls (~50 us each for a decode batch, TensorIterator setup,
   whatever the size). Same dtype on both sides (no conversion); elements of `elt` bytes.

   k, v: token t's row at k + t * k_stride (elements); caches: [rows, Hkv * D] contiguous;
   slots: int64 [T], each in [0, n_slots). block 0: a slot is its row. block > 0: the caches
   hold blocks of `block` K rows then `block` V rows (v_cache = k_cache + block rows), as the
   vLLM backend keeps vLLM's cache: slot s (block s / block, row s % block) is row
   s + s / block * block; computed here, so a decode step's write is one call, not the torch
   ops of the mapping first. Returns 0, or -1 (nothing written) when a slot is out of range.
   Compiled into the attention kernel's library (kernels/cpu/build.py). */

#include <stdint.h>
#include <string.h>

int batchjob_write_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride,
                      void *k_cache, void *v_cache, const int64_t *slots, int64_t n_tokens,
                      int64_t n_slots, int64_t row, int64_t elt, int n_threads,
                      int64_t block) {
    for (int64_t t = 0; t < n_tokens; t++)
        if (slots[t] < 0 || slots[t] >= n_slots)
            return -1;
    const int64_t bytes = row * elt;
    /* a thread per core only where there is enough to copy (prefill chunks) */
    const int threads = n_tokens * bytes >= (1 << 20) ? n_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t r = block > 0 ? slots[t] + slots[t] / block * block : slots[t];
        memcpy((char *)k_cache + r * bytes, (const char *)k + t * k_stride * elt, bytes);
        memcpy((char *)v_cache + r * bytes, (const char *)v + t * v_stride * elt, bytes);
    }
    return 0;
}
