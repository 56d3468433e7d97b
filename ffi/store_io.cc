// The stores' loops over many values with the GIL released, host code only: RedisStore's
// read and write loops (jax_kvxfer/stores/resp.py: RespConnection.get_into, set_each), and
// the values a put sends (stores/shared.py: SharedStore._pack).
//
// Written in Python, a store thread needed the GIL back after every socket call and every
// row's checksum; beside a serving thread that runs Python (it gives the GIL up only every
// switch interval, 5 ms) the reads ran at 0.07-0.16x of their speed alone and the writes at
// 0.23-0.39x (docs/stores.md, "Reads and writes beside a serving thread"). Here a whole batch
// runs with the GIL released. A get batch: the commands sent a window ahead, each reply's first
// line parsed, the value's head checked against the one expected and the rest received into
// its destination, its CRC-32 computed on the way, or skipped. A put batch: its values staged
// (head, row, CRC-32), then its commands sent and their replies read.

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"

namespace nb = nanobind;

namespace kvxfer {
namespace {

// A reply's outcome (resp.py's get_into reads the same numbers).
enum Reply : int8_t {
  kValue = 0,         // received: its head into heads[i], the rest into dsts[i] (crcs[i])
  kAbsent = 1,        // a nil reply
  kOtherLength = 2,   // a value of another length (its length in lengths_out[i]): skipped
  kHeadMismatch = 3,  // a value whose head is not the one expected: skipped
  kErrorReply = 4,    // an error reply (its text in the errors returned)
  kUnanswered = 5,    // not answered: the connection failed first
};

constexpr size_t kLineBuf = 1 << 16;  // replies' first lines, and what a recv brings past them

// CRC-32 (zlib's: the reflected polynomial 0xEDB88320). The values' checksums are computed
// here, on each chunk as it arrives: in Python, each row's checksum released and took back the
// GIL, one wait of up to 5 ms a value beside a busy serving thread. Where the CPU has carry-less
// multiplication (x86-64's PCLMULQDQ), 64 bytes at a time are folded into 128 bits (Intel's
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", with the constants of this
// polynomial); otherwise, and for the last bytes, eight bytes a step from tables.
class Crc32 {
 public:
  Crc32() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t_[0][i] = c;
    }
    for (int s = 1; s < 8; ++s) {
      for (int i = 0; i < 256; ++i) t_[s][i] = (t_[s - 1][i] >> 8) ^ t_[0][t_[s - 1][i] & 0xFF];
    }
#if defined(__x86_64__)
    folds_ = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
  }

  // zlib's crc32(crc, p, n): the CRC-32 of the bytes so far (0 before any) extended by p[0, n).
  uint32_t Update(uint32_t crc, const uint8_t* p, size_t n) const {
    uint32_t r = ~crc;  // the register
#if defined(__x86_64__)
    if (folds_ && n >= 64) {
      const size_t folded = n & ~size_t{15};
      r = Fold(r, p, folded);
      p += folded;
      n -= folded;
    }
#endif
    for (; n && (reinterpret_cast<uintptr_t>(p) & 7); --n) r = t_[0][(r ^ *p++) & 0xFF] ^ (r >> 8);
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);  // little-endian (x86-64, AArch64)
      v ^= r;
      r = t_[7][v & 0xFF] ^ t_[6][(v >> 8) & 0xFF] ^ t_[5][(v >> 16) & 0xFF] ^
          t_[4][(v >> 24) & 0xFF] ^ t_[3][(v >> 32) & 0xFF] ^ t_[2][(v >> 40) & 0xFF] ^
          t_[1][(v >> 48) & 0xFF] ^ t_[0][v >> 56];
    }
    for (; n; --n) r = t_[0][(r ^ *p++) & 0xFF] ^ (r >> 8);
    return ~r;
  }

 private:
