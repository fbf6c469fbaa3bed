// gshard/state/checkpoint.hpp — save and load sharded parameters (and optimizer
// state) with their global shapes. Rank 0 gathers each tensor and writes one
// file, atomically (a temporary file, fsync, rename: a crash during a save
// leaves the previous checkpoint intact). Loading scatters each tensor into
// the sharding the current program uses, so a checkpoint written at one rank
// count loads at any other. Every problem is found on rank 0 and raised as
// gshard::checkpoint_error on every rank, naming the file and what is wrong.
//   save_checkpoint(path, mesh, parts, meta);  meta = load_checkpoint(path, mesh, parts);
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gshard/state/parameters.hpp"
#include "gshard/runtime/collectives.hpp"
#include "gshard/core/fnv1a.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/io.hpp"
#include "gshard/tensor/reshard.hpp"

namespace gshard {

class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

// The file's format (native byte order, little-endian on x86-64):
//   "GSHARDCK" u32 version=1
//   u64 n_meta, then n_meta × { u32 len, name, f64 value }
//   u64 n_records, then n_records × {
//     u32 len, name; u8 element bytes (4 or 8); u32 rank; u64 extents[rank];
//     u32 len, sharding text when saved; u64 n_bytes; data (global, row-major);
//     u64 FNV-1a of the data }
//   "GSHARDEND" u64 FNV-1a of every byte before "GSHARDEND"
struct ckpt_writer {
  std::string buf;
  template <class V>
  void put(const V& v) {
    buf.append(reinterpret_cast<const char*>(&v), sizeof(V));
  }
  void put_string(const std::string& s) {
    put(std::uint32_t(s.size()));
    buf += s;
  }
};

struct ckpt_record {
  std::string name, sharding;
  int elem_bytes = 0;
  std::vector<index_t> extents;
  std::size_t offset = 0, bytes = 0;  // data in the file buffer
};

// Parses and checks the whole file on the root; returns "" or the problem.
// Reads the format field after field; its lambdas carry the position and
// the name of what is being read, for the message.
inline std::string parse_checkpoint(const std::string& f, std::map<std::string, double>& meta,
                                    std::map<std::string, ckpt_record>& records) {
  std::size_t at = 0;
  std::string where = "the header";
  auto need = [&](std::size_t n) {  // at <= f.size() always; no overflow
    if (n > f.size() - at) throw std::runtime_error("the file ends inside " + where + " (truncated)");
  };
  auto get = [&]<class V>(V& v) {
    need(sizeof(V));
    std::memcpy(&v, f.data() + at, sizeof(V));
    at += sizeof(V);
  };
  auto get_string = [&](std::string& s) {
    std::uint32_t n = 0;
    get(n);
    need(n);
    s.assign(f.data() + at, n);
    at += n;
  };
  try {
    need(8);
    if (f.compare(0, 8, "GSHARDCK") != 0) return "not a gshard checkpoint (bad magic)";
    at = 8;
    std::uint32_t version = 0;
    get(version);
    if (version != 1) return "checkpoint version " + std::to_string(version) + " is not supported (this gshard reads 1)";
    std::uint64_t n_meta = 0;
    get(n_meta);
    for (std::uint64_t i = 0; i < n_meta; ++i) {
      where = "metadata entry " + std::to_string(i);
      std::string name;
      double v = 0;
      get_string(name);
      get(v);
      meta[name] = v;
    }
    std::uint64_t n_records = 0;
    where = "the record count";
    get(n_records);
    for (std::uint64_t i = 0; i < n_records; ++i) {
      ckpt_record r;
      where = "record " + std::to_string(i);
      get_string(r.name);
      where = "record '" + r.name + "'";
      std::uint8_t eb = 0;
      std::uint32_t rank = 0;
      get(eb);
      get(rank);
      if ((eb != 4 && eb != 8) || rank > std::uint32_t(max_rank)) return "record '" + r.name + "' has a corrupted header";
      r.elem_bytes = eb;
      std::uint64_t elements = 1;
      for (std::uint32_t d = 0; d < rank; ++d) {
        std::uint64_t e = 0;
        get(e);
        // No extent or product may exceed what a file can hold: checked before multiplying.
        if (e > f.size() || (e != 0 && elements > f.size() / e)) return "record '" + r.name + "' has a corrupted shape";
        r.extents.push_back(index_t(e));
        elements *= e;
      }
      get_string(r.sharding);
      std::uint64_t bytes = 0;
      get(bytes);
      if (bytes != elements * eb) return "record '" + r.name + "' holds " + std::to_string(bytes) + " bytes for its shape";
      need(bytes);
      r.offset = at, r.bytes = bytes;
      at += bytes;
      std::uint64_t h = 0;
      get(h);
      if (h != fnv1a(f.data() + r.offset, r.bytes)) return "record '" + r.name + "': data checksum mismatch (corrupted)";
      records[r.name] = r;
    }
    where = "the trailer";
    const std::size_t body = at;
    need(9);
    if (f.compare(at, 9, "GSHARDEND") != 0) return "the trailer is missing (truncated or corrupted)";
    at += 9;
    std::uint64_t h = 0;
    get(h);
    if (h != fnv1a(f.data(), body)) return "file checksum mismatch (corrupted)";
    if (at != f.size()) return "unexpected bytes after the trailer";
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// Rank 0's verdict, raised on every rank.
inline void agree_or_throw(const std::string& problem_on_root, const std::string& path, const axis_group& g) {
  if (const std::string msg = broadcast_text(g, problem_on_root); !msg.empty())
    throw checkpoint_error("gshard::checkpoint: " + path + ": " + msg);
}

}  // namespace detail

inline void save_checkpoint(const std::string& path, const detail::mesh_base& m, const std::vector<checkpoint_part>& parts,
                            const std::map<std::string, double>& meta = {}) {
  const bool root = m.rank() == 0;
  // Rank 0 builds the file between the gathers (first touch of as many bytes
  // as the model holds) and then writes it: the others' waits in the gathers
  // and in the agreement are for that, not for a stuck rank.
  const debug::awaiting_io io("rank 0's write of " + path);
  for (const auto& [k, v] : meta)  // the metadata travels as "key=value" lines on load
    if (k.empty() || k.find('\n') != std::string::npos)
      throw checkpoint_error("gshard::checkpoint: " + path + ": a metadata key is empty or holds a newline");
  for (const auto& part : parts) part.set->settle();
  detail::ckpt_writer w;
  std::uint64_t n_records = 0;
  for (const auto& part : parts) n_records += part.set->size();
  if (root) {
    w.buf = "GSHARDCK";
    w.put(std::uint32_t(1));
    w.put(std::uint64_t(meta.size()));
    for (const auto& [k, v] : meta) {
      w.put_string(k);
      w.put(v);
    }
    w.put(n_records);
  }
  for (const auto& part : parts)
    for (auto& t : *part.set) {
      const std::vector<char> global = t->gather_to_root();
      if (!root) continue;
      w.put_string(part.prefix + t->name());
      w.put(std::uint8_t(t->element_bytes()));
      const std::vector<index_t> extents = t->extents();
      w.put(std::uint32_t(extents.size()));
      for (index_t e : extents) w.put(std::uint64_t(e));
      w.put_string(t->sharding_text());
      w.put(std::uint64_t(global.size()));
      w.buf.append(global.data(), global.size());
      w.put(detail::fnv1a(global.data(), global.size()));
    }
  std::string problem;
  if (root) {
    const std::uint64_t h = detail::fnv1a(w.buf.data(), w.buf.size());
    w.buf += "GSHARDEND";
    w.put(h);
    problem = io::write_file(path, w.buf);
  }
  detail::agree_or_throw(problem, path, m.all_axes());
}

// Loads into `parts` (which must have the saved names, element types and
// global shapes; their shardings may differ from the saved ones; a part
// marked optional may lack records, whose tensors keep their values) and
// returns the metadata. A record under a part's prefix that no part has is refused
// too; records under other prefixes are not read. The root's checks, the
// one agreement on them and the broadcasts run in this order so that every
// rank throws the same error or none.
inline std::map<std::string, double> load_checkpoint(const std::string& path, const detail::mesh_base& m,
                                                     const std::vector<checkpoint_part>& parts) {
  for (const auto& part : parts) part.set->settle();  // nothing in flight writes over what is loaded
  const bool root = m.rank() == 0;
  std::string file, problem;
  std::optional<debug::awaiting_io> io(std::in_place, "rank 0's read of " + path);  // the others wait in the agreement
  std::map<std::string, double> meta;
  std::map<std::string, detail::ckpt_record> records;
  if (root) {
    problem = io::read_file(path, file);
    if (problem.empty()) problem = detail::parse_checkpoint(file, meta, records);
    // Every tensor the program expects, with its type and shape.
    for (const auto& part : parts)
      for (auto& t : *part.set) {
        if (!problem.empty()) break;
        const auto it = records.find(part.prefix + t->name());
        if (it == records.end()) {
          if (part.optional) continue;
          problem = "no record '" + part.prefix + t->name() + "'";
          break;
        }
        const auto& r = it->second;
        if (r.elem_bytes != t->element_bytes() || r.extents != t->extents())
          problem = "record '" + r.name + "' holds " + std::to_string(r.elem_bytes * 8) + "-bit " +
                    detail::extents_string(r.extents) + " but the program has " + std::to_string(t->element_bytes() * 8) +
                    "-bit " + detail::extents_string(t->extents()) + " (" + t->notation() + ")";
      }
    // And nothing under the parts' prefixes that the program lacks: a weight
    // of another model configuration (e.g. shared experts) is not silently
    // left behind. Records under other prefixes (Adam's moments, when only
    // the parameters are asked for) are fine.
    for (const auto& [name, r] : records) {
      if (!problem.empty()) break;
      bool under_a_prefix = false, taken = false;
      for (const auto& part : parts)
        if (name.compare(0, part.prefix.size(), part.prefix) == 0) {
          under_a_prefix = true;
          taken = taken || part.set->find(name.substr(part.prefix.size())) != nullptr;
        }
      if (under_a_prefix && !taken)
        problem = "record '" + name + "' is not in the program (saved by another model configuration?)";
    }
  }
  detail::agree_or_throw(problem, path, m.all_axes());
  io.reset();  // the broadcasts below are timed as any collective
  // The metadata, as "name=value" lines (values in full precision).
  std::string lines;
  if (root)
    for (const auto& [k, v] : meta) {
      char value[40];
      std::snprintf(value, sizeof value, "%.17g", v);
      lines += k + '=' + value + '\n';
    }
  lines = broadcast_text(m.all_axes(), lines);
  std::map<std::string, double> out;
  for (std::size_t pos = 0; pos < lines.size();) {
    const std::size_t eol = lines.find('\n', pos), eq = lines.rfind('=', eol);
    out[lines.substr(pos, eq - pos)] = std::strtod(lines.c_str() + eq + 1, nullptr);
    pos = eol + 1;
  }
  // Which records of optional parts the file has ('1' each, in the parts'
  // order), rank 0's answer for all: only those are scattered.
  std::string present;
  if (std::any_of(parts.begin(), parts.end(), [](const checkpoint_part& p) { return p.optional; })) {
    if (root)
      for (const auto& part : parts)
        if (part.optional)
          for (auto& t : *part.set) present += records.count(part.prefix + t->name()) ? '1' : '0';
    present = broadcast_text(m.all_axes(), present);
  }
  std::size_t optional_at = 0;
  for (const auto& part : parts)
    for (auto& t : *part.set) {  // each into this program's sharding
      if (part.optional && present[optional_at++] == '0') continue;
      t->scatter_from_root(root ? file.data() + records.at(part.prefix + t->name()).offset : nullptr);
    }
  return out;
}

}  // namespace gshard
