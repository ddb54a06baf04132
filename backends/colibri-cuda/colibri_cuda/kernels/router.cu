// The softmax router's choice, one block of ROUTER_THREADS threads per token:
// probabilities softmax(logits) over E experts (E <= ROUTER_MAX_EXPERTS), the k largest
// (largest first; of equal ones the lower index), renormalised to sum 1 when asked.
// out (T, 2, k) float32: row 0 the expert indices (exact: E < 2^24), row 1 their
// weights, so one copy brings both to the host.
#include "common.cuh"

#define ROUTER_THREADS 128
#define ROUTER_MAX_EXPERTS 4096

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
    softmax_top_k(const float* logits, float* out, int E, int k, int renormalise) {
    __shared__ float probs[ROUTER_MAX_EXPERTS];
    __shared__ float scratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (u64)blockIdx.x * E;
    float* chosen = out + (u64)blockIdx.x * 2 * k;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;

    float local_max = negative_infinity();
    for (int e = threadIdx.x; e < E; e += blockDim.x) local_max = fmaxf(local_max, row[e]);
    const float m = block_max(local_max, scratch);
    float local_sum = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        probs[e] = expf(row[e] - m);
        local_sum += probs[e];
    }
    const float total = block_sum(local_sum, scratch);
    for (int e = threadIdx.x; e < E; e += blockDim.x) probs[e] = probs[e] / total;
    __syncthreads();

    float kept = 0.0f;  // thread 0: the sum of the chosen probabilities
    for (int slot = 0; slot < k; ++slot) {
        // the largest remaining probability, the lower index among equals (taken ones are -1)
        float value = -1.0f;
        int index = E;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (probs[e] > value) { value = probs[e]; index = e; }  // ascending e: the first of equals stays
        for (int offset = WARP / 2; offset > 0; offset >>= 1) {
            const float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
            const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            if (other_value > value || (other_value == value && other_index < index)) {
                value = other_value;
                index = other_index;
            }
        }
        if (lane == 0) {
            best_value[warp] = value;
            best_index[warp] = index;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < warps; ++w)
                if (best_value[w] > value || (best_value[w] == value && best_index[w] < index)) {
                    value = best_value[w];
                    index = best_index[w];
                }
            chosen[slot] = (float)index;
            chosen[k + slot] = value;
            kept += value;
            if (index < E) probs[index] = -1.0f;  // index E: nothing left to choose (NaN logits)
        }
        __syncthreads();
    }
    if (renormalise && threadIdx.x == 0)
        for (int slot = 0; slot < k; ++slot) chosen[k + slot] = chosen[k + slot] / kept;
}