#if defined(__x86_64__)
  static __m128i Load(const uint8_t* q) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  }

  // A 128-bit lane's high half times k's high half (x^a mod P), and its low half times k's low
  // half (x^b mod P): the lane moved that far ahead.
  __attribute__((target("pclmul,sse4.1"))) static __m128i Ahead(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
  }

  // The register after n bytes (n >= 64, a multiple of 16).
  __attribute__((target("pclmul,sse4.1"))) static uint32_t Fold(uint32_t r, const uint8_t* p,
                                                                size_t n) {
    __m128i x1 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(static_cast<int>(r)));
    __m128i x2 = Load(p + 16), x3 = Load(p + 32), x4 = Load(p + 48);
    p += 64;
    n -= 64;
    const __m128i k512 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);  // four lanes ahead
    for (; n >= 64; n -= 64, p += 64) {
      x1 = _mm_xor_si128(Ahead(x1, k512), Load(p));
      x2 = _mm_xor_si128(Ahead(x2, k512), Load(p + 16));
      x3 = _mm_xor_si128(Ahead(x3, k512), Load(p + 32));
      x4 = _mm_xor_si128(Ahead(x4, k512), Load(p + 48));
    }
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);  // one lane ahead
    x1 = _mm_xor_si128(Ahead(x1, k128), x2);
    x1 = _mm_xor_si128(Ahead(x1, k128), x3);
    x1 = _mm_xor_si128(Ahead(x1, k128), x4);
    for (; n >= 16; n -= 16, p += 16) x1 = _mm_xor_si128(Ahead(x1, k128), Load(p));
    // 128 bits to 64 (and 32 zero bits appended), then to 32 by Barrett reduction
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(k128, x1, 0x01), _mm_srli_si128(x1, 8));
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    const __m128i k64 = _mm_set_epi64x(0, 0x163cd6124);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k64, 0x00),
                       _mm_srli_si128(x1, 4));
    const __m128i barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);  // mu, P
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), barrett, 0x00);
    return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(t, x1), 1));
  }

  bool folds_ = false;
#endif
  uint32_t t_[8][256];
};

const Crc32 kCrc32;

using Bytes2D = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstBytes2D = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstBytes1D = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64s = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ConstInt64s = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int8s = nb::ndarray<int8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Uint32s = nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Row = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One connected socket (blocking or not), every wait bounded by the timeout. A failure sets
// `fault` (and `closed` where the peer closed or reset it) and returns false.
class Socket {
 public:
  Socket(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms), buf_(kLineBuf) {}

  std::string fault;
  bool closed = false;

  bool Line(std::string* line) {
    for (;;) {
      const char* start = buf_.data() + lo_;
      const char* end = static_cast<const char*>(memmem(start, hi_ - lo_, "\r\n", 2));
      if (end != nullptr) {
        line->assign(start, end);
        lo_ = end - buf_.data() + 2;
        return true;
      }
      if (!Fill()) return false;
    }
  }

  // Fills dst[0, n): first with what the buffer holds, then straight from the socket; with
  // `crc`, the CRC-32 of the bytes, each chunk's as it lands (while the next is on its way).
  bool Exactly(uint8_t* dst, size_t n, uint32_t* crc = nullptr) {
    const size_t have = std::min(n, hi_ - lo_);
    std::memcpy(dst, buf_.data() + lo_, have);
    lo_ += have;
    if (crc) *crc = kCrc32.Update(0, dst, have);
    for (size_t done = have; done < n;) {
      const ssize_t got = Recv(dst + done, n - done);
      if (got <= 0) return false;
      if (crc) *crc = kCrc32.Update(*crc, dst + done, got);
      done += got;
    }
    return true;
  }

  bool Skip(size_t n) {
    while (n) {
      if (lo_ == hi_) {
        lo_ = hi_ = 0;
        if (!Fill()) return false;
      }
      const size_t k = std::min(n, hi_ - lo_);
      lo_ += k;
      n -= k;
    }
    return true;
  }

