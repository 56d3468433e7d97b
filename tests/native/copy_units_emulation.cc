// Host emulation of the copy kernel's work distribution (ffi/copy_units.cuh), for machines
// without a GPU: runs CopyUnit for every work unit and thread of a launch (CopyLeanThread for
// every thread of the lean copy's grid, where the handler takes it), one after another,
// and checks the result against a reference that applies the pairs in order. Also runs the copy
// engines' plan (PlanDmaCopies) with memcpy: in plan order when it reports two pairs writing one
// block, in reverse order otherwise (it promises that any order gives the same result). And
// runs a large batch's duplicate scan (ClaimLastWriter in a random order, as the GPU's threads
// race, then LaterWriterTokensFromClaims) against the in-order scan.
//
// Each random case (geometry, vector width, batch with padding, out-of-range and repeated
// indices, token counts from -1 to T+1) runs twice, units in forward and in reverse order: two
// units that wrote the same bytes with different data (a race on the GPU) would make the two
// runs differ. Pools are separate allocations with guard bytes around them, so a write outside
// them shows here (and under -fsanitize=address as well). Prints "ok N cases" or the first
// failure, and exits 0 only when every case matched.
//
//   g++ -std=c++17 -I ffi -isystem "$(python -c "import jax.ffi; print(jax.ffi.include_dir())")"
//       tests/native/copy_units_emulation.cc && ./a.out [cases] [seed]
// (tests/test_native_emulation.py builds and runs it.)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};

#include "copy_units.cuh"

namespace {

using kvxfer::Batch;
using kvxfer::PoolGeometry;

constexpr int64_t kGuard = 64;       // bytes before and after every buffer
constexpr uint8_t kCanary = 0xA5;

// A buffer with guard bytes on both sides, 16-byte aligned like XLA's buffers.
struct Buffer {
  std::vector<uint8_t> storage;
  int64_t size;
  explicit Buffer(int64_t bytes) : storage(bytes + 2 * kGuard + 16, kCanary), size(bytes) {}
  uint8_t* data() {
    auto p = reinterpret_cast<uintptr_t>(storage.data()) + kGuard;
    return reinterpret_cast<uint8_t*>((p + 15) & ~uintptr_t{15});
  }
  bool GuardsIntact() {
    const uint8_t* d = data();
    for (const uint8_t* p = storage.data(); p < d; ++p) {
      if (*p != kCanary) return false;
    }
    for (const uint8_t* p = d + size; p < storage.data() + storage.size(); ++p) {
      if (*p != kCanary) return false;
    }
    return true;
  }
};

struct Case {
  PoolGeometry g;
  int64_t num_pairs, src_blocks, dst_blocks;
  std::vector<int32_t> src_idx, dst_idx, tokens;
  bool gather;  // the staging path: every valid pair's source into its own slot (by_pair)
};

bool Valid(const Case& c, int64_t i) {
  return c.src_idx[i] >= 0 && c.src_idx[i] < c.src_blocks && c.dst_idx[i] >= 0 &&
         c.dst_idx[i] < c.dst_blocks;
}

// The pairs applied one after another: tokens [0, n) of every run, the last writer winning.
void Reference(const Case& c, const uint8_t* src, uint8_t* dst) {
  const PoolGeometry& g = c.g;
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    if (!Valid(c, i)) continue;
    const int64_t n = kvxfer::TokensToCopy(c.tokens[i], g);
    const uint8_t* s = src + c.src_idx[i] * g.block_bytes;
    uint8_t* d = dst + (c.gather ? i : c.dst_idx[i]) * g.block_bytes;
    if (n == g.tokens) {
      std::memcpy(d, s, g.block_bytes);
      continue;
    }
    for (int64_t r = 0; r < g.outer; ++r) {
      std::memcpy(d + r * g.tokens * g.row_bytes, s + r * g.tokens * g.row_bytes,
                  n * g.row_bytes);
    }
  }
}

bool HasDuplicateDestinations(const Case& c) {
  std::vector<bool> seen(c.dst_blocks, false);
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    if (!Valid(c, i)) continue;
    if (seen[c.dst_idx[i]]) return true;
    seen[c.dst_idx[i]] = true;
  }
  return false;
}

// What the duplicate scan gives pair i: the most tokens a later valid pair to its block writes.
std::vector<int32_t> LaterWriters(const Case& c) {
  std::vector<int32_t> first(c.num_pairs, 0);
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    if (!Valid(c, i)) continue;
    for (int64_t j = i + 1; j < c.num_pairs; ++j) {
      if (Valid(c, j) && c.dst_idx[j] == c.dst_idx[i]) {
        first[i] = std::max<int32_t>(first[i], kvxfer::TokensToCopy(c.tokens[j], c.g));
      }
    }
  }
  return first;
}

