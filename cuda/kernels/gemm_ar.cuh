/*
 * gemm_ar: y = sum over ranks p of x_p @ w_p, on every rank (reference: lax.psum(x @ w, axis)).
 * The GEMM+RS kernel of gemm_rs.cuh (tiles reduce-added into the row owners' workspaces
 * while the GEMM runs), whose spare producer warps gather every owner's finished rows while
 * the GEMM goes on: a fused reduce-scatter plus an all-gather by peer loads, in one kernel.
 *
 * Shardings: x: [M, K/P], w: [K/P, N] per rank, y: [M, N], identical on every rank. Owner o
 * accumulates rows [o Mp, min((o+1) Mp, M)), Mp = ceil(M / P); M needs no divisibility. Cross-
 * rank accumulation is in T (bf16/fp16 TMA reduce-add), like gemm_rs.
 *
 * Kernels of one call (XLA's stream; at P = 1 without mode=fused only the matmul kernel):
 *
 *     kernel   rank r (G helper blocks; the GEMM is the LCSC persistent grid)
 *     epoch    EPOCH += 1 -> e
 *     enter    barrier 0; ws_r[Mp, N] <- 0, my band counts <- 0; barrier 1
 *     gemm     consumers: tile (o, i, n) of x @ w  --TMA add-->  ws_o, band by band
 *              producer warps 1-3: y[band b of owner o] <- ws_o, as each band completes
 *     leave    barrier 3 (1 block)
 *
 * The gather under the GEMM (gemm_rs.cuh: owner_place, gather_count, gather_help): each
 * owner's tile rows are cut into B <= 8 bands, and every rank walks band by band, taking the
 * owners of a band from r + 1 on (the P ranks still push to P different owners at a time), so
 * band b of every owner is complete once every rank has walked its first b + 1 bands. A
 * consumer counts each tile once its reduce-adds have landed (its leader waits for its bulk
 * group at its next tile, not at this one); the count that completes my share of a band raises
 * slot ARRIVED(o, b, r) on every rank. In every compute block the three warps of the producer
 * warpgroup that do not issue loads (lcsc.cuh helper) take the (band, owner) pairs in that order,
 * wait for the band's P arrivals and copy the block's share of its rows from ws_o into y with
 * 16-byte loads (peer loads over NVLink), while the consumers go on with later bands: no SM is
 * taken from the GEMM, and every SM has loads in flight. Only the last band's copy follows the
 * last tile.
 *
 * At P = 1 (fused forced) the GEMM runs in gemm_rs.cuh's direct mode: tiles stored straight
 * into y, no enter or leave kernel, no gather, the workspace untouched.
 *
 * Signal protocol: barriers 0 and 1 as in gemm_rs.cuh; no barrier 2 (each band's arrivals
 * stand for it). ARRIVED(o, b, p) is raised to e by rank p only (the consumer whose count
 * completes p's share of the band, after its fence), read by every rank's gathering warps
 * (acquire). The band counts (local, GATHER_DONE) are zeroed by my enter kernel before my GEMM
 * starts on the same stream. Barrier 3 (slot bar_row(3, 0) + r raised to e on every peer)
 * proves every peer finished reading my buffer before my call ends, so the next op (a
 * collective staging into the same workspace, or the next call's zero-fill after its barrier 0)
 * cannot overwrite rows still being gathered. Every rank copies the same bytes of every owner,
 * so all ranks hold bit-identical results.
 *
 * Pitfalls: the link carries the reduce-adds and the gather at once (2 (P - 1) / P of M N
 * sizeof(T) per rank, as the serial all-reduce's two phases); the gathering warps run with the
 * producer's 40 registers (4 loads in flight per thread). A first form with 8 communication SMs
 * (scaled to the partition) copying bands through a bulk-copy ring was 0.75x of serial at the
 * scale model, its copies too slow (bench/results/overlap.md). The owner buffers take
 * ceil(M / P) N sizeof(T) bytes of workspace.
 */
#pragma once

#include "kernels/gemm_rs.cuh"

namespace pk::gemm_ar {

/** @brief The kernels are gemm_rs's front (epoch, enter, GEMM with its gather) +
 *  tp::leave_kernel<true>. */
using pk::gemm_rs::globals;
using pk::gemm_rs::kernel_def;

}  // namespace pk::gemm_ar
