// Faults that must end the whole job promptly with a clear message and a
// non-zero exit, never hang. test/meson.build runs each mode under
// test/expect_abort.py with the text it must print. The modes are listed
// above main() and train().
//   GSHARD_DEBUG=1 scripts/mpirun -np 3 build/test/faults debug_kind
#include <gshard/gshard.hpp>
#include <gshard/model/train.hpp>

#include <chrono>
#include <csignal>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

using namespace gshard;
using grid = mesh<axis<"data">, axis<"expert">>;

namespace {

// The training modes:
//   train_throw   one rank throws between the forward and the backward of a step
//   train_kill    one rank is killed by SIGKILL in the middle of a step
//   train_nan     one rank's parameters hold a NaN: the loss is NaN on every rank
//   bad_target    one rank's batch has a target byte outside the vocabulary
//   train_error_after_update  every rank throws after an update whose
//                 weight gathers are still in flight (sharded update)
void train(const grid& m, std::string_view mode) {
  const int victim = m.nranks() - 1;
  const bool sharded = mode == "train_error_after_update";
  model::config c;
  c.model = sharded ? 24 : 16, c.heads = 2, c.head_dim = 8, c.hidden = 32, c.experts = 2 * m.nranks(), c.layers = 2;
  parameters ps = sharded ? parameters(m, 1, shard_weight_update<default_roles::batch>{}) : parameters(m, 1);
  const model::transformer<float, grid> tr(ps, c);
  using tokens_t = model::transformer<float, grid>::tokens_type;
  adam opt({}, ps);
  local_tensor<std::int32_t, 2> tok(2 * m.nranks(), 17);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  const auto tokens = distribute<tokens_t>(m, tok);
  if (mode == "bad_target" && m.rank() == victim) tok(tok.dimension(0) - 1, 16) = 300;  // a target, not an input
  const auto bad = distribute<tokens_t>(m, tok);
  if (mode == "bad_target") model::train_step(tr, ps, opt, bad, 0);
  for (int step = 0; step < 3; ++step) {
    if (step == 1 && mode == "train_nan" && m.rank() == victim)
      ps.values().find("final_norm")->f32()[0] = std::numeric_limits<float>::quiet_NaN();
    if (step == 1 && (mode == "train_throw" || mode == "train_kill")) {
      tape t(ps);
      const auto out = tr.forward(t, tokens, std::uint64_t(step));
      if (m.rank() == victim) {
        if (mode == "train_kill") std::raise(SIGKILL);
        throw error("gshard::test: deliberate failure between the forward and the backward");
      }
      t.backward(out.loss);  // the others wait in the backward's collectives
    }
    model::train_step(tr, ps, opt, tokens, std::uint64_t(step));
    if (sharded) {
      if (ps.weights_in_flight() == 0)  // M = 24 divides at 2, 3, 4 and 8 ranks: some weight's update is sharded
        throw std::logic_error("gshard::test: no gather in flight after the update");
      throw error("gshard::test: an error every rank throws while the updated weights' gathers travel");
    }
  }
}

}  // namespace