// Runs ClaimLastWriter for every pair, in a random order (the GPU's threads race), over a
// workspace set to -1 as the handler sets it, and returns it.
std::vector<int32_t> Claims(const Case& c, std::mt19937_64& rng) {
  Batch b{{nullptr, false}, {nullptr, false}, c.src_idx.data(), c.dst_idx.data(),
          c.tokens.data(), nullptr, c.num_pairs, c.src_blocks, c.dst_blocks, c.g};
  std::vector<int32_t> last(c.dst_blocks, -1);
  std::vector<int64_t> order(c.num_pairs);
  for (int64_t j = 0; j < c.num_pairs; ++j) order[j] = j;
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t j : order) {
    kvxfer::ClaimLastWriter(b, j, last.data(), [](int32_t* a, int32_t j) { *a = std::max(*a, j); });
  }
  return last;
}

// Each written block must end naming its greatest valid writer, and the tokens found from the
// claims (LaterWriterTokensFromClaims) must equal the scan's, `first` (LaterWriters). Returns
// an empty string or what went wrong.
std::string CheckLastWriters(const Case& c, const std::vector<int32_t>& last,
                             const std::vector<int32_t>& first) {
  Batch b{{nullptr, false}, {nullptr, false}, c.src_idx.data(), c.dst_idx.data(),
          c.tokens.data(), nullptr, c.num_pairs, c.src_blocks, c.dst_blocks, c.g};
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    if (!Valid(c, i)) continue;
    int64_t greatest = i;
    for (int64_t j = i + 1; j < c.num_pairs; ++j) {
      if (Valid(c, j) && c.dst_idx[j] == c.dst_idx[i]) greatest = j;
    }
    if (last[c.dst_idx[i]] != greatest) {
      return "block " + std::to_string(c.dst_idx[i]) + ": last writer " +
             std::to_string(last[c.dst_idx[i]]) + ", expected pair " + std::to_string(greatest);
    }
    if (kvxfer::LaterWriterTokensFromClaims(b, i, last.data()) != first[i]) {
      return "pair " + std::to_string(i) + ": tokens from the claims differ from the scan's";
    }
  }
  return "";
}

// The threads the handler launches for this batch: the lean copy's where LeanShapeFor takes
// it; otherwise units of kSmallUnitThreads threads where SmallUnits says so (a large partial
// batch without the fused scan), or of kThreads.
template <typename V>
void Emulate(const Batch& b, bool reverse, bool fallback_form_only) {
  if (kvxfer::LeanShape lean; kvxfer::LeanShapeFor(b, sizeof(V), /*max_ctas=*/0, &lean)) {
    // As the GPU's scans answer: the early form's -1 where a later pair writes the same block
    // (its copy then stores nothing, and the whole scan's form copies the pair), else 0; the
    // whole scan's form the tokens written later.
    const auto early_scan = [&](uint32_t pair, int64_t, int64_t) {
      const int32_t tokens = kvxfer::SupersededTokens(b, pair);
      return [tokens]() { return tokens == 0 ? 0 : -1; };
    };
    const auto whole_scan = [&](uint32_t pair, int64_t, int64_t) {
      const int32_t tokens = kvxfer::SupersededTokens(b, pair);
      return [tokens]() { return tokens; };
    };
    const int p = lean.pair_threads_log2, lanes = lean.lanes_log2;
    const int64_t threads = lean.ctas * kvxfer::kThreads;
    for (int64_t k = 0; k < threads; ++k) {
      const auto t = static_cast<uint32_t>(reverse ? threads - 1 - k : k);
      // CopyLeanKernel<true, true>, the handler's copy that scans itself: its first two loads
      // before the answer; fallback_form_only runs its fallback form (the whole scan first)
      // for every pair.
      if (b.scan_in_copy && !fallback_form_only) {
        if (!kvxfer::CopyLeanThread<V, 2>(b, t, p, lanes, early_scan)) {
          kvxfer::CopyLeanThread<V>(b, t, p, lanes, whole_scan);
        }
      } else {
        kvxfer::CopyLeanThread<V>(b, t, p, lanes, whole_scan);
      }
    }
    return;
  }
  const bool small = kvxfer::SmallUnits(b, /*max_ctas=*/0);
  const int unit_threads = small ? kvxfer::kSmallUnitThreads : kvxfer::kThreads;
  const int64_t units_per_pair =
      kvxfer::UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, unit_threads);
  const int64_t units = b.num_pairs * units_per_pair;
  for (int64_t k = 0; k < units; ++k) {
    const int64_t u = reverse ? units - 1 - k : k;
    const int64_t start = kvxfer::SupersededTokens(b, u / units_per_pair);
    for (int t = 0; t < unit_threads; ++t) {
      const int thread = reverse ? unit_threads - 1 - t : t;
      if (b.whole_blocks) {  // as the kernel that scans itself copies a whole-block batch
        kvxfer::CopyWholeUnit<V>(b, u, units_per_pair, thread,
                                 [&] { return start >= b.g.tokens; });
      } else if (small) {
        kvxfer::CopyUnit<V, kvxfer::kSmallUnitThreads>(b, u, units_per_pair, thread, start);
      } else {
        kvxfer::CopyUnit<V>(b, u, units_per_pair, thread, start);
      }
    }
  }
}

