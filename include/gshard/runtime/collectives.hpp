// gshard/runtime/collectives.hpp — typed MPI collectives over the communicator of a
// set of mesh axes, on contiguous buffers. Each call is one MPI call, counted
// in gshard/core/counters.hpp. The tensor-level forms (which pack and unpack along
// a tensor dim) are in gshard/tensor/tensor_collectives.hpp.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "gshard/core/bf16.hpp"
#include "gshard/core/counters.hpp"
#include "gshard/core/options.hpp"
#include "gshard/core/raw_storage.hpp"
#include "gshard/core/error.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/runtime/debug.hpp"
#include "gshard/runtime/mpi.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard {

namespace detail {
// What every collective, blocking or not (nonblocking.hpp), does first:
// takes its number in the mesh's sequence, has the watchdog watch it from
// here (`watch`: until the caller drops it), and in the checked mode
// compares itself with the other ranks (debug.hpp). `type` and `count`
// describe its input (count -1: it may differ across ranks, as for gather
// and scatter). Returns its number.
inline std::uint64_t open_collective(collective kind, const axis_group& g, std::size_t bytes, int type, std::int64_t count,
                                     std::optional<debug::watch>& watch) {
  const std::uint64_t seq = g.sequence ? (*g.sequence)++ : 0;
  if (options().watchdog_seconds > 0) {
    debug::start_watchdog();  // once per process
    watch.emplace(kind, g.label, bytes, seq);
  }
  if (debug::checked() && g.mesh_comm != MPI_COMM_NULL) debug::check(g.mesh_comm, g.comm, seq, kind, g.label, type, count);
  return seq;
}

// Counts one collective, with the wall time of its MPI call(s) on this rank;
// traces it; and, when asked, lets the watchdog watch it and checks it
// against the other ranks first.
class timed_collective {
 public:
  timed_collective(collective kind, const axis_group& g, std::size_t bytes, int type, std::int64_t count)
      : kind_(kind), axes_(g.label), bytes_(bytes) {
    open_collective(kind, g, bytes, type, count, watch_);
    t0_ = MPI_Wtime();
  }
  timed_collective(const timed_collective&) = delete;
  timed_collective& operator=(const timed_collective&) = delete;
  ~timed_collective() {
    const double t1 = MPI_Wtime();
    count_collective(kind_, axes_, bytes_, t1 - t0_);
    if (trace::enabled())
      trace::add(name_of(kind_), "collective", t0_ + trace::detail::st().offset, t1 + trace::detail::st().offset,
                 "\"axes\":\"" + trace::detail::escape(axes_) + "\",\"bytes\":" + std::to_string(bytes_));
  }

 private:
  counted_scope depth_;  // first: counted before the checked mode's own calls, and uncounted even if they throw
  collective kind_;
  const std::string& axes_;  // the group's label: the mesh outlives every collective on it
  std::size_t bytes_;
  double t0_ = 0;
  std::optional<debug::watch> watch_;
};

inline void require_size(bool ok, const char* op, const axis_group& g, std::size_t send, std::size_t recv) {
  if (!ok)
    throw shape_error(std::string("gshard::") + op + ": buffers of " + std::to_string(send) + " and " +
                      std::to_string(recv) + " elements do not fit a group of " + std::to_string(g.size) +
                      " ranks over {" + g.label + "}");
}
}  // namespace detail

// MPI_COMM_WORLD as a group (label "world"), for what runs before or beside
// a mesh: the run-time options, a text every rank reads, a job-wide stop.
inline const detail::axis_group& world_group() {
  static std::uint64_t sequence = 0;
  static const detail::axis_group g = [] {
    detail::axis_group w;
    w.comm = MPI_COMM_WORLD;
    mpi::check(MPI_Comm_size(w.comm, &w.size), "MPI_Comm_size");
    mpi::check(MPI_Comm_rank(w.comm, &w.rank), "MPI_Comm_rank");
    w.mask = 0;
    w.label = "world";
    w.mesh_comm = MPI_COMM_WORLD;
    w.sequence = &sequence;
    return w;
  }();
  return g;
}

// How an all_reduce combines: the sum (every plan's), or the element-wise
// maximum or minimum (agreements such as dropless routing's capacity).
enum class reduction : std::uint8_t { sum, max, min };

