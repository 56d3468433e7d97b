// Host emulation of the copy kernel's work distribution (ffi/copy_units.cuh), for machines
// without a GPU: runs CopyUnit for every work unit and thread of a launch, one after another,
// and checks the result against a reference that applies the pairs in order. The duplicate
// scan's answers (LaterWriterTokensKernel on the GPU) come from an in-order reference here.
// Also runs the copy engines' plan (PlanDmaCopies, ffi/dma_plan.h) with memcpy: in plan order
// when it reports two pairs writing one block, in reverse order otherwise (it promises that any
// order gives the same result).
//
// Each random case (geometry, vector width, batch with padding, out-of-range and repeated
// indices, token counts from -1 to T+1, GPUs of different sizes) runs units in forward and in
// reverse order: two units that wrote the same bytes with different data (a race on the GPU)
// would make the two runs differ. Pools are separate allocations with guard bytes around
// them, so a write outside them shows here (and under -fsanitize=address as well). Prints
// "ok N cases" or the first failure, and exits 0 only when every case matched.
//
//   g++ -std=c++17 -I ffi -isystem "$(python -c "import jax.ffi; print(jax.ffi.include_dir())")"
//       tests/native/copy_units_emulation.cc && ./a.out [cases] [seed]
// (tests/native/test_native_emulation.py builds and runs it.)
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
#include "dma_plan.h"

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
  // bytes between slots: the block's, or more (a layer's part of a host row holding every
  // layer's, with the other layers' bytes between, which must stay as they were)
  int64_t src_stride, dst_stride;
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
    const uint8_t* s = src + c.src_idx[i] * c.src_stride;
    uint8_t* d = dst + (c.gather ? i : c.dst_idx[i]) * c.dst_stride;
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

// What the duplicate scan gives pair i: the most tokens a later valid pair to its block writes
// (LaterWriterTokensKernel).
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

// Every unit and thread of the handler's launch for this batch, in `reverse` order or not, on a
// GPU whose wave holds `wave_ctas` CTAs.
template <typename V>
void Emulate(const Batch& b, bool reverse, int64_t wave_ctas) {
  const int64_t units_per_pair = kvxfer::UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, wave_ctas);
  const int64_t units = b.num_pairs * units_per_pair;
  for (int64_t k = 0; k < units; ++k) {
    const int64_t u = reverse ? units - 1 - k : k;
    for (int t = 0; t < kvxfer::kThreads; ++t) {
      kvxfer::CopyUnit<V>(b, u, units_per_pair, reverse ? kvxfer::kThreads - 1 - t : t);
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
  // strides: the block's, or a few bytes or a few blocks more
  const auto stride = [&] { return c.g.block_bytes + pick({0, 0, 0, 1, 16, 3 * c.g.block_bytes}); };
  c.src_stride = stride();
  c.dst_stride = stride();
  std::uniform_int_distribution<int32_t> si(-2, static_cast<int32_t>(c.src_blocks));
  std::uniform_int_distribution<int32_t> di(-2, static_cast<int32_t>(c.dst_blocks));
  std::uniform_int_distribution<int32_t> nt(-1, static_cast<int32_t>(c.g.tokens) + 1);
  const bool whole = std::uniform_int_distribution<int>(0, 3)(rng) == 0;  // whole blocks only
  // runs of neighbouring blocks in both pools (the copy engines merge them), now and then broken
  const bool runs = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  // or no block written twice (what a staged onboard needs), now and then a padding pair
  const bool distinct = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  std::vector<int32_t> slots;
  if (distinct) {
    c.dst_blocks = std::max<int64_t>(c.dst_blocks, c.num_pairs + pick({0, 3}));
    for (int32_t d = 0; d < c.dst_blocks; ++d) slots.push_back(d);
    std::shuffle(slots.begin(), slots.end(), rng);
  }
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const bool next = runs && i > 0 && (rng() % 5 != 0);
    c.src_idx.push_back(next ? c.src_idx.back() + 1 : si(rng));
    c.dst_idx.push_back(distinct ? (rng() % 9 == 0 ? -1 : slots[i])
                        : next ? c.dst_idx.back() + 1 : di(rng));
    const int32_t n = nt(rng);
    c.tokens.push_back(whole && n > 0 && n < c.g.tokens ? 0 : n);
  }
  return c;
}