// The handler's choice of vector width (VectorBytes), as a type.
template <typename F>
void WithVector(const Batch& b, F&& f) {
  switch (kvxfer::VectorBytes(b)) {
    case 16:
      return f(uint4{});
    case 8:
      return f(uint2{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint8_t{});
  }
}

Case RandomCase(std::mt19937_64& rng) {
  auto pick = [&rng](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
  };
  Case c;
  c.g.outer = pick({1, 2, 3, 5, 8, 12, 17, 64, 128});
  c.g.tokens = pick({1, 2, 6, 16, 32});
  if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {
    // 4-bit rows of 3 elements: a row is not a whole number of bytes, only whole blocks copy
    c.g.row_bytes = 0;
    c.g.block_bytes = c.g.outer * c.g.tokens * 12 / 8;
    if (c.g.block_bytes == 0 || (c.g.outer * c.g.tokens * 12) % 8) c.g.block_bytes = 3 * c.g.outer;
  } else {
    c.g.row_bytes = pick({1, 2, 4, 6, 8, 16, 48, 128, 256});
    c.g.block_bytes = c.g.outer * c.g.tokens * c.g.row_bytes;
  }
  c.num_pairs = pick({1, 2, 3, 7, 40, 300});
  c.src_blocks = pick({1, 3, 8, 33});
  c.dst_blocks = pick({1, 3, 8, 33});
  c.gather = std::uniform_int_distribution<int>(0, 4)(rng) == 0;
  std::uniform_int_distribution<int32_t> si(-2, static_cast<int32_t>(c.src_blocks));
  std::uniform_int_distribution<int32_t> di(-2, static_cast<int32_t>(c.dst_blocks));
  std::uniform_int_distribution<int32_t> nt(-1, static_cast<int32_t>(c.g.tokens) + 1);
  const bool whole = std::uniform_int_distribution<int>(0, 3)(rng) == 0;  // whole blocks only
  // runs of neighbouring blocks in both pools (the copy engines merge them), now and then broken
  const bool runs = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const bool next = runs && i > 0 && (rng() % 5 != 0);
    c.src_idx.push_back(next ? c.src_idx.back() + 1 : si(rng));
    c.dst_idx.push_back(next ? c.dst_idx.back() + 1 : di(rng));
    const int32_t n = nt(rng);
    c.tokens.push_back(whole && n > 0 && n < c.g.tokens ? 0 : n);
  }
  return c;
}

std::string Describe(const Case& c) {
  char s[256];
  std::snprintf(s, sizeof s,
                "outer %lld tokens %lld row_bytes %lld block_bytes %lld pairs %lld src_blocks "
                "%lld dst_blocks %lld gather %d",
                static_cast<long long>(c.g.outer), static_cast<long long>(c.g.tokens),
                static_cast<long long>(c.g.row_bytes), static_cast<long long>(c.g.block_bytes),
                static_cast<long long>(c.num_pairs), static_cast<long long>(c.src_blocks),
                static_cast<long long>(c.dst_blocks), c.gather ? 1 : 0);
  return s;
}

// Runs the copy engines' plan with memcpy (a strided copy row by row), in `reverse` order or not.
void RunDmaPlan(const Batch& b, bool* ordered) {
  std::vector<kvxfer::DmaCopy> copies;
  *ordered = kvxfer::PlanDmaCopies(b, &copies);
  for (size_t k = 0; k < copies.size(); ++k) {
    const kvxfer::DmaCopy& c = copies[*ordered ? k : copies.size() - 1 - k];
    for (size_t row = 0; row < c.height; ++row) {
      std::memcpy(c.dst + row * c.pitch, c.src + row * c.pitch, c.width);
    }
  }
}