  bool SendAll(const std::string& data) {
    for (size_t done = 0; done < data.size();) {
      if (!Wait(POLLOUT)) return false;
      const ssize_t sent = send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return Fail(errno);
      }
      done += sent;
    }
    return true;
  }

  // Sends the parts one after another (one sendmsg for as many as the socket takes).
  bool SendParts(iovec* parts, size_t count) {
    while (count) {
      if (!Wait(POLLOUT)) return false;
      msghdr msg{};
      msg.msg_iov = parts;
      msg.msg_iovlen = count;
      ssize_t sent = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return Fail(errno);
      }
      for (; count && static_cast<size_t>(sent) >= parts->iov_len; ++parts, --count) {
        sent -= parts->iov_len;
      }
      if (count) {
        parts->iov_base = static_cast<char*>(parts->iov_base) + sent;
        parts->iov_len -= sent;
      }
    }
    return true;
  }

  bool Drained() const { return lo_ == hi_; }

 private:
  bool Fill() {
    if (lo_) {
      std::memmove(buf_.data(), buf_.data() + lo_, hi_ - lo_);
      hi_ -= lo_;
      lo_ = 0;
    }
    if (hi_ == buf_.size()) {
      fault = "a reply line longer than 64 KiB";
      return false;
    }
    const ssize_t got = Recv(reinterpret_cast<uint8_t*>(buf_.data()) + hi_, buf_.size() - hi_);
    if (got <= 0) return false;
    hi_ += got;
    return true;
  }

  // Bytes received (> 0), or 0 on a failure (`fault` set).
  ssize_t Recv(uint8_t* dst, size_t n) {
    for (;;) {
      if (!Wait(POLLIN)) return 0;
      const ssize_t got = recv(fd_, dst, n, 0);
      if (got > 0) return got;
      if (got == 0) {
        closed = true;
        fault = "the server closed the connection";
        return 0;
      }
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      Fail(errno);
      return 0;
    }
  }

  bool Wait(short events) {
    pollfd p{fd_, events, 0};
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now()).count();
      const int ready = poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 0)));
      if (ready > 0) return true;  // readable, writable, or an error the next call reports
      if (ready == 0) {
        fault = "timed out";
        return false;
      }
      if (errno != EINTR) return Fail(errno);
    }
  }

  bool Fail(int err) {
    closed = err == ECONNRESET || err == EPIPE || err == ECONNABORTED;
    fault = std::strerror(err);
    return false;
  }

  int fd_;
  int timeout_ms_;
  std::vector<char> buf_;
  size_t lo_ = 0, hi_ = 0;
};

struct Batch {
  std::vector<std::string> commands;
  size_t window;
  const int64_t* lengths;  // each reply's expected value length
  size_t head_nbytes;
  uint8_t* heads;  // [n, head_nbytes], received
  const uint8_t* expected;  // [n, head_nbytes]
  const uint8_t* mask;  // [head_nbytes]: 1 where a head must equal the expected one
  std::vector<std::pair<uint8_t*, size_t>> dsts;  // the rest of each value goes here
  int8_t* replies;
  int64_t* lengths_out;
  uint32_t* crcs;  // each received value's rest (dsts[i]): its CRC-32
  std::vector<std::pair<size_t, std::string>> errors;
};

bool HeadMatches(const Batch& b, size_t i) {
  const uint8_t* head = b.heads + i * b.head_nbytes;
  const uint8_t* want = b.expected + i * b.head_nbytes;
  for (size_t k = 0; k < b.head_nbytes; ++k) {
    if (b.mask[k] && head[k] != want[k]) return false;
  }
  return true;
}

// Reply i, whose first line is `line`; false on a connection failure (`sock.fault`).
bool ReceiveReply(Socket& sock, Batch& b, size_t i, const std::string& line) {
  const char kind = line.empty() ? '\0' : line[0];
  if (kind == '-') {
    b.replies[i] = kErrorReply;
    b.errors.emplace_back(i, line.substr(1));
    return true;
  }
  if (kind == '_') {  // RESP3's null
    b.replies[i] = kAbsent;
    return true;
  }
  char* end = nullptr;
  const long long n = kind == '$' ? std::strtoll(line.c_str() + 1, &end, 10) : 0;
  if (kind != '$' || end == line.c_str() + 1 || *end != '\0') {
    sock.fault = "a reply that is not a GET's: " + line.substr(0, 40);
    return false;
  }
  if (n < 0) {
    b.replies[i] = kAbsent;
    return true;
  }
  b.lengths_out[i] = n;
  if (n != b.lengths[i]) {
    b.replies[i] = kOtherLength;
    return sock.Skip(static_cast<size_t>(n) + 2);
  }
  if (!sock.Exactly(b.heads + i * b.head_nbytes, b.head_nbytes)) return false;
  if (!HeadMatches(b, i)) {
    b.replies[i] = kHeadMismatch;
    return sock.Skip(static_cast<size_t>(n) - b.head_nbytes + 2);
  }
  if (!sock.Exactly(b.dsts[i].first, b.dsts[i].second, &b.crcs[i]) || !sock.Skip(2)) {
    return false;
  }
  b.replies[i] = kValue;
  return true;
}

