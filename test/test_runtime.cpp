// The runtime floor: a mesh bound to the world, the raw collectives and
// their non-blocking forms — what MPI defines, counted, and the errors
// users see, on every rank alike.
#include <gshard/core/bf16.hpp>
#include <gshard/core/counters.hpp>
#include <gshard/core/io.hpp>
#include <gshard/core/raw_storage.hpp>
#include <gshard/runtime/collectives.hpp>
#include <gshard/runtime/mesh.hpp>
#include <gshard/runtime/nonblocking.hpp>
#include <gshard/layout/notation.hpp>

#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <span>
#include <sstream>
#include <utility>

#include "testing.hpp"

using namespace gshard;
using gshard::testing::world_rank;
using gshard::testing::world_size;

using dyn1 = mesh<axis<"x">>;
using dyn2 = mesh<axis<"x">, axis<"y">>;

TEST_CASE("mesh binds to the world with row-major coordinates", "[mesh]") {
  const int P = world_size();
  dyn1 m1(MPI_COMM_WORLD);
  GSHARD_REQUIRE(m1.size(0) == P && m1.coord(0) == world_rank() && m1.nranks() == P);
  GSHARD_REQUIRE(m1.group<"x">().size == P && m1.group<"x">().rank == world_rank());

  dyn2 m2(MPI_COMM_WORLD, {1, P});
  GSHARD_REQUIRE(m2.coord(0) == 0 && m2.coord(1) == world_rank());
  GSHARD_REQUIRE(m2.group<"y">().size == P && m2.group<"x">().size == 1);
  GSHARD_REQUIRE(m2.group<"x", "y">().size == P && m2.group<"x", "y">().label == "x,y");
  GSHARD_REQUIRE(m2.rank_of(m2.coords()) == world_rank());
  GSHARD_REQUIRE(m2.describe() == "mesh(x=1, y=" + std::to_string(P) + ")");

  if (P == 4 || P == 8) {
    dyn2 m(MPI_COMM_WORLD, {2, P / 2});
    GSHARD_REQUIRE(m.coord(0) == world_rank() / (P / 2) && m.coord(1) == world_rank() % (P / 2));
    GSHARD_REQUIRE(m.group<"x">().rank == m.coord(0) && m.group<"y">().rank == m.coord(1));
    GSHARD_REQUIRE(m.group<"x">().size == 2 && m.group<"y">().size == P / 2);
  }
  // A static axis next to a dynamic one: the dynamic size is inferred.
  mesh<axis<"data", 1>, axis<"expert">> m3(MPI_COMM_WORLD);
  GSHARD_REQUIRE(m3.size(1) == P);
}

TEST_CASE("binding a mesh of the wrong size throws on every rank, naming both numbers", "[mesh][errors]") {
  const int P = world_size();
  using nine = mesh<axis<"data", 3>, axis<"expert", 3>>;
  GSHARD_REQUIRE_THROWS_WITH(nine(MPI_COMM_WORLD), mesh_error,
                             "needs 9 ranks but the communicator has " + std::to_string(P));
  GSHARD_REQUIRE_THROWS_WITH(dyn2(MPI_COMM_WORLD), mesh_error, "2 axes have dynamic size");
  GSHARD_REQUIRE_THROWS_WITH((dyn2(MPI_COMM_WORLD, {-2, -2})), mesh_error, "axis x was given size -2; sizes are at least 1");
  GSHARD_REQUIRE_THROWS_WITH((dyn2(MPI_COMM_WORLD, {1, dynamic})), mesh_error, "axis y was given size -1");
  GSHARD_REQUIRE_THROWS_WITH((dyn2(MPI_COMM_WORLD, {P, 2})), mesh_error,
                             "needs " + std::to_string(2 * P) + " ranks but the communicator has " + std::to_string(P));
  if (P == 3) {  // a static axis of 2 leaves no size for the dynamic one
    using half = mesh<axis<"data", 2>, axis<"expert">>;
    GSHARD_REQUIRE_THROWS_WITH(half(MPI_COMM_WORLD), mesh_error, "does not divide the communicator's 3 ranks");
  }
}