namespace detail {
inline MPI_Op mpi_op(reduction op) { return op == reduction::sum ? MPI_SUM : op == reduction::max ? MPI_MAX : MPI_MIN; }
}  // namespace detail

namespace detail {
// Sums of bf16 numbers. MPI has no bf16 type and MPI_SUM on 16-bit words
// adds them as integers; a ring would round its running sum at each of its
// P-1 steps. So the group's P blocks of `chunk` elements travel as 16-bit
// words in one all_to_all (the ring's bytes: (P-1)/P of the data per rank),
// and each rank combines the P parts of its block in fp32, in group-rank
// order, and rounds once — the same numbers on every rank: the fp32 sum's
// error (at most (P-1)·2^-24 of the sum of magnitudes) and one rounding.
template <class T>
inline constexpr bool sums_in_fp32 = !std::is_same_v<sum_t<T>, T>;

// out = the P parts (part p at parts + p·chunk) combined in fp32, rounded once.
inline void combine_parts(const bf16* parts, std::size_t chunk, int P, reduction op, bf16* out) {
  // Kept from call to call at their largest: the messages' sizes differ
  // (gradient buckets, weights one by one), and an Eigen array reallocated
  // at each new size touched fresh pages every call.
  thread_local raw_vector<float> acc_buffer, part_buffer;
  acc_buffer.resize(chunk), part_buffer.resize(chunk);
  Eigen::Map<Eigen::ArrayXf> acc(acc_buffer.data(), Eigen::Index(chunk)), part(part_buffer.data(), Eigen::Index(chunk));
  from_bf16(parts, chunk, acc.data());
  for (int p = 1; p < P; ++p) {
    from_bf16(parts + std::size_t(p) * chunk, chunk, part.data());
    if (op == reduction::sum) acc += part;
    else if (op == reduction::max) acc = acc.max(part);
    else acc = acc.min(part);
  }
  to_bf16(acc.data(), chunk, out);
}

// recv (chunk elements) = block g.rank of the group's sum of send (P·chunk elements).
inline void reduce_scatter_fp32(const axis_group& g, const bf16* send, bf16* recv, std::size_t chunk, reduction op) {
  if (g.size == 1) {
    std::copy(send, send + chunk, recv);
    return;
  }
  thread_local std::vector<bf16> parts;
  parts.resize(chunk * std::size_t(g.size));
  const int n = mpi::count(chunk, "reduce_scatter");
  mpi::check(MPI_Alltoall(send, n, mpi::datatype<bf16>(), parts.data(), n, mpi::datatype<bf16>(), g.comm), "MPI_Alltoall");
  combine_parts(parts.data(), chunk, g.size, op, recv);
}

// out (count elements; may be send) = the group's sum of send: reduce_scatter_fp32
// over blocks of ⌈count/P⌉ (the last padded), then an all_gather of the blocks.
inline void all_reduce_fp32(const axis_group& g, const bf16* send, bf16* out, std::size_t count, reduction op) {
  if (g.size == 1) {
    std::copy(send, send + count, out);
    return;
  }
  const std::size_t P = std::size_t(g.size), chunk = (count + P - 1) / P;
  const bool whole = chunk * P == count;  // no padding: the blocks straight from send, into out
  thread_local std::vector<bf16> padded, mine;
  if (!whole) {
    padded.assign(send, send + count);
    padded.resize(chunk * P, bf16(0.0f));
  }
  mine.resize(chunk);
  reduce_scatter_fp32(g, whole ? send : padded.data(), mine.data(), chunk, op);
  const int n = mpi::count(chunk, "all_reduce");
  mpi::check(MPI_Allgather(mine.data(), n, mpi::datatype<bf16>(), whole ? out : padded.data(), n, mpi::datatype<bf16>(),
                           g.comm),
             "MPI_Allgather");
  if (!whole) std::copy(padded.begin(), padded.begin() + std::ptrdiff_t(count), out);
}
}  // namespace detail