// The replies answered before a failure (all of them without one).
size_t ReceiveAll(Socket& sock, Batch& b) {
  const size_t n = b.commands.size();
  std::string ahead;
  for (size_t k = 0; k < std::min(b.window, n); ++k) ahead += b.commands[k];
  if (!sock.SendAll(ahead)) return 0;
  std::string line;
  for (size_t i = 0; i < n; ++i) {
    if (!sock.Line(&line)) return i;
    if (i + b.window < n && !sock.SendAll(b.commands[i + b.window])) return i;
    if (!ReceiveReply(sock, b, i, line)) return i;
  }
  return n;
}

// A loop's result for Python (with the GIL): (replies answered, its fault or None, whether
// the peer closed the connection, {i: error reply text}). Bytes left past the last reply are a
// fault too: every reply was answered, but the connection cannot be reused.
nb::tuple Outcome(Socket& sock, size_t answered, size_t n,
                  const std::vector<std::pair<size_t, std::string>>& errors) {
  nb::dict texts;
  for (auto& [i, text] : errors) texts[nb::int_(i)] = nb::str(text.c_str(), text.size());
  if (answered == n && !sock.Drained()) sock.fault = "bytes past the last reply";
  nb::object fault = sock.fault.empty() ? nb::none() : nb::object(nb::str(sock.fault.c_str()));
  return nb::make_tuple(answered, fault, sock.closed, texts);
}

nb::tuple ReceiveReplies(int fd, nb::list commands, size_t window, ConstInt64s lengths,
                         size_t head_nbytes, Bytes2D heads, ConstBytes2D expected,
                         ConstBytes1D mask, nb::list dsts, Int8s replies, Int64s lengths_out,
                         Uint32s crcs, int timeout_ms) {
  const size_t n = nb::len(commands);
  if (lengths.shape(0) != n || heads.shape(0) != n || expected.shape(0) != n ||
      nb::len(dsts) != n || replies.shape(0) != n || lengths_out.shape(0) != n ||
      crcs.shape(0) != n ||
      heads.shape(1) != head_nbytes || expected.shape(1) != head_nbytes ||
      mask.shape(0) != head_nbytes || window == 0) {
    throw nb::value_error("receive_replies: arrays of other sizes than the commands'");
  }
  Batch b{{}, window, lengths.data(), head_nbytes, heads.data(), expected.data(), mask.data(),
          {}, replies.data(), lengths_out.data(), crcs.data(), {}};
  for (size_t i = 0; i < n; ++i) {
    nb::bytes command = nb::cast<nb::bytes>(commands[i]);
    b.commands.emplace_back(command.c_str(), command.size());
    Row row = nb::cast<Row>(dsts[i]);
    if (static_cast<int64_t>(row.shape(0) + head_nbytes) != b.lengths[i]) {
      throw nb::value_error("receive_replies: a destination of another size than its value");
    }
    b.dsts.emplace_back(row.data(), row.shape(0));
    b.replies[i] = kUnanswered;
  }
  Socket sock(fd, timeout_ms);
  size_t answered;
  {
    nb::gil_scoped_release released;
    answered = ReceiveAll(sock, b);
  }
  return Outcome(sock, answered, n, b.errors);
}