std::string Describe(const Case& c) {
  char s[256];
  std::snprintf(s, sizeof s,
                "outer %lld tokens %lld row_bytes %lld block_bytes %lld pairs %lld src_blocks "
                "%lld dst_blocks %lld gather %d strides %lld %lld",
                static_cast<long long>(c.g.outer), static_cast<long long>(c.g.tokens),
                static_cast<long long>(c.g.row_bytes), static_cast<long long>(c.g.block_bytes),
                static_cast<long long>(c.num_pairs), static_cast<long long>(c.src_blocks),
                static_cast<long long>(c.dst_blocks), c.gather ? 1 : 0,
                static_cast<long long>(c.src_stride), static_cast<long long>(c.dst_stride));
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

bool AnyValid(const Case& c) {
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    if (Valid(c, i)) return true;
  }
  return false;
}

// A staged onboard of batch `b` (whole blocks): the plan's runs copied into staging slots with
// memcpy, then every unit of the kernel from them in reverse. The plan must refuse exactly the
// batches with two valid pairs writing one block, or none valid; and each of its runs must be
// as long as the source slots allow (never two runs where one copy would do).
std::string RunStaged(const Case& c, const Batch& b) {
  std::vector<kvxfer::StagedRun> runs;
  const bool planned = kvxfer::PlanStagedSources(b, 1.0, &runs);
  if (planned == (HasDuplicateDestinations(c) || !AnyValid(c))) return "the staged plan's refusal";
  if (!planned) return "";
  const bool contiguous = c.src_stride == c.g.block_bytes;
  for (size_t k = 1; k < runs.size(); ++k) {
    const kvxfer::StagedRun& r = runs[k - 1];
    const int64_t next = r.pair + static_cast<int64_t>(r.bytes / c.g.block_bytes);
    if (contiguous && runs[k].pair == next &&
        runs[k].src == r.src + r.bytes) {
      return "the staged plan split a run";
    }
  }
  Buffer staging(c.num_pairs * c.g.block_bytes);
  for (const kvxfer::StagedRun& r : runs) {
    if (r.pair < 0 || (r.pair * c.g.block_bytes + static_cast<int64_t>(r.bytes)) > staging.size) {
      return "a staged run outside the staging buffer";
    }
    std::memcpy(staging.data() + r.pair * c.g.block_bytes, r.src, r.bytes);
  }
  Batch scatter = b;
  scatter.src = {reinterpret_cast<char*>(staging.data()), c.g.block_bytes, true};
  scatter.superseded = nullptr;
  WithVector(scatter, [&](auto v) { Emulate<decltype(v)>(scatter, true, 8 * 132); });
  return staging.GuardsIntact() ? "" : "a write outside the staging buffer";
}

// An onboard split by layers (SplitLayerGroups), `b` seen as `layers` layers of its runs, in
// `groups` groups: each group's copy engines' plan run with memcpy, the groups last to first
// (they write bytes of their own). The split must cover the layers in order, group by group.
std::string RunLayerGroups(const Batch& b, int64_t layers, int64_t groups) {
  std::vector<std::vector<Batch>> split;
  std::vector<int64_t> ends;
  if (!kvxfer::SplitLayerGroups({{b, 0, layers}}, groups, &split, &ends)) {
    return "the layer groups' refusal";
  }
  if (static_cast<int64_t>(split.size()) != groups || ends.back() != layers) {
    return "the layer groups' count or last end";
  }
  for (int64_t g = groups - 1; g >= 0; --g) {
    if (split[g].size() != 1 || ends[g] != kvxfer::LayerGroupBounds(g, groups, layers).second) {
      return "layer group " + std::to_string(g) + "'s parts or end";
    }
    bool ordered = false;
    RunDmaPlan(split[g][0], &ordered);
  }
  return "";
}

