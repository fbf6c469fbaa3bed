// gshard/state/update_targets.hpp — what an optimizer updates for each
// parameter, and how the update reaches the weight the model computes with.
// Per parameter, one of:
//   - the weight itself: its update is not sharded and the weights are in
//     their own type;
//   - the block of its update layout (shard_weight_update), sliced from the
//     weight before each update and all_gathered into it after (left in
//     flight until the weight is next read: weight_gathers);
//   - an fp32 master (f64 for a double weight) when the parameters' weight
//     wire is bf16: kept from step to step — the block of the update layout,
//     or the whole local shard — and the weight made its rounding through
//     bf16: all_gathered in bf16 from the blocks, or rounded in place.
// Built with bf16 weights, it rounds the weights it was given (their masters
// keep them unrounded; a second optimizer built over the same weights
// starts from the rounded values). Before each update a master follows,
// element by element, where its weight no longer holds the master's
// rounding (set elsewhere: initialised, loaded from a checkpoint without
// masters, written by the program), so it never undoes such a change and
// keeps what the other elements have gathered below a bf16 unit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/core/error.hpp"
#include "gshard/kernels/copy_box.hpp"
#include "gshard/state/buckets.hpp"
#include "gshard/state/parameters.hpp"
#include "gshard/state/tensor_set.hpp"
#include "gshard/state/weight_update.hpp"

namespace gshard::detail {

class update_targets {
 public:
  explicit update_targets(parameters_base& ps) : wire_(ps.weight_wire()) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto& g = ps.grads()[i];
      std::unique_ptr<set_entry> e;
      if (g.as_sharded()) {
        e = g.zeros(g.name());
        e->as_sharded()->slice_from(ps.values()[i]);
      } else if (sends_bf16(wire_)) {
        e = ps.values()[i].zeros(g.name());
        copy(ps.values()[i], *e);
      }
      entry_.push_back(e.get());
      if (!e) continue;
      if (sends_bf16(wire_)) masters_.add_entry(std::move(e));
      else blocks_.push_back(std::move(e));
    }
    // The weights hold bf16 values from here on: each rank rounds its own
    // shard, as gathering the rounded blocks would.
    if (sends_bf16(wire_))
      for (auto& w : ps.values()) {
        round_through_bf16(w->f32().data(), w->f32().size(), w->f32().data());
        round_through_bf16(w->f64().data(), w->f64().size(), w->f64().data());
      }
  }

  // What the weights hold: the parameters' weight wire when the optimizer
  // was built.
  wire weights() const { return wire_; }
  // The masters, which checkpoints carry beside the weights (empty unless
  // the weights are bf16).
  tensor_set& masters() { return masters_; }
  // This rank's bytes of masters and blocks.
  std::size_t bytes() {
    std::size_t b = masters_.local_bytes();
    for (auto& e : blocks_) b += e->local_bytes();
    return b;
  }

  // The checks before an update: the weight wire is still the one the
  // masters were made for.
  void check(const parameters_base& ps, std::string_view optimizer) const {
    if (sends_bf16(ps.weight_wire()) == sends_bf16(wire_)) return;
    const auto name = [](wire w) { return sends_bf16(w) ? "bf16" : "same"; };
    throw error("gshard::" + std::string(optimizer) + ": the parameters' weight wire is wire::" + name(ps.weight_wire()) +
                " but the optimizer was built when it was wire::" + name(wire_) +
                " (the masters are its state); set it before building the optimizer");
  }

  // Where an update begins: every gather of the last one finished, and the
  // gathers this one starts (publish) go here.
  weight_gathers& begin(parameters_base& ps) { return ps.start_gathers(wire_); }

  // Before parameter i's update: the entry to update — its block or master,
  // up to date with the weight — or the weight itself.
  set_entry& target(std::size_t i, parameters_base& ps) {
    set_entry* e = entry_[i];
    if (!e) return ps.values_as_held()[i];
    if (auto* block = e->as_sharded()) {
      if (sends_bf16(wire_)) block->follow(ps.values_as_held()[i]);
      else block->slice_from(ps.values_as_held()[i]);
    } else {
      set_entry& w = ps.values_as_held()[i];
      follow_rounded(e->f32().data(), w.f32().data(), e->f32().size());
      follow_rounded(e->f64().data(), w.f64().data(), e->f64().size());
    }
    return *e;
  }
  // The same entry, as target() last left it.
  set_entry& current(std::size_t i, parameters_base& ps) { return entry_[i] ? *entry_[i] : ps.values_as_held()[i]; }

  // After it: the update reaches the weight — gathered (through `gathers`,
  // begin()'s), or rounded in place. Every rank calls it for the same
  // parameters in the same order.
  void publish(std::size_t i, parameters_base& ps, weight_gathers& gathers) {
    set_entry* e = entry_[i];
    if (!e) return;
    if (auto* block = e->as_sharded()) {
      gathers.gather(i, *block, ps.values_as_held()[i]);
      progress_in_flight();  // a started gather travels while the next weights update
      return;
    }
    set_entry& w = ps.values_as_held()[i];
    round_through_bf16(e->f32().data(), e->f32().size(), w.f32().data());
    round_through_bf16(e->f64().data(), e->f64().size(), w.f64().data());
  }

 private:
  static void copy(set_entry& from, set_entry& to) {
    std::copy(from.f32().begin(), from.f32().end(), to.f32().begin());
    std::copy(from.f64().begin(), from.f64().end(), to.f64().begin());
  }

  wire wire_;
  std::vector<set_entry*> entry_;                   // per parameter: its block or master, or null
  tensor_set masters_;                              // the masters (weight wire bf16), by the parameters' names
  std::vector<std::unique_ptr<set_entry>> blocks_;  // the blocks sliced each step (weights in their own type)
};

}  // namespace gshard::detail