// x |-> the sum (or max, min) over the group of x, in place.
template <class T>
void all_reduce(const detail::axis_group& g, std::span<T> data, reduction op = reduction::sum) {
  const detail::timed_collective timed(
      collective::all_reduce, g, data.size_bytes(), debug::type_code<T>(), std::int64_t(data.size()));
  if constexpr (detail::sums_in_fp32<T>)
    detail::all_reduce_fp32(g, data.data(), data.data(), data.size(), op);
  else
    mpi::check(MPI_Allreduce(MPI_IN_PLACE, data.data(), mpi::count(data.size(), "all_reduce"), mpi::datatype<T>(),
                             detail::mpi_op(op), g.comm),
               "MPI_Allreduce");
}

// recv = sum over the group of send (out of place).
template <class T>
void all_reduce(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size(), "all_reduce", g, send.size(), recv.size());
  const detail::timed_collective timed(
      collective::all_reduce, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()));
  if constexpr (detail::sums_in_fp32<T>)
    detail::all_reduce_fp32(g, send.data(), recv.data(), send.size(), reduction::sum);
  else
    mpi::check(MPI_Allreduce(send.data(), recv.data(), mpi::count(send.size(), "all_reduce"), mpi::datatype<T>(), MPI_SUM,
                             g.comm),
               "MPI_Allreduce");
}

// recv = concat over group ranks r of send(r); recv.size() == send.size() * g.size.
template <class T>
void all_gather(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(recv.size() == send.size() * std::size_t(g.size), "all_gather", g, send.size(), recv.size());
  const detail::timed_collective timed(
      collective::all_gather, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()));
  const int n = mpi::count(send.size(), "all_gather");
  mpi::check(MPI_Allgather(send.data(), n, mpi::datatype<T>(), recv.data(), n, mpi::datatype<T>(), g.comm), "MPI_Allgather");
}

namespace detail {
// Which reduce-scatter runs: gshard's ring (default) or MPI_Reduce_scatter_block
// (GSHARD_REDUCE_SCATTER=mpi, agreed across ranks: core/options.hpp).
// OpenMPI 4.1's reduce-scatter measured 3-4x slower than the ring here, and
// slower than its own allreduce.
inline bool reduce_scatter_uses_mpi() { return options().reduce_scatter_mpi != 0; }

// Ring reduce-scatter, the bandwidth-optimal algorithm: P-1 steps, each
// passing one running partial sum of n/P elements to the right neighbour and
// adding this rank's block to the one arriving from the left. Rank r ends
// with block r. The summation order is fixed for a given P.
// The ring's arithmetic, shared by the blocking ring and the non-blocking one
// (nonblocking.hpp), so both add the same numbers in the same order: at
// exchange `step` rank r adds its own block ring_block(r, step, P) to the
// partial sum arriving from the left; it first sends ring_block(r, -1, P).
constexpr int ring_block(int r, int step, int P) { return ((r - step - 2) % P + P) % P; }
template <class T>
void ring_add(const T* own, const T* incoming, T* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = own[i] + incoming[i];
}

template <class T>
void ring_reduce_scatter(const axis_group& g, const T* send, T* recv, std::size_t chunk) {
  const int P = g.size, r = g.rank;
  if (P == 1) {
    std::copy(send, send + chunk, recv);
    return;
  }
  thread_local std::vector<T> incoming;
  incoming.resize(chunk);
  const int right = (r + 1) % P, left = (r + P - 1) % P;
  const int n = mpi::count(chunk, "reduce_scatter");
  const T* running = send + std::size_t(ring_block(r, -1, P)) * chunk;
  for (int step = 0; step < P - 1; ++step) {
    mpi::check(MPI_Sendrecv(running, n, mpi::datatype<T>(), right, 0x7273, incoming.data(), n, mpi::datatype<T>(), left,
                            0x7273, g.comm, MPI_STATUS_IGNORE),
               "MPI_Sendrecv");
    ring_add(send + std::size_t(ring_block(r, step, P)) * chunk, incoming.data(), recv, chunk);
    running = recv;
  }
}
}  // namespace detail