// Runs one case in both orders, and through the copy engines' plan where the handler would
// take it (never the staging gather); returns an empty string or what went wrong.
std::string Check(const Case& c, std::mt19937_64& rng) {
  const int64_t dst_slots = c.gather ? c.num_pairs : c.dst_blocks;
  Buffer src(c.src_blocks * c.src_stride);
  std::vector<uint8_t> dst0(dst_slots * c.dst_stride);
  for (int64_t i = 0; i < src.size; ++i) src.data()[i] = static_cast<uint8_t>(rng());
  for (auto& x : dst0) x = static_cast<uint8_t>(rng());
  std::vector<uint8_t> want = dst0;
  Reference(c, src.data(), want.data());
  const std::vector<int32_t> superseded = LaterWriters(c);
  // The host's promise that every pair copies a whole block, made only when true (and not
  // always then): neither the kernel nor the copy engines then read the token counts (null
  // here, so a read would crash); it does not change the bytes copied.
  bool all_whole = true;
  for (int32_t n : c.tokens) all_whole = all_whole && kvxfer::TokensToCopy(n, c.g) == c.g.tokens;
  const bool whole_hint = all_whole && (rng() & 1);
  const int64_t wave_ctas = 8 * std::uniform_int_distribution<int64_t>(1, 132)(rng);

  // kernel forward and reverse with the scan's answers, copy engines, and where no two pairs
  // write one block, kernel reverse with no scan (unique_dst_indices=True, or one pair).
  // mode 4: a staged onboard (PlanStagedSources with memcpy, then the kernel from the staging
  // slots, in reverse), for whole blocks; mode 5: an onboard split by layers (the outer runs
  // as a random number of layers that divides them), where rows are whole bytes
  int64_t layers = 1;
  for (int64_t l = 2; l <= c.g.outer; ++l) {
    if (c.g.outer % l == 0 && (layers == 1 || rng() % 2 == 0)) layers = l;
  }
  const int64_t groups = 2 + static_cast<int64_t>(rng() % std::max<int64_t>(1, layers - 1));
  for (int mode = 0; mode < 6; ++mode) {
    const bool reverse = mode != 0, dma = mode == 2, unique = mode == 3, staged = mode == 4;
    const bool grouped = mode == 5;
    if ((dma || unique || staged || grouped) && c.gather) continue;
    if (grouped && (layers < 2 || c.g.row_bytes == 0)) continue;
    if (unique && HasDuplicateDestinations(c)) continue;
    if (staged && !all_whole) continue;
    const char* name = grouped ? "layer groups" : staged ? "staged" : unique ? "reverse, no scan"
                       : dma ? "copy engines" : reverse ? "reverse" : "forward";
    Buffer dst(dst_slots * c.dst_stride);
    if (!dst0.empty()) std::memcpy(dst.data(), dst0.data(), dst0.size());
    Batch b{{reinterpret_cast<char*>(dst.data()), c.dst_stride, c.gather},
            {reinterpret_cast<char*>(src.data()), c.src_stride, false},
            c.src_idx.data(),
            c.dst_idx.data(),
            whole_hint ? nullptr : c.tokens.data(),
            c.gather || c.num_pairs == 1 || unique ? nullptr : superseded.data(),
            c.num_pairs,
            c.src_blocks,
            c.dst_blocks,
            c.g,
            whole_hint};
    if (dma) {
      bool ordered = false;
      RunDmaPlan(b, &ordered);
      if (ordered != HasDuplicateDestinations(c)) return "the copy engines' duplicates flag";
    } else if (grouped) {
      std::string failed = RunLayerGroups(b, layers, groups);
      if (!failed.empty()) return failed;
    } else if (staged) {
      std::string failed = RunStaged(c, b);
      if (!failed.empty()) return failed;
      if (HasDuplicateDestinations(c) || !AnyValid(c)) continue;  // refused: nothing copied
    } else {
      WithVector(b, [&](auto v) { Emulate<decltype(v)>(b, reverse, wave_ctas); });
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

// A layered copy's launch (PartsLaunch): `count` parts of geometries and strides of their own
// that share one case's pairs and tokens per block, split into launches as the handler splits
// them (LaunchEnd), every unit and thread of each in `reverse` order or not; each part's bytes
// against the reference of its own case. The parts' shared duplicate scan comes from part 0.
std::string CheckParts(const Case& shared, int count, std::mt19937_64& rng) {
  std::vector<Case> cases;
  std::vector<Buffer> srcs, dsts;
  std::vector<std::vector<uint8_t>> wants;
  const std::vector<int32_t> superseded = LaterWriters(shared);
  std::vector<Batch> parts;
  for (int k = 0; k < count; ++k) {
    Case c = shared;
    c.g.outer = 1 + static_cast<int64_t>(rng() % 9);
    c.g.row_bytes = int64_t{1} << (rng() % 6);
    c.g.block_bytes = c.g.outer * c.g.tokens * c.g.row_bytes;
    c.src_stride = c.g.block_bytes + (rng() % 3 == 0 ? 16 * static_cast<int64_t>(rng() % 4) : 0);
    c.dst_stride = c.g.block_bytes + (rng() % 3 == 0 ? 16 * static_cast<int64_t>(rng() % 4) : 0);
    srcs.emplace_back(c.src_blocks * c.src_stride);
    dsts.emplace_back((c.gather ? c.num_pairs : c.dst_blocks) * c.dst_stride);
    for (int64_t i = 0; i < srcs.back().size; ++i) srcs.back().data()[i] = static_cast<uint8_t>(rng());
    for (int64_t i = 0; i < dsts.back().size; ++i) dsts.back().data()[i] = static_cast<uint8_t>(rng());
    wants.emplace_back(dsts.back().data(), dsts.back().data() + dsts.back().size);
    Reference(c, srcs.back().data(), wants.back().data());
    cases.push_back(c);
  }
  for (int k = 0; k < count; ++k) {
    const Case& c = cases[k];
    parts.push_back({{reinterpret_cast<char*>(dsts[k].data()), c.dst_stride, c.gather},
                     {reinterpret_cast<char*>(srcs[k].data()), c.src_stride, false},
                     c.src_idx.data(), c.dst_idx.data(), c.tokens.data(),
                     c.gather ? nullptr : superseded.data(), c.num_pairs, c.src_blocks,
                     c.dst_blocks, c.g, false});
  }
  const bool reverse = rng() & 1;
  const int64_t wave_ctas = 8 * std::uniform_int_distribution<int64_t>(1, 132)(rng);
  for (size_t begin = 0; begin < parts.size();) {
    const size_t end = kvxfer::LaunchEnd(parts, begin);
    const kvxfer::PartsLaunch p =
        kvxfer::PlanParts(parts.data() + begin, static_cast<int>(end - begin), wave_ctas);
    WithVector(parts[begin], [&](auto v) {
      const int64_t units = p.first_unit[p.count];
      for (int64_t n = 0; n < units; ++n) {
        const int64_t u = reverse ? units - 1 - n : n;
        const int k = kvxfer::PartOf(p, u);
        if (u < p.first_unit[k] || u >= p.first_unit[k + 1]) return;  // a wrong part: undone
        for (int t = 0; t < kvxfer::kThreads; ++t) {
          kvxfer::CopyUnit<decltype(v)>(p.part[k], u - p.first_unit[k], p.units_per_pair[k],
                                        reverse ? kvxfer::kThreads - 1 - t : t);
        }
      }
    });
    begin = end;
  }
  for (int k = 0; k < count; ++k) {
    if (!dsts[k].GuardsIntact() || !srcs[k].GuardsIntact()) {
      return "a write outside part " + std::to_string(k) + "'s buffers";
    }
    if (std::memcmp(dsts[k].data(), wants[k].data(), wants[k].size()) != 0) {
      return "part " + std::to_string(k) + " of " + std::to_string(count) +
             " differs from its reference";
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
    std::string error = Check(c, rng);
    if (error.empty() && c.g.row_bytes > 0) {
      // a layered copy's parts over the same pairs: up to a few more than one launch holds
      const int count = 1 + static_cast<int>(rng() % (k % 20 == 0 ? kvxfer::kMaxParts + 6 : 6));
      error = CheckParts(c, count, rng);
    }
    if (!error.empty()) {
      std::printf("FAIL case %d (seed %llu): %s; %s\n", k, static_cast<unsigned long long>(seed),
                  error.c_str(), Describe(c).c_str());
      return 1;
    }
  }
  std::printf("ok %d cases\n", cases);
  return 0;
}