// Commands whose last big argument is a buffer (SET name value [PX ms]): each sent as its
// prefix, its value and the suffix they share, all pipelined, then their simple replies read.
// Returns Outcome's tuple; replies[i]: 0 done ("+..."), 1 refused ("-...").
nb::tuple SendValues(int fd, nb::list prefixes, nb::list values, nb::bytes suffix,
                     Int8s replies, int timeout_ms) {
  const size_t n = nb::len(prefixes);
  if (nb::len(values) != n || replies.shape(0) != n) {
    throw nb::value_error("send_values: lists of other lengths than the prefixes'");
  }
  std::vector<std::string> heads;
  for (size_t i = 0; i < n; ++i) {
    nb::bytes head = nb::cast<nb::bytes>(prefixes[i]);
    heads.emplace_back(head.c_str(), head.size());
  }
  const std::string tail(suffix.c_str(), suffix.size());
  std::vector<iovec> parts;
  for (size_t i = 0; i < n; ++i) {
    ConstBytes1D value = nb::cast<ConstBytes1D>(values[i]);
    parts.push_back({heads[i].data(), heads[i].size()});
    parts.push_back({const_cast<uint8_t*>(value.data()), value.shape(0)});
    parts.push_back({const_cast<char*>(tail.data()), tail.size()});
    replies.data()[i] = kUnanswered;
  }
  Socket sock(fd, timeout_ms);
  std::vector<std::pair<size_t, std::string>> errors;
  size_t answered = 0;
  {
    nb::gil_scoped_release released;
    // at most IOV_MAX parts a call: sendmsg refuses more
    bool sent = true;
    for (size_t at = 0; sent && at < parts.size(); at += 1020) {
      sent = sock.SendParts(parts.data() + at, std::min<size_t>(1020, parts.size() - at));
    }
    std::string line;
    for (; sent && answered < n && sock.Line(&line); ++answered) {
      if (line.empty() || (line[0] != '+' && line[0] != '-')) {
        sock.fault = "a reply that is not a SET's: " + line.substr(0, 40);
        break;
      }
      replies.data()[answered] = line[0] == '+' ? 0 : 1;
      if (line[0] == '-') errors.emplace_back(answered, line.substr(1));
    }
  }
  return Outcome(sock, answered, n, errors);
}

// Each row copied after its head into its value (staged[i] = heads[i] + rows[i]), and the
// CRC-32 of the copy written at crc_offset into the head (little-endian), with the GIL
// released: the values a put sends, a batch at a time.
void StageValues(Bytes2D staged, ConstBytes2D heads, nb::list rows, size_t crc_offset) {
  const size_t n = staged.shape(0), head = heads.shape(1), value = staged.shape(1);
  if (heads.shape(0) != n || nb::len(rows) != n || head > value || crc_offset + 4 > head) {
    throw nb::value_error("stage_values: arrays of other sizes than the rows'");
  }
  std::vector<std::pair<const uint8_t*, size_t>> from;
  for (size_t i = 0; i < n; ++i) {
    ConstBytes1D row = nb::cast<ConstBytes1D>(rows[i]);
    if (row.shape(0) != value - head) {
      throw nb::value_error("stage_values: a row of another size than the values'");
    }
    from.emplace_back(row.data(), row.shape(0));
  }
  nb::gil_scoped_release released;
  for (size_t i = 0; i < n; ++i) {
    uint8_t* out = staged.data() + i * value;
    std::memcpy(out, heads.data() + i * head, head);
    std::memcpy(out + head, from[i].first, from[i].second);
    const uint32_t crc = kCrc32.Update(0, out + head, from[i].second);
    std::memcpy(out + crc_offset, &crc, 4);  // little-endian (x86-64, AArch64)
  }
}

}  // namespace

void DefineStoreIo(nb::module_& m) {
  m.def("send_values", &SendValues, nb::arg("fd"), nb::arg("prefixes"), nb::arg("values"),
        nb::arg("suffix"), nb::arg("replies").noconvert(), nb::arg("timeout_ms"));
  m.def("stage_values", &StageValues, nb::arg("staged").noconvert(),
        nb::arg("heads").noconvert(), nb::arg("rows"), nb::arg("crc_offset"));
  // (the checksum alone, for the tests: zlib.crc32's value)
  m.def("crc32", [](nb::bytes data, uint32_t crc) {
    return kCrc32.Update(crc, reinterpret_cast<const uint8_t*>(data.c_str()), data.size());
  }, nb::arg("data"), nb::arg("crc") = 0);
  m.def("receive_replies", &ReceiveReplies, nb::arg("fd"), nb::arg("commands"),
        nb::arg("window"), nb::arg("lengths").noconvert(), nb::arg("head_nbytes"),
        nb::arg("heads").noconvert(), nb::arg("expected").noconvert(),
        nb::arg("mask").noconvert(), nb::arg("dsts"), nb::arg("replies").noconvert(),
        nb::arg("lengths_out").noconvert(), nb::arg("crcs").noconvert(), nb::arg("timeout_ms"));
}

}  // namespace kvxfer