// recv = block `g.rank` of the sum over group ranks of send; send.size() == recv.size() * g.size.
// bf16: detail::reduce_scatter_fp32 (GSHARD_REDUCE_SCATTER does not apply).
template <class T>
void reduce_scatter(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size() * std::size_t(g.size), "reduce_scatter", g, send.size(), recv.size());
  const detail::timed_collective timed(
      collective::reduce_scatter, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()));
  if constexpr (detail::sums_in_fp32<T>)
    detail::reduce_scatter_fp32(g, send.data(), recv.data(), recv.size(), reduction::sum);
  else if (!detail::reduce_scatter_uses_mpi())
    detail::ring_reduce_scatter<T>(g, send.data(), recv.data(), recv.size());
  else
    mpi::check(MPI_Reduce_scatter_block(send.data(), recv.data(), mpi::count(recv.size(), "reduce_scatter"),
                                        mpi::datatype<T>(), MPI_SUM, g.comm),
               "MPI_Reduce_scatter_block");
}

// Every rank of the group waits until all have arrived (timing, the trace's
// clock alignment); no data moves.
inline void barrier(const detail::axis_group& g) {
  const detail::timed_collective timed(collective::barrier, g, 0, 0, 0);
  mpi::check(MPI_Barrier(g.comm), "MPI_Barrier");
}

// The max (or min, sum) over the group of one number, on every rank.
template <class T>
  requires std::is_arithmetic_v<T>
T all_reduce(const detail::axis_group& g, T value, reduction op) {
  all_reduce(g, std::span<T>(&value, 1), op);
  return value;
}

// Group rank `root`'s text, on every rank: its length, then its bytes
// (counted as one broadcast). A root's verdict travels this way, so every
// rank throws the same error or none.
inline std::string broadcast_text(const detail::axis_group& g, std::string text, int root = 0) {
  const detail::timed_collective timed(collective::broadcast, g, g.rank == root ? text.size() : 0, debug::type_code<char>(), -1);
  unsigned long long n = text.size();
  mpi::check(MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, g.comm), "MPI_Bcast");
  text.resize(std::size_t(n));
  mpi::check(MPI_Bcast(text.data(), mpi::count(text.size(), "broadcast"), MPI_CHAR, root, g.comm), "MPI_Bcast");
  return text;
}

// Every rank's text, concatenated in group-rank order on `root` (empty
// elsewhere): the lengths, then the bytes (counted as one gather).
inline std::string gather_text(const detail::axis_group& g, const std::string& mine, int root = 0) {
  const detail::timed_collective timed(collective::gather, g, mine.size(), debug::type_code<char>(), -1);
  const int len = mpi::count(mine.size(), "gather");
  const bool is_root = g.rank == root;
  std::vector<int> lens(is_root ? std::size_t(g.size) : 0), displs(lens.size());
  mpi::check(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, root, g.comm), "MPI_Gather");
  std::size_t total = 0;
  for (std::size_t r = 0; r < lens.size(); ++r) {
    displs[r] = mpi::count(total, "gather");
    total += std::size_t(lens[r]);
  }
  std::string all(total, '\0');
  mpi::check(MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, root, g.comm),
             "MPI_Gatherv");
  return all;
}

namespace detail {
// Whether `bytes` bytes from p are all zero bits (a -0.0 is not).
inline bool all_zero_bits(const unsigned char* p, std::size_t bytes) {
  std::uint64_t acc = 0;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc |= w;
  }
  for (; i < bytes; ++i) acc |= p[i];
  return acc == 0;
}