TEST_CASE("with_mesh picks the compile-time mesh that fits the world", "[mesh]") {
  const int P = world_size();
  using m1 = mesh<axis<"data", 1>>;
  using m2 = mesh<axis<"data", 2>>;
  using m4 = mesh<axis<"data", 2>, axis<"expert", 2>>;
  using m8 = mesh<axis<"data", 2>, axis<"expert", 4>>;
  if (P != 1 && P != 2 && P != 4 && P != 8) {
    GSHARD_REQUIRE_THROWS_WITH((with_mesh<m1, m2, m4, m8>(MPI_COMM_WORLD, [](const auto&) { return 0; })), mesh_error,
                               "no mesh fits " + std::to_string(P) + " ranks; this program supports 1, 2, 4, 8");
  } else {
    const int axes = with_mesh<m1, m2, m4, m8>(MPI_COMM_WORLD, [&](const auto& m) { return m.naxes() * 100 + m.nranks(); });
    const int want = (P <= 2 ? 100 : 200) + P;
    GSHARD_REQUIRE(axes == want);
  }
}

TEST_CASE("raw collectives compute what MPI defines and are counted", "[collectives]") {
  const int P = world_size(), r = world_rank();
  dyn1 m(MPI_COMM_WORLD);
  const auto& g = m.group<"x">();
  collective_recorder rec;

  std::vector<double> v(5, double(r + 1));
  all_reduce<double>(g, v);
  GSHARD_REQUIRE(v[4] == P * (P + 1) / 2.0);

  std::vector<float> send(3, float(r)), recv(3 * std::size_t(P));
  all_gather<float>(g, send, recv);
  bool ok = true;
  for (int q = 0; q < P; ++q) ok = ok && recv[std::size_t(3 * q + 2)] == float(q);
  GSHARD_REQUIRE(ok);

  std::vector<double> rs_in(2 * std::size_t(P)), rs_out(2);
  for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = double(i);
  reduce_scatter<double>(g, rs_in, rs_out);
  GSHARD_REQUIRE(rs_out[0] == double(2 * r) * P && rs_out[1] == double(2 * r + 1) * P);

  std::vector<double> a2a_in(static_cast<std::size_t>(P)), a2a_out(static_cast<std::size_t>(P));
  for (int j = 0; j < P; ++j) a2a_in[std::size_t(j)] = 100.0 * r + j;  // to rank j
  all_to_all<double>(g, a2a_in, a2a_out);
  ok = true;
  for (int i = 0; i < P; ++i) ok = ok && a2a_out[std::size_t(i)] == 100.0 * i + r;
  GSHARD_REQUIRE(ok);

  std::vector<double> b(4, double(r));
  broadcast<double>(g, b, P - 1);
  GSHARD_REQUIRE(b[3] == double(P - 1));

  std::vector<double> ps{double(r)}, pr{-1.0};
  permute<double>(g, ps, (r + 1) % P, pr, (r + P - 1) % P);
  GSHARD_REQUIRE(pr[0] == double((r + P - 1) % P));

  // Zero-size buffers are fine.
  std::vector<double> none;
  all_reduce<double>(g, none);
  all_gather<double>(g, none, none);
  all_to_all<double>(g, none, none);
  reduce_scatter<double>(g, none, none);

  const auto ev = rec.events();
  GSHARD_REQUIRE(ev.size() == 10);
  GSHARD_REQUIRE((ev[0] == collective_event{collective::all_reduce, "x", 5 * sizeof(double)}));
  GSHARD_REQUIRE((ev[1] == collective_event{collective::all_gather, "x", 3 * sizeof(float)}));
  GSHARD_REQUIRE((ev[2] == collective_event{collective::reduce_scatter, "x", 2 * std::size_t(P) * sizeof(double)}));
  GSHARD_REQUIRE(ev[3].kind == collective::all_to_all && ev[4].kind == collective::broadcast && ev[5].kind == collective::permute);
  GSHARD_REQUIRE(rec.calls(collective::all_reduce, "x") == 2 && rec.bytes(collective::all_to_all) == std::size_t(P) * sizeof(double));

  // Mismatched buffers are refused before MPI sees them.
  std::vector<double> small(1);
  GSHARD_REQUIRE_THROWS_WITH(all_gather<double>(g, v, small), shape_error,
                             P == 1 ? "buffers of 5 and 1" : "do not fit a group of");
}

