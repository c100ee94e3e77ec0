/*
 * gemm_ar: y = sum over ranks p of x_p @ w_p, on every rank (reference: lax.psum(x @ w, axis)).
 * The GEMM+RS kernels of gemm_rs.cuh (tiles reduce-added into the row owners' workspaces
 * while the GEMM runs) followed by a gather of every owner's rows: a fused reduce-scatter plus
 * an all-gather by peer loads, within one call.
 *
 * Shardings: x: [M, K/P], w: [K/P, N] per rank, y: [M, N], identical on every rank. Owner o
 * accumulates rows [o Mp, min((o+1) Mp, M)), Mp = ceil(M / P); M needs no divisibility. Cross-
 * rank accumulation is in T (bf16/fp16 TMA reduce-add), like gemm_rs.
 *
 * Kernels of one call (XLA's stream; at P = 1 without mode=fused only the matmul kernel):
 *
 *     kernel   rank r (G helper blocks; the GEMM is the LCSC persistent grid)
 *     epoch    EPOCH += 1 -> e
 *     enter    barrier 0; ws_r[Mp, N] <- 0; barrier 1
 *     gemm     tile (o, i, n) of x @ w  --TMA add-->  ws_o          (rotated: first o = r + 1)
 *     leave    barrier 2; y[o Mp : (o+1) Mp] <- ws_o for every o (peer loads); barrier 3
 *
 * At P = 1 (fused forced) the GEMM runs in gemm_rs.cuh's direct mode: tiles stored straight
 * into y, no enter or leave kernel, the workspace untouched.
 *
 * Signal protocol: barriers 0-2 as in gemm_rs.cuh. Barrier 3 (slot bar_row(3, b) + r raised to
 * e on every peer) proves every peer finished reading my buffer before my kernel ends, so the
 * next op (a collective staging into the same workspace) cannot overwrite rows still being
 * gathered. Every rank gathers the same bytes in the same order, so all ranks hold
 * bit-identical results.
 *
 * Pitfalls: the gather reads P - 1 remote buffers over NVLink after the GEMM, so this is not
 * overlapped the way gemm_rs is: it pays (P - 1) / P of M N sizeof(T) of traffic after the last
 * tile (the cost model charges it as T_non_overlap, and may prefer matmul + pk.all_reduce).
 * The owner buffers take ceil(M / P) N sizeof(T) bytes of workspace.
 */
#pragma once

#include "kernels/gemm_rs.cuh"

namespace pk::gemm_ar {

/** @brief The kernels are gemm_rs's front (epoch, enter, GEMM) + tp::leave_kernel<true>. */
using pk::gemm_rs::globals;
using pk::gemm_rs::kernel_def;

}  // namespace pk::gemm_ar
