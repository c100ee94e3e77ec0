// The attention masks' pure functions (cuda/include/pk/attn/masks.cuh) on a CPU, for
// tests/test_attention_masks.py, which builds this file with the host compiler and compares
// each answer with NumPy. The masked kernels call these same functions on the device.
//
// Reads one command per line from stdin and answers each with one line:
//   pos S Q_LEN KV_LEN LEFT RIGHT CAUSAL   sets the batch row's positions (positions::of): "ok"
//   info q|kv N V...                      sets the query or key chunks' chunk_info (4 N ints,
//                                         min max first end per chunk): "ok"
//   keys_of_row / rows_of_key             lo hi of each row / key 0..S-1
//   visible                               S lines of S characters 0/1 as one line, row-major
//   fwd_tiles SEGMENTS BM BN              lo hi of the key tiles of each query tile of BM rows
//   bwd_tiles SEGMENTS BN BQ              lo hi of the query tiles of each key block of BN keys
//   needs_mask SEGMENTS NR NK R_END       0/1 per sub-tile (rows r0 = 0, NR, .. < R_END; keys
//                                         k0 = 0, NK, .. < S), row-major
//   tanh X...                             tanh_fast of each
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "pk/attn/masks.cuh"

namespace {

using namespace pk::attn::masks;

positions pos{};
std::vector<chunk_info> q_info, kv_info;

std::string Answer(const std::string& line) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  std::ostringstream out;
  if (cmd == "pos") {
    int s, ql, kl, left, right, causal;
    in >> s >> ql >> kl >> left >> right >> causal;
    pos = positions::of(s, ql, kl, left, right, causal != 0);
    return "ok";
  }
  if (cmd == "info") {
    std::string side;
    int n;
    in >> side >> n;
    std::vector<chunk_info>& info = side == "q" ? q_info : kv_info;
    info.assign(n, chunk_info{});
    for (chunk_info& c : info) in >> c.min >> c.max >> c.first >> c.end;
    return "ok";
  }
  if (cmd == "keys_of_row" || cmd == "rows_of_key") {
    for (int i = 0; i < pos.s; ++i) {
      const span x = cmd == "keys_of_row" ? keys_of_row(pos, i) : rows_of_key(pos, i);
      out << x.lo << ' ' << x.hi << ' ';
    }
    return out.str();
  }
  if (cmd == "visible") {
    for (int i = 0; i < pos.s; ++i) {
      for (int j = 0; j < pos.s; ++j) out << (visible(pos, i, j) ? '1' : '0');
    }
    return out.str();
  }
  if (cmd == "fwd_tiles" || cmd == "bwd_tiles") {
    int segments, a, b;
    in >> segments >> a >> b;
    for (int t = 0; t * a < pos.s; ++t) {
      const span x = cmd == "fwd_tiles"
                         ? fwd_key_tiles(pos, q_info.data(), segments != 0, t * a, a, b)
                         : bwd_query_tiles(pos, kv_info.data(), segments != 0, t * a, a, b);
      out << x.lo << ' ' << x.hi << ' ';
    }
    return out.str();
  }
  if (cmd == "needs_mask") {
    int segments, nr, nk, r_end;
    in >> segments >> nr >> nk >> r_end;
    for (int r0 = 0; r0 < r_end; r0 += nr) {
      for (int k0 = 0; k0 < pos.s; k0 += nk) {
        out << (needs_mask(pos, q_info.data(), kv_info.data(), segments != 0, r0, nr, k0, nk)
                    ? '1'
                    : '0');
      }
    }
    return out.str();
  }
  if (cmd == "tanh") {
    float x;
    char buf[32];
    while (in >> x) {
      std::snprintf(buf, sizeof(buf), "%.9g ", tanh_fast(x));
      out << buf;
    }
    return out.str();
  }
  return "error unknown command '" + cmd + "'";
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) std::cout << Answer(line) << std::endl;
  return 0;
}