TEST_CASE("bf16 conversions in vector loops give Eigen's bfloat16(x) to the bit: ties, NaNs, infinities, subnormals",
          "[bf16]") {
  // Every pattern of the upper 16 bits with lower halves that make ties (to
  // even, both ways), just below and above them, and the extremes; as
  // floats and as doubles (rounded through fp32, as Eigen's); whole blocks
  // and a tail; and back, exactly.
  std::vector<float> f;
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      f.push_back(std::bit_cast<float>(hi << 16 | lo));
  f.push_back(1.0f);  // a tail after the blocks of 32
  std::vector<bf16> mine(f.size());
  detail::to_bf16(f.data(), f.size(), mine.data());
  std::vector<double> d(f.begin(), f.end());
  d.push_back(1.0 + 0x1p-8 + 0x1p-30);  // a double just above a tie: fp32 rounds it to the tie first, as Eigen
  std::vector<bf16> from_double(d.size());
  detail::to_bf16(d.data(), d.size(), from_double.data());
  std::size_t wrong = 0, wrong_double = 0, wrong_back = 0;
  std::vector<float> back(f.size());
  detail::from_bf16(mine.data(), mine.size(), back.data());
  for (std::size_t i = 0; i < f.size(); ++i) {
    wrong += mine[i].value != bf16(f[i]).value;
    wrong_back += std::bit_cast<std::uint32_t>(back[i]) != std::uint32_t(mine[i].value) << 16;
  }
  for (std::size_t i = 0; i < d.size(); ++i) wrong_double += from_double[i].value != bf16(d[i]).value;
  INFO(wrong << " of " << f.size() << " floats, " << wrong_double << " doubles differ from Eigen's; " << wrong_back
             << " widened wrong");
  GSHARD_REQUIRE((wrong == 0 && wrong_double == 0 && wrong_back == 0));
}