// Runs one case in both orders, and through the copy engines' plan where the handler would
// take it (never the staging gather); returns an empty string or what went wrong.
std::string Check(const Case& c, std::mt19937_64& rng) {
  const int64_t dst_slots = c.gather ? c.num_pairs : c.dst_blocks;
  Buffer src(c.src_blocks * c.g.block_bytes);
  std::vector<uint8_t> dst0(dst_slots * c.g.block_bytes);
  for (int64_t i = 0; i < src.size; ++i) src.data()[i] = static_cast<uint8_t>(rng());
  for (auto& x : dst0) x = static_cast<uint8_t>(rng());
  std::vector<uint8_t> want = dst0;
  Reference(c, src.data(), want.data());
  const std::vector<int32_t> first = LaterWriters(c);
  std::vector<int32_t> last;
  if (!c.gather) {
    last = Claims(c, rng);
    if (std::string error = CheckLastWriters(c, last, first); !error.empty()) return error;
  }
  // The host's promise that every pair copies a whole block, made only when true (and not
  // always then): the kernel then gives each pair a whole block's work units, and neither the
  // kernel nor the copy engines read the token counts (null here, so a read would crash);
  // neither changes the bytes copied.
  bool all_whole = true;
  for (int32_t n : c.tokens) all_whole = all_whole && kvxfer::TokensToCopy(n, c.g) == c.g.tokens;
  const bool whole_hint = all_whole && (rng() & 1);

  // kernel forward, kernel reverse (both with the scan's answers), kernel reverse with the
  // claims (as after ClaimLastWritersKernel), copy engines; where no two pairs write one block,
  // kernel reverse with no scan at all (unique_dst_indices=True: the lean copy); and the kernel
  // that scans itself in reverse (forward, a pair that ignored the scan would still lose to the
  // later writer), as the handler's lean copy runs and in its fallback form alone.
  for (int mode = 0; mode < 7; ++mode) {
    const bool reverse = mode != 0 && mode != 3, claims = mode == 2, dma = mode == 3;
    const bool unique = mode == 4, fused = mode == 0 || mode >= 5;
    if ((dma || claims || unique) && c.gather) continue;
    if (unique && HasDuplicateDestinations(c)) continue;
    const char* name = mode == 6   ? "reverse, scanning itself, fallback form"
                       : mode == 5 ? "reverse, scanning itself"
                       : unique ? "reverse, no scan"
                       : dma  ? "copy engines"
                       : claims ? "reverse, claims"
                       : reverse ? "reverse" : "forward";
    Buffer dst(dst_slots * c.g.block_bytes);
    if (!dst0.empty()) std::memcpy(dst.data(), dst0.data(), dst0.size());
    Batch b{{reinterpret_cast<char*>(dst.data()), c.gather},
            {reinterpret_cast<char*>(src.data()), false},
            c.src_idx.data(),
            c.dst_idx.data(),
            c.tokens.data(),
            c.gather || c.num_pairs == 1 || unique ? nullptr : first.data(),
            c.num_pairs,
            c.src_blocks,
            c.dst_blocks,
            c.g};
    b.whole_blocks = whole_hint;
    b.scan_in_copy = fused;  // the fused kernel's units (its scan's answers in `first`)
    if (whole_hint) b.num_tokens = nullptr;
    if (claims && c.num_pairs > 1) {
      b.first = last.data();
      b.claims = true;
    }
    if (dma) {
      bool ordered = false;
      RunDmaPlan(b, &ordered);
      if (ordered != HasDuplicateDestinations(c)) return "the copy engines' duplicates flag";
    } else {
      WithVector(b, [&](auto v) { Emulate<decltype(v)>(b, reverse, mode == 6); });
    }
    if (!dst.GuardsIntact() || !src.GuardsIntact()) {
      return "a write outside the pools (" + std::string(name) + ")";
    }
    for (int64_t i = 0; i < dst.size; ++i) {
      if (dst.data()[i] != want[i]) {
        return "byte " + std::to_string(i) + " of the destination differs from the reference (" +
               name + ")";
      }
    }
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 400;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  std::mt19937_64 rng(seed);
  for (int k = 0; k < cases; ++k) {
    const Case c = RandomCase(rng);
    const std::string error = Check(c, rng);
    if (!error.empty()) {
      std::printf("FAIL case %d (seed %llu): %s; %s\n", k, static_cast<unsigned long long>(seed),
                  error.c_str(), Describe(c).c_str());
      return 1;
    }
  }
  std::printf("ok %d cases\n", cases);
  return 0;
}