// The modes, training's aside (train() above):
//   throw         one rank throws while the others already wait in a collective
//   bad_shard     one rank builds a tensor from a local shard of the wrong extents
//   debug_kind    (GSHARD_DEBUG=1) one rank all_gathers where the others all_reduce
//   debug_axes    (GSHARD_DEBUG=1) one rank reduces over another axis
//   debug_type    (GSHARD_DEBUG=1) one rank reduces floats, the others doubles
//   debug_count   (GSHARD_DEBUG=1) one rank reduces one element more
//   debug_extra   (GSHARD_DEBUG=1) one rank runs a collective the others do not
//   watchdog      (GSHARD_WATCHDOG=3) one rank never arrives at a collective
//   debug_started (GSHARD_DEBUG=1) one rank starts an all_gather where the others start an all_reduce (non-blocking)
//   watchdog_wait (GSHARD_WATCHDOG=3) the others wait for a started all_reduce one rank never starts
//   watchdog_io   (GSHARD_WATCHDOG=3) the others wait 4.5 s in an all_reduce while rank 0 does file I/O:
//                 said, not taken for a stuck rank; then every rank throws alike (exit 2)
//   throw_in_flight one rank throws while a ring reduce_scatter is in flight, the others go on to a collective
//   key_length    one rank's key_lengths holds a length beyond T
//   key_padding   one rank's key paddings hold 0.5
int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const std::string_view mode = argc > 1 ? argv[1] : "throw";
  const int P = env.size();
  grid m(MPI_COMM_WORLD, {1, P});
  const int victim = P - 1;
  const bool odd = m.rank() == victim;
  std::vector<double> v(4, 1.0);
  std::vector<float> f(4, 1.0f);
  std::vector<double> wide(4 * std::size_t(P));
  all_reduce<double>(m.group<"expert">(), v);

  if (mode == "throw" && odd) throw shape_error("gshard::test: deliberate failure on the last rank");
  if (mode == "key_length") {
    using rows = sharding<split<0, "expert">>;
    tensor<float, 4, grid, rows> q(m, {2 * P, 3, 1, 4});
    tensor<std::int32_t, 1, grid, rows> lengths(m, {2 * P});
    lengths.data()[1] = odd ? 4 : 3;
    (void)dot_product_attention(q, q, q, lengths, 0.5);
    all_reduce<double>(m.group<"expert">(), v);
  }
  if (mode == "key_padding") {
    using rows = sharding<split<0, "expert">>;
    tensor<float, 4, grid, rows> q(m, {2 * P, 3, 1, 4});
    tensor<float, 2, grid, rows> paddings(m, {2 * P, 3});
    if (odd) paddings.data()[4] = 0.5f;  // sequence 2P - 1, key 1
    (void)dot_product_attention(q, q, q, paddings, 0.5);
    all_reduce<double>(m.group<"expert">(), v);
  }
  if (mode == "watchdog_io") {
    {
      const debug::awaiting_io io("rank 0's write of a slow file");
      if (m.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(4500));
      all_reduce<double>(m.group<"expert">(), v);
    }
    throw error("gshard::test: the ranks waited for rank 0's file I/O and went on");
  }
  if (mode == "bad_shard") {
    using rows = sharding<split<0, "expert">>;
    tensor<double, 2, grid, rows> t(m, {2 * P, 4}, local_tensor<double, 2>(odd ? 3 : 2, 4));
  }
  if (mode == "debug_kind") {
    if (odd) all_gather<double>(m.group<"expert">(), v, wide);
    else all_reduce<double>(m.group<"expert">(), v);
  }
  if (mode == "debug_axes") all_reduce<double>(odd ? m.group<"data">() : m.group<"expert">(), v);
  if (mode == "debug_type") {
    if (odd) all_reduce<float>(m.group<"expert">(), f);
    else all_reduce<double>(m.group<"expert">(), v);
  }
  if (mode == "debug_count") all_reduce<double>(m.group<"expert">(), std::span<double>(v.data(), odd ? 4 : 3));
  if (mode == "debug_extra" && odd) broadcast<double>(m.group<"expert">(), v, 0);
  if (mode == "watchdog" && odd) std::this_thread::sleep_for(std::chrono::seconds(60));
  if (mode == "debug_started") {
    collective_request p = odd ? start_all_gather<double>(m.group<"expert">(), v, wide) : start_all_reduce<double>(m.group<"expert">(), v);
    p.wait();
  }
  if (mode == "throw_in_flight") {
    try {  // caught (as the trainer catches bad_alloc to say so): the stack unwinds past the request
      std::vector<double> part(4);
      collective_request p = start_reduce_scatter<double>(m.group<"expert">(), wide, part);  // P-1 exchanges: it needs every rank
      if (odd) throw shape_error("gshard::test: deliberate failure with a collective in flight");
      all_reduce<double>(m.group<"expert">(), v);  // the others wait here, so the ring's later exchanges never come
      p.wait();
    } catch (const shape_error&) {
      throw;
    }
  }
  if (mode == "watchdog_wait") {
    if (odd) std::this_thread::sleep_for(std::chrono::seconds(60));
    else start_all_reduce<double>(m.group<"expert">(), v).wait();
  }
  if (mode.starts_with("train") || mode == "bad_target") train(m, mode);

  all_reduce<double>(m.group<"expert">(), v);  // the others wait here
  all_reduce<double>(m.group<"expert">(), v);
  return 0;
}