TEST_CASE("bf16 collectives: 16-bit words on the wire, every sum in fp32 in group-rank order and rounded once",
          "[collectives][bf16]") {
  const int P = world_size(), r = world_rank();
  dyn1 m(MPI_COMM_WORLD);
  const auto& g = m.group<"x">();
  // Rank q's i-th value, exactly representable in bf16, of mixed signs and magnitudes.
  auto value = [](int q, std::size_t i, int salt) {
    return bf16(float(((q * 7919 + int(i) * 104729 + salt) % 1000) - 500) / 7.0f * (i % 3 == 0 ? 64.0f : 1.0f));
  };
  auto row = [&](std::size_t n, int salt) {
    std::vector<bf16> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = value(r, i, salt);
    return v;
  };
  // What the sum must be, bit for bit: the fp32 sum over group ranks 0..P-1,
  // rounded once to bf16 (float(bf16) is exact) — and within bf16's unit
  // roundoff 2^-8 of the exact sum, plus fp32's P·2^-24 of the sum of magnitudes.
  bool within_bound = true;
  auto expected = [&](std::size_t i, int salt, reduction op) {
    float acc = float(value(0, i, salt));
    double exact = acc, mags = std::abs(acc);
    for (int q = 1; q < P; ++q) {
      const float x = float(value(q, i, salt));
      acc = op == reduction::sum ? acc + x : op == reduction::max ? std::max(acc, x) : std::min(acc, x);
      exact += x;
      mags += std::abs(x);
    }
    const bf16 got = bf16(acc);
    if (op == reduction::sum)
      within_bound = within_bound &&
                     std::abs(double(float(got)) - exact) <= std::ldexp(std::abs(exact), -8) + P * std::ldexp(mags, -24);
    return got;
  };
  auto bits = [](bf16 x) { return Eigen::numext::bit_cast<std::uint16_t>(x); };
  collective_recorder rec;

  // 7 elements: blocks of ⌈7/P⌉, the last padded.
  for (const reduction op : {reduction::sum, reduction::max, reduction::min}) {
    std::vector<bf16> v = row(7, 1);
    all_reduce<bf16>(g, v, op);
    bool ok = true;
    for (std::size_t i = 0; i < v.size(); ++i) ok = ok && bits(v[i]) == bits(expected(i, 1, op));
    GSHARD_REQUIRE_MSG(ok, "all_reduce, reduction " + std::to_string(int(op)));
  }
  const std::vector<bf16> ar_in = row(5, 2);
  std::vector<bf16> ar(5);
  all_reduce<bf16>(g, ar_in, ar);
  std::vector<bf16> rs_in = row(3 * std::size_t(P), 3), rs(3);
  reduce_scatter<bf16>(g, rs_in, rs);
  bool ok = true;
  for (std::size_t i = 0; i < 5; ++i) ok = ok && bits(ar[i]) == bits(expected(i, 2, reduction::sum));
  for (std::size_t i = 0; i < 3; ++i) ok = ok && bits(rs[i]) == bits(expected(3 * std::size_t(r) + i, 3, reduction::sum));
  GSHARD_REQUIRE(ok);

  // Moves are exact: every bit pattern arrives as sent.
  std::vector<bf16> ag_send = row(2, 4), a2a_send = row(std::size_t(P), 5);
  std::vector<bf16> ag(2 * std::size_t(P)), a2a(a2a_send.size());
  all_gather<bf16>(g, ag_send, ag);
  all_to_all<bf16>(g, a2a_send, a2a);
  std::vector<bf16> b = row(3, 6);
  broadcast<bf16>(g, b, P - 1);
  std::vector<bf16> ps = row(1, 7), pr(1);
  permute<bf16>(g, ps, (r + 1) % P, pr, (r + P - 1) % P);
  for (int q = 0; q < P; ++q) {
    ok = ok && bits(ag[2 * std::size_t(q) + 1]) == bits(value(q, 1, 4));
    ok = ok && bits(a2a[std::size_t(q)]) == bits(value(q, std::size_t(r), 5));
  }
  ok = ok && bits(b[2]) == bits(value(P - 1, 2, 6)) && bits(pr[0]) == bits(value((r + P - 1) % P, 0, 7));
  GSHARD_REQUIRE(ok);

  // Started forms: the blocking forms' numbers, to the bit, with others in flight.
  std::vector<bf16> nb_ar = row(7, 1), nb_rs(3), nb_ag(ag.size());
  collective_request q1 = start_all_reduce<bf16>(g, nb_ar);
  collective_request q2 = start_reduce_scatter<bf16>(g, rs_in, nb_rs);
  collective_request q3 = start_all_gather<bf16>(g, ag_send, nb_ag);
  while (!q2.test()) {
  }
  q3.wait();
  q1.wait();
  for (std::size_t i = 0; i < 7; ++i) ok = ok && bits(nb_ar[i]) == bits(expected(i, 1, reduction::sum));
  for (std::size_t i = 0; i < 3; ++i) ok = ok && bits(nb_rs[i]) == bits(rs[i]);
  for (std::size_t i = 0; i < ag.size(); ++i) ok = ok && bits(nb_ag[i]) == bits(ag[i]);
  GSHARD_REQUIRE(ok);

  // One rank alone moves a started sum on, and a blocking collective on the
  // group comes before the others test it: its messages are point-to-point
  // under their own tag, so neither waits for the other.
  std::vector<bf16> lone = row(7, 1), mid = row(3, 8);
  collective_request q4 = start_all_reduce<bf16>(g, lone);
  if (r == 0)
    for (int i = 0; i < 50; ++i) q4.test();
  all_reduce<bf16>(g, mid);
  q4.wait();
  for (std::size_t i = 0; i < 7; ++i) ok = ok && bits(lone[i]) == bits(expected(i, 1, reduction::sum));
  for (std::size_t i = 0; i < 3; ++i) ok = ok && bits(mid[i]) == bits(expected(i, 8, reduction::sum));
  GSHARD_REQUIRE(ok);

  // Counted as one collective each, with 2 bytes an element.
  std::vector<bf16> none;
  all_reduce<bf16>(g, none);
  reduce_scatter<bf16>(g, none, none);
  const auto ev = rec.events();
  GSHARD_REQUIRE(ev.size() == 16);
  GSHARD_REQUIRE((ev[0] == collective_event{collective::all_reduce, "x", 7 * 2}));
  GSHARD_REQUIRE((ev[4] == collective_event{collective::reduce_scatter, "x", 3 * std::size_t(P) * 2}));
  GSHARD_REQUIRE((ev[10] == collective_event{collective::reduce_scatter, "x", 3 * std::size_t(P) * 2}));
  GSHARD_REQUIRE((ev[12] == collective_event{collective::all_reduce, "x", 7 * 2}));
  GSHARD_REQUIRE((ev[14] == collective_event{collective::all_reduce, "x", 0}));
  GSHARD_REQUIRE(within_bound);
  GSHARD_REQUIRE(detail::dtype_name<bf16>() == "bf16");
}