// An all_to_all's pieces without their trailing rows of zeros
// (wire::trimmed): each piece of `piece` elements is matrices of `rows`
// rows of `row` elements, and the message to a rank holds its piece's kept
// row count of each matrix (4 bytes each), then the kept rows.
struct trimmed_messages {
  std::vector<unsigned char> bytes;  // every message but this rank's own, back to back
  std::vector<std::size_t> at;       // message q is bytes [at[q], at[q + 1])
  std::size_t counted = 0;           // every trimmed piece's bytes, this rank's own included
};
// The largest message: every row kept.
template <class T>
std::size_t trimmed_room(std::size_t piece, std::size_t rows, std::size_t row) {
  return piece / (rows * row) * sizeof(std::uint32_t) + piece * sizeof(T);
}
// A piece of `piece` elements is matrices of rows x row elements.
inline void require_rows(std::size_t piece, std::size_t rows, std::size_t row) {
  if (rows == 0 || row == 0 || piece % (rows * row) != 0)
    throw error("gshard::all_to_all_trimmed: a piece of " + std::to_string(piece) + " elements is not matrices of " +
                std::to_string(rows) + " rows of " + std::to_string(row) + " elements");
}
// The messages of send's P pieces, built in `buffer` (kept from an earlier call, or empty).
template <class T>
trimmed_messages trim_pieces(const T* send, int P, int self, std::size_t piece, std::size_t rows, std::size_t row,
                             std::vector<unsigned char>&& buffer) {
  const std::size_t mats = piece / (rows * row), row_bytes = row * sizeof(T), head = mats * sizeof(std::uint32_t);
  trimmed_messages m{std::move(buffer), std::vector<std::size_t>(std::size_t(P) + 1, 0), 0};
  std::vector<std::uint32_t> kept(mats * std::size_t(P));
  for (int q = 0; q < P; ++q) {
    std::size_t size = head;
    for (std::size_t k = 0; k < mats; ++k) {
      const auto* mat = reinterpret_cast<const unsigned char*>(send + std::size_t(q) * piece + k * rows * row);
      std::size_t n = rows;
      while (n > 0 && all_zero_bits(mat + (n - 1) * row_bytes, row_bytes)) --n;
      kept[std::size_t(q) * mats + k] = std::uint32_t(n);
      size += n * row_bytes;
    }
    m.counted += size;
    m.at[std::size_t(q) + 1] = m.at[std::size_t(q)] + (q == self ? 0 : size);
  }
  m.bytes.resize(m.at.back());
  for (int q = 0; q < P; ++q) {
    if (q == self) continue;
    unsigned char* out = m.bytes.data() + m.at[std::size_t(q)];
    std::memcpy(out, kept.data() + std::size_t(q) * mats, head);
    out += head;
    for (std::size_t k = 0; k < mats; ++k) {
      const std::size_t n = kept[std::size_t(q) * mats + k] * row_bytes;
      std::memcpy(out, send + std::size_t(q) * piece + k * rows * row, n);
      out += n;
    }
  }
  return m;
}
// Posts the receive of every other rank's message into its `room` bytes
// of inbox, and the send of each message, with `tag`; the requests in req.
inline void post_trimmed(const axis_group& g, const trimmed_messages& m, unsigned char* inbox, std::size_t room, int tag,
                         std::vector<MPI_Request>& req) {
  const int n = mpi::count(room, "all_to_all");
  req.reserve(req.size() + 2 * std::size_t(g.size - 1));
  for (int q = 0; q < g.size; ++q) {
    if (q == g.rank) continue;
    mpi::check(MPI_Irecv(inbox + std::size_t(q) * room, n, MPI_BYTE, q, tag, g.comm, &req.emplace_back()), "MPI_Irecv");
    const std::size_t at = m.at[std::size_t(q)], size = m.at[std::size_t(q) + 1] - at;
    mpi::check(MPI_Isend(m.bytes.data() + at, mpi::count(size, "all_to_all"), MPI_BYTE, q, tag, g.comm, &req.emplace_back()),
               "MPI_Isend");
  }
}
// Every other rank's message in inbox widened into its piece of recv: the kept rows, then zeros.
template <class T>
void widen_trimmed(const unsigned char* inbox, std::size_t room, int P, int self, std::size_t piece, std::size_t rows,
                   std::size_t row, T* recv) {
  const std::size_t mats = piece / (rows * row), head = mats * sizeof(std::uint32_t);
  for (int q = 0; q < P; ++q) {
    if (q == self) continue;
    const unsigned char* counts = inbox + std::size_t(q) * room;
    const unsigned char* kept_rows = counts + head;
    T* to = recv + std::size_t(q) * piece;
    for (std::size_t k = 0; k < mats; ++k) {
      std::uint32_t kept = 0;
      std::memcpy(&kept, counts + k * sizeof kept, sizeof kept);
      const std::size_t n = std::min<std::size_t>(kept, rows) * row;
      std::memcpy(to, kept_rows, n * sizeof(T));
      std::fill(to + n, to + rows * row, T(0));
      kept_rows += n * sizeof(T);
      to += rows * row;
    }
  }
}
}  // namespace detail

