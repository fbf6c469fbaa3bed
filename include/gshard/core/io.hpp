// gshard/core/io.hpp — whole-file reads and atomic whole-file writes on one rank,
// each failure naming the path and the OS's reason (strerror). They return
// the problem as text ("" when all went well) rather than throwing: the rank
// that did the I/O must first tell the others (broadcast_text in
// runtime/collectives.hpp), so that every rank throws the same error or none.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace gshard::io {

// "No such file or directory" for the current errno.
inline std::string reason(int err = errno) { return std::strerror(err); }

// The whole file at `path` into `out`, or the problem. At most `limit`
// bytes: a larger regular file is refused before it is read, and a stream
// (a pipe, /dev/zero) when it passes the limit, naming the path.
inline std::string read_file(const std::string& path, std::string& out, std::size_t limit = std::size_t(-1)) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot open " + path + ": " + reason();
  struct stat st{};
  if (::fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    const int err = S_ISDIR(st.st_mode) ? EISDIR : errno;
    ::close(fd);
    return "cannot read " + path + ": " + reason(err);
  }
  const auto too_large = [&](const std::string& size) {
    ::close(fd);
    out.clear();
    return path + " holds " + size + " bytes; at most " + std::to_string(limit) + " are read";
  };
  out.clear();
  if (S_ISREG(st.st_mode)) {
    if (std::size_t(st.st_size) > limit) return too_large(std::to_string(st.st_size));
    out.reserve(std::size_t(st.st_size));
  }
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return "cannot read " + path + ": " + reason(err);
    }
    if (out.size() + std::size_t(n) > limit) return too_large("more than " + std::to_string(limit));
    out.append(buf, std::size_t(n));
  }
  ::close(fd);
  return "";
}

namespace detail {
// A name beside `path` that no other save uses: the process id and a count,
// so two writers (or two saves of one process) never share a temporary file.
inline std::string temporary_beside(const std::string& path) {
  static std::atomic<unsigned> count{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(count++);
}

inline std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// A path that names a directory or a device is never replaced by a file.
inline std::string target_problem(const std::string& path) {
  struct stat st{};
  if (path.empty()) return "the path is empty";
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return path + " is a directory";
    if (!S_ISREG(st.st_mode)) return path + " exists and is not a regular file";
  }
  const std::string dir = directory_of(path);
  if (::stat(dir.c_str(), &st) != 0) return "cannot write " + path + ": " + dir + ": " + reason();
  if (!S_ISDIR(st.st_mode)) return "cannot write " + path + ": " + dir + " is not a directory";
  return "";
}

inline bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w == 0) errno = EIO;  // no progress and no reason: say I/O error, not a stale errno
    if (w <= 0) return false;
    p += w;
    n -= std::size_t(w);
  }
  return true;
}
}  // namespace detail

// Writes `data` to `path` atomically: a temporary file beside it, fsync,
// rename. A failure at any point removes the temporary file and leaves an
// existing `path` as it was.
inline std::string write_file(const std::string& path, std::string_view data) {
  if (std::string p = detail::target_problem(path); !p.empty()) return p;
  const std::string tmp = detail::temporary_beside(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create " + tmp + ": " + reason();
  std::string problem;
  if (!detail::write_all(fd, data.data(), data.size())) problem = "writing " + tmp + " failed: " + reason();
  else if (::fsync(fd) != 0) problem = "writing " + tmp + " failed (fsync): " + reason();
  if (::close(fd) != 0 && problem.empty()) problem = "writing " + tmp + " failed (close): " + reason();
  if (problem.empty() && std::rename(tmp.c_str(), path.c_str()) != 0)
    problem = "renaming " + tmp + " to " + path + " failed: " + reason();
  if (!problem.empty()) {
    ::unlink(tmp.c_str());
    return problem;
  }
  // The rename itself is durable once the directory is synced.
  if (const int dfd = ::open(detail::directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return "";
}

// Whether write_file(path, ...) can succeed as far as can be known now: the
// directory exists and takes a new file (one is created and removed), and
// `path` is not a directory or a device. For checking options before a long
// run, not after it.
inline std::string check_writable(const std::string& path) {
  if (std::string p = detail::target_problem(path); !p.empty()) return p;
  const std::string tmp = detail::temporary_beside(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot write " + path + ": " + reason();
  ::close(fd);
  ::unlink(tmp.c_str());
  return "";
}

}  // namespace gshard::io
