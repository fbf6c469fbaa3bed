// examples/cli.hpp — what the examples share on the command line: numbers
// parsed whole and in range, positional arguments with --help, and a text
// read by rank 0 and sent to every rank. Every problem is an error naming
// the program, the option, the value and what is allowed, thrown on every
// rank alike.
#pragma once

#include <gshard/runtime/collectives.hpp>
#include <gshard/core/error.hpp>
#include <gshard/core/io.hpp>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

namespace examples {

// The most text the examples read: rank 0 sends it to every rank in one
// MPI_Bcast, whose count is an int.
inline constexpr std::size_t max_text_bytes = std::size_t(INT_MAX);

// This host's physical memory, shared by the ranks the launcher started on
// it (OpenMPI's or MPICH's local size; 1 when neither says): what a
// trainer's memory check allows one rank.
struct host_share {
  double ranks_here = 1, bytes_per_rank = 0;
};
inline host_share memory_per_rank() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!local) local = std::getenv("MPI_LOCALNRANKS");  // MPICH
  host_share h;
  h.ranks_here = std::max(1.0, local ? std::atof(local) : 1.0);
  h.bytes_per_rank = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE)) / h.ranks_here;
  return h;
}

// A number from the command line in [lo, hi], or an error naming the option,
// the text and what is allowed.
template <class N>
N number(const std::string& program, const std::string& option, const std::string& text, N lo,
         N hi = std::is_floating_point_v<N> ? std::numeric_limits<N>::max() : N(INT_MAX)) {
  std::size_t used = 0;
  N v{};
  try {
    if constexpr (std::is_floating_point_v<N>) v = N(std::stod(text, &used));
    else v = N(std::stoll(text, &used));
  } catch (const std::exception&) {
    used = 0;
  }
  const bool finite = !std::is_floating_point_v<N> || std::isfinite(double(v));
  if (used != text.size() || text.empty() || !(v >= lo && v <= hi) || !finite) {
    const std::string kind = std::is_floating_point_v<N> ? "a finite number" : "a whole number";
    const auto shown = [](N x) {
      char b[32];
      std::snprintf(b, sizeof b, "%g", double(x));
      return std::string(b);
    };
    const std::string range = !std::is_floating_point_v<N>             ? " from " + std::to_string(lo) + " to " + std::to_string(hi)
                              : hi < std::numeric_limits<N>::max() ? " from " + shown(lo) + " to " + shown(hi)
                                                                       : " >= " + shown(lo);
    throw gshard::error("gshard " + program + ": " + option + " takes " + kind + range + ", not '" + text + "'");
  }
  return v;
}

// The positional arguments of a program that takes no options: at most
// `names.size()` of them. --help or -h prints `usage` on rank 0 and gives
// nullopt (the program exits 0); an option or one argument too many is an
// error that says what the program takes.
inline std::optional<std::vector<std::string>> positional(int argc, char** argv, const std::string& program,
                                                          const std::vector<std::string>& names, const std::string& usage) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      if (gshard::world_group().rank == 0) std::fputs(usage.c_str(), stdout);
      return std::nullopt;
    }
  std::string takes = names.empty() ? "no arguments" : "";
  for (const auto& n : names) takes += (takes.empty() ? "[" : " [") + n + "]";
  for (const auto& a : args)
    if (a.size() > 1 && a[0] == '-' && !std::isdigit(static_cast<unsigned char>(a[1])))
      throw gshard::error("gshard " + program + ": unknown option " + a + "; it takes " + takes + " (--help)");
  if (args.size() > names.size())
    throw gshard::error("gshard " + program + ": " + std::to_string(args.size()) + (args.size() == 1 ? " argument" : " arguments") + " given; it takes " + takes +
                        " (--help)");
  return args;
}

// The regular files of directory `dir`, in name order (symlinks left out:
// GPL -> GPL-3 and the like count once); "" or the problem.
inline std::string list_files(const std::string& dir, std::vector<std::string>& files) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file() && !it->is_symlink()) files.push_back(it->path().string());
  if (ec) return "cannot list " + dir + ": " + ec.message();
  if (files.empty()) return dir + " holds no regular file";
  std::sort(files.begin(), files.end());
  return "";
}

// Each of `files` in turn, read by read_one(path, out, limit) under one
// budget of max_text_bytes for them all, each text handed to take(text); "" or
// the first problem, with how much was read before it in `dir`.
template <class ReadOne, class Take>
std::string read_files(const std::vector<std::string>& files, const std::string& dir, const ReadOne& read_one,
                       const Take& take) {
  std::size_t bytes = 0;
  for (const auto& f : files) {
    std::string one;
    if (std::string p = read_one(f, one, max_text_bytes - bytes); !p.empty())
      return bytes == 0 ? p : p + " (after " + std::to_string(bytes) + " bytes of the files before it in " + dir + ")";
    bytes += one.size();
    take(std::move(one));
  }
  return "";
}

// Rank 0 reads the text at `path` (a file, or every regular file of a
// directory, in name order; empty: `fallback_dir`) and every rank receives
// it: the path need exist only there. A problem is rank 0's to find and
// every rank's to throw, as gshard::io_error with the path and the reason.
inline std::string load_text(const std::string& program, const std::string& path, const std::string& fallback_dir) {
  const gshard::detail::axis_group& world = gshard::world_group();
  std::string text, problem;
  if (world.rank == 0) {
    const std::string dir = path.empty() ? fallback_dir : path;
    std::vector<std::string> files;
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec)) problem = list_files(dir, files);
    else if (path.empty()) problem = "no text: give a file, or install base-files (" + fallback_dir + ")";
    else files.push_back(path);
    if (problem.empty())
      problem = read_files(
          files, dir, [](const std::string& f, std::string& out, std::size_t limit) { return gshard::io::read_file(f, out, limit); },
          [&](std::string&& one) { text += one; });
  }
  if (const std::string p = gshard::broadcast_text(world, problem); !p.empty())
    throw gshard::io_error("gshard " + program + ": " + p);
  return gshard::broadcast_text(world, std::move(text));
}

}  // namespace examples