// all_to_all with wire::trimmed: send and recv hold P pieces, each of
// matrices of `rows` rows of `row` elements; a piece travels without each
// matrix's trailing rows of zeros (its row counts first, 4 bytes each),
// and the receiver writes them back — recv as all_to_all leaves it, to the
// bit, in fewer bytes where pieces end in zero rows (the MoE layer's empty
// capacity slots). Point-to-point messages of bytes (their sizes differ by
// rank), counted as one all_to_all of the trimmed pieces' bytes (this
// rank's own included, as all_to_all counts it); the checked mode compares
// it as all_to_all: its kind, axes, element type and element count
// (send's). Where a whole piece would not fit one MPI message of bytes
// (2 GiB), reshards send it as all_to_all does (execute_reshard.hpp).
template <class T>
void all_to_all_trimmed(const detail::axis_group& g, std::span<const T> send, std::span<T> recv, std::size_t rows,
                        std::size_t row) {
  const std::size_t P = std::size_t(g.size);
  detail::require_size(send.size() == recv.size() && send.size() % P == 0, "all_to_all", g, send.size(), recv.size());
  detail::require_rows(send.size() / P, rows, row);
  const std::size_t piece = send.size() / P, room = detail::trimmed_room<T>(piece, rows, row);
  (void)mpi::count(room, "all_to_all");  // before it is counted
  thread_local std::vector<unsigned char> out_buffer, inbox;  // kept from call to call: fresh pages are slow
  detail::trimmed_messages m = detail::trim_pieces(send.data(), g.size, g.rank, piece, rows, row, std::move(out_buffer));
  {
    const detail::timed_collective timed(collective::all_to_all, g, m.counted, debug::type_code<T>(),
                                         std::int64_t(send.size()));
    std::copy(send.data() + std::size_t(g.rank) * piece, send.data() + (std::size_t(g.rank) + 1) * piece,
              recv.data() + std::size_t(g.rank) * piece);
    if (P > 1) {
      inbox.resize(room * P);
      std::vector<MPI_Request> req;
      detail::post_trimmed(g, m, inbox.data(), room, 0x7461, req);  // an MPI error ends the job (mpi::check)
      mpi::check(MPI_Waitall(int(req.size()), req.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    }
  }
  if (P > 1) detail::widen_trimmed(inbox.data(), room, g.size, g.rank, piece, rows, row, recv.data());
  out_buffer = std::move(m.bytes);
}

// Block j of send goes to group rank j; block i of recv comes from group rank i.
template <class T>
void all_to_all(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size() && send.size() % std::size_t(g.size) == 0, "all_to_all", g, send.size(),
                       recv.size());
  const detail::timed_collective timed(
      collective::all_to_all, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()));
  const int n = mpi::count(send.size() / std::size_t(g.size), "all_to_all");
  mpi::check(MPI_Alltoall(send.data(), n, mpi::datatype<T>(), recv.data(), n, mpi::datatype<T>(), g.comm), "MPI_Alltoall");
}

// data |-> data of group rank `root`.
template <class T>
void broadcast(const detail::axis_group& g, std::span<T> data, int root) {
  const detail::timed_collective timed(
      collective::broadcast, g, data.size_bytes(), debug::type_code<T>(), std::int64_t(data.size()));
  mpi::check(MPI_Bcast(data.data(), mpi::count(data.size(), "broadcast"), mpi::datatype<T>(), root, g.comm), "MPI_Bcast");
}

// Collective permute: every rank sends `send` to group rank `dest` and
// receives `recv` from group rank `source` (the inverse of someone's dest).
template <class T>
void permute(const detail::axis_group& g, std::span<const T> send, int dest, std::span<T> recv, int source) {
  const detail::timed_collective timed(
      collective::permute, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()));
  mpi::check(MPI_Sendrecv(send.data(), mpi::count(send.size(), "permute"), mpi::datatype<T>(), dest, 0x6773, recv.data(),
                          mpi::count(recv.size(), "permute"), mpi::datatype<T>(), source, 0x6773, g.comm,
                          MPI_STATUS_IGNORE),
             "MPI_Sendrecv");
}

}  // namespace gshard