TEST_CASE("non-blocking collectives: the blocking forms' results, several in flight at once, counted as they start",
          "[collectives][nonblocking]") {
  const int P = world_size(), r = world_rank();
  dyn1 m(MPI_COMM_WORLD);
  const auto& g = m.group<"x">();
  auto seeded = [&](std::size_t n, int salt) {  // the same global data on every run: rank r's row of it
    std::vector<double> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = double((r * 7919 + int(i) * 104729 + salt) % 1000) / 7.0 - 60.0;
    return v;
  };
  const std::vector<double> rs1_in = seeded(3 * std::size_t(P), 1), rs2_in = seeded(5 * std::size_t(P), 2);
  std::vector<double> rs1(3, -1), rs2(5, -1), ar = seeded(4, 3), ar_in = ar;
  std::vector<float> ag_send(2, float(r) + 0.5f), ag(2 * std::size_t(P), -1);
  std::vector<double> a2a_send = seeded(3 * std::size_t(P), 4), a2a(a2a_send.size(), -1);

  collective_recorder rec;
  // Five in flight at once (two rings on one group: their messages must not
  // mix), a blocking collective among them, finished in another order.
  collective_request p1 = start_reduce_scatter<double>(g, rs1_in, rs1);
  collective_request p2 = start_all_reduce<double>(g, ar);
  collective_request p3 = start_reduce_scatter<double>(g, rs2_in, rs2);
  collective_request p4 = start_all_gather<float>(g, ag_send, ag);
  collective_request p5 = start_all_to_all<double>(g, a2a_send, a2a);
  std::vector<double> mid(1, 1.0);
  all_reduce<double>(g, mid);
  while (!p3.test()) {
  }
  detail::progress_in_flight();  // tests what is in flight; finishes nothing it must not
  p5.wait();
  p4.wait();
  p2.wait();
  p1.wait();
  GSHARD_REQUIRE(p1.test() && p3.test());  // finished stays finished

  const auto ev = rec.events();  // in the order they started, every rank alike
  GSHARD_REQUIRE(ev.size() == 6);
  GSHARD_REQUIRE((ev[0] == collective_event{collective::reduce_scatter, "x", 3 * std::size_t(P) * sizeof(double)}));
  GSHARD_REQUIRE((ev[1] == collective_event{collective::all_reduce, "x", 4 * sizeof(double)}));
  GSHARD_REQUIRE((ev[2] == collective_event{collective::reduce_scatter, "x", 5 * std::size_t(P) * sizeof(double)}));
  GSHARD_REQUIRE((ev[3] == collective_event{collective::all_gather, "x", 2 * sizeof(float)}));
  GSHARD_REQUIRE((ev[4] == collective_event{collective::all_to_all, "x", 3 * std::size_t(P) * sizeof(double)}));
  GSHARD_REQUIRE((ev[5] == collective_event{collective::all_reduce, "x", sizeof(double)}) && mid[0] == double(P));

  // The blocking forms on the same data: gshard's rings add in the same
  // order, so their values are the same to the bit; MPI's own algorithms
  // (the all_reduce; the reduce_scatter under GSHARD_REDUCE_SCATTER=mpi)
  // may add in another order, so theirs agree to rounding.
  std::vector<double> ref1(3), ref2(5), ref_ar = ar_in;
  std::vector<float> ref_ag(ag.size());
  std::vector<double> ref_a2a(a2a.size());
  all_to_all<double>(g, a2a_send, ref_a2a);
  reduce_scatter<double>(g, rs1_in, ref1);
  reduce_scatter<double>(g, rs2_in, ref2);
  all_reduce<double>(g, ref_ar);
  all_gather<float>(g, ag_send, ref_ag);
  auto close = [](const std::vector<double>& a, const std::vector<double>& b) {
    bool same = a.size() == b.size();
    for (std::size_t i = 0; same && i < a.size(); ++i) same = std::abs(a[i] - b[i]) <= 1e-12 * (1 + std::abs(b[i]));
    return same;
  };
  const bool rings = !detail::reduce_scatter_uses_mpi();
  GSHARD_REQUIRE((rings ? rs1 == ref1 && rs2 == ref2 : close(rs1, ref1) && close(rs2, ref2)));
  GSHARD_REQUIRE((close(ar, ref_ar) && ag == ref_ag && a2a == ref_a2a));
  // ... and what they mean: block r of the sum over ranks; every rank's pair.
  bool ok = true;
  for (std::size_t i = 0; i < 5; ++i) {
    double sum = 0;
    for (int q = 0; q < P; ++q) sum += double((q * 7919 + int(5 * std::size_t(r) + i) * 104729 + 2) % 1000) / 7.0 - 60.0;
    ok = ok && std::abs(rs2[i] - sum) < 1e-9 * (1 + std::abs(sum));
  }
  for (int q = 0; q < P; ++q) ok = ok && ag[2 * std::size_t(q) + 1] == float(q) + 0.5f;
  for (int q = 0; q < P; ++q)  // block q of rank q's send: its entries 3r..3r+2
    for (int i = 0; i < 3; ++i)
      ok = ok && a2a[3 * std::size_t(q) + std::size_t(i)] == double((q * 7919 + (3 * r + i) * 104729 + 4) % 1000) / 7.0 - 60.0;
  GSHARD_REQUIRE(ok);

  // One destroyed unfinished is finished first: its buffer holds the result.
  std::vector<double> left(3, double(r));
  { collective_request p = start_all_reduce<double>(g, left); }
  GSHARD_REQUIRE(left[2] == double(P * (P - 1) / 2));
  // Mismatched buffers are refused before MPI sees them, and nothing is counted.
  rec.reset();
  std::vector<double> small(1);
  GSHARD_REQUIRE_THROWS_WITH(start_reduce_scatter<double>(g, small, rs1), shape_error,
                             "gshard::reduce_scatter: buffers of 1 and 3 elements do not fit a group of");
  GSHARD_REQUIRE_THROWS_WITH(start_all_gather<double>(g, left, small), shape_error,
                             "gshard::all_gather: buffers of 3 and 1 elements do not fit a group of");
  GSHARD_REQUIRE_THROWS_WITH(start_all_to_all<double>(g, left, small), shape_error,
                             "gshard::all_to_all: buffers of 3 and 1 elements do not fit a group of");
  GSHARD_REQUIRE(rec.events().empty());
}


TEST_CASE("read_file reads at most its limit: a regular file by its size, a stream as it passes it", "[io]") {
  std::string out = "left over";
  CHECK(io::read_file("/dev/zero", out, 1 << 20) == "/dev/zero holds more than 1048576 bytes; at most 1048576 are read");
  CHECK(out.empty());
  char dir[] = "/tmp/gshard_read_file_XXXXXX";  // this process's own folder
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/hundred";
  std::ofstream(path) << std::string(100, 'x');
  CHECK(io::read_file(path, out, 99) == path + " holds 100 bytes; at most 99 are read");
  CHECK(out.empty());
  CHECK(io::read_file(path, out, 100) == "");
  CHECK(out == std::string(100, 'x'));
  CHECK(io::read_file(path, out) == "");
  std::filesystem::remove_all(dir);
}

TEST_CASE("raw_vector keeps what it held as it grows, its memory through clear(), and nothing after a move",
          "[buffers]") {
  detail::raw_vector<bf16> v;
  CHECK((v.empty() && v.capacity() == 0 && v.data() == nullptr));
  const std::array<float, 5> x{1.0f, -2.5f, 3.25f, 0.0f, 65504.0f};  // h: x in bf16 (65504 rounds to 65536)
  std::array<bf16, 5> h;
  for (std::size_t i = 0; i < x.size(); ++i) h[i] = bf16(x[i]);
  v.append(std::span<const bf16>(h.data(), 3));
  v.append(std::span<const bf16>(h.data() + 3, 2));
  REQUIRE(v.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) CHECK(float(v.data()[i]) == float(h[i]));
  v.resize(1000);  // grows past its capacity: the five kept
  CHECK(v.capacity() >= 1000);
  for (std::size_t i = 0; i < 5; ++i) CHECK(float(v.data()[i]) == float(h[i]));
  const bf16* at = v.data();
  v.resize(2);
  CHECK((v.size() == 2 && v.data() == at));
  v.clear();
  CHECK((v.empty() && v.capacity() >= 1000));
  v.resize(1000);  // within the capacity: the same memory
  CHECK((v.size() == 1000 && v.data() == at));
  detail::raw_vector<bf16> w = std::move(v);
  CHECK((w.data() == at && w.size() == 1000 && v.size() == 0 && v.capacity() == 0 && v.data() == nullptr));
  v = std::move(w);
  CHECK((v.data() == at && v.size() == 1000 && v.capacity() >= 1000 && w.data() == nullptr && w.size() == 0 &&
         w.capacity() == 0));
  std::span<const bf16> s = std::as_const(v);
  CHECK((s.data() == at && s.size() == 1000));
  CHECK_THROWS_AS(detail::uninitialized<double>(std::numeric_limits<std::size_t>::max() / 4), std::bad_array_new_length);
}
