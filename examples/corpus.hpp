// examples/corpus.hpp — the trainer's text, split into training and held-out
// parts by document, read by rank 0 and broadcast.
// The default is the GNU Collaborative International Dictionary of English
// (Debian's dict-gcide, installed by scripts/setup): 40 MB of English prose
// in 126,000 entries; without it, the licence texts of every Debian system
// (/usr/share/common-licenses, 213 KB — small enough to be memorised).
// Documents: a dictionary's entries (a `.dict` or `.dict.dz` file), the
// files of a directory, or a single file as one. Files named `.gz` or `.dz`
// are decompressed.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <string_view>
#include <cerrno>
#include <climits>
#include <filesystem>
#include <string>
#include <vector>

#include <gshard/runtime/collectives.hpp>
#include <gshard/core/fnv1a.hpp>
#include <gshard/core/error.hpp>
#include <gshard/core/io.hpp>

#include "cli.hpp"

namespace examples {

inline constexpr const char* default_dictionary = "/usr/share/dictd/gcide.dict.dz";
inline constexpr const char* fallback_texts = "/usr/share/common-licenses";

struct corpus {
  std::string text;       // the training documents, then the held-out ones
  std::size_t split = 0;  // text[0, split) trains; text[split, end) is held out
  std::string source;     // what was read, for the first line of the run
};

namespace detail {

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A gzip (or dictzip) file's contents; "" or the problem. The dictionary
// ships as one dictzip file (gzip-compatible, read here with zlib) and its index.
inline std::string read_gzip(const std::string& path, std::string& out, std::size_t limit = max_text_bytes) {
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return "cannot open " + path + ": " + gshard::io::reason(errno ? errno : ENOMEM);
  gzbuffer(f, 1 << 20);
  out.clear();
  std::string problem;
  char buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof buf);
    if (n > 0) out.append(buf, std::size_t(n));
    if (n < int(sizeof buf)) {
      int code = Z_OK;
      const char* what = gzerror(f, &code);
      if (n < 0 || code != Z_OK) {  // Z_BUF_ERROR: the file ends inside its compressed data
        std::string why = code == Z_ERRNO ? gshard::io::reason(errno) : std::string(what);
        if (why.rfind(path + ": ", 0) == 0) why.erase(0, path.size() + 2);  // zlib names the file too
        problem = "cannot read " + path + ": " + why;
      }
      break;
    }
    if (out.size() > limit) {
      problem = path + " holds more than " + std::to_string(limit) + " bytes; at most " + std::to_string(limit) + " are read";
      out.clear();
      break;
    }
  }
  gzclose(f);
  return problem;
}

// A file's text, decompressed when it is .gz or .dz; at most `limit` bytes.
inline std::string read_any(const std::string& path, std::string& out, std::size_t limit = max_text_bytes) {
  if (ends_with(path, ".gz") || ends_with(path, ".dz")) return read_gzip(path, out, limit);
  return gshard::io::read_file(path, out, limit);
}

// One document: its text, and for a dictionary entry its headword (the
// held-out split keeps every entry of one headword on one side).
struct document {
  std::string text, headword;
};

// dictd's base64 numbers (offsets and lengths in its .index): big-endian
// digits of A-Z a-z 0-9 + /; -1 when a digit is not one.
inline long long dict_number(const std::string& s) {
  static constexpr std::string_view digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  long long v = 0;
  for (char ch : s) {
    const std::size_t d = digits.find(ch);
    if (d == std::string_view::npos || v > (1ll << 50)) return -1;
    v = v * 64 + static_cast<long long>(d);
  }
  return s.empty() ? -1 : v;
}

inline bool dictd_header(const std::string& headword) { return headword.rfind("00-", 0) == 0 || headword.rfind("00database", 0) == 0; }

// A dictd database's entries. With its index beside it (`x.index` for
// `x.dict[.dz]`: headword, offset, length per line), exactly the indexed
// spans, each once (several headwords may share one), in file order;
// without, each entry starts at a line's first column after a blank line.
// dictd's own entries (00-database-info and the like) are left out.
inline std::string dictionary_entries(const std::string& path, const std::string& text, std::vector<document>& out,
                                      bool& indexed) {
  const std::string base = path.substr(0, path.size() - (ends_with(path, ".dz") ? 8 : 5));  // without .dict[.dz]
  std::string index;
  std::error_code ec;
  indexed = std::filesystem::is_regular_file(base + ".index", ec);
  if (indexed) {
    if (std::string p = gshard::io::read_file(base + ".index", index, max_text_bytes); !p.empty()) return p;
    struct span {
      long long at, n;
      std::string headword;
    };
    std::vector<span> spans;
    std::size_t line = 0;
    for (std::size_t pos = 0; pos < index.size();) {
      const std::size_t eol = std::min(index.find('\n', pos), index.size());
      ++line;
      const std::string l = index.substr(pos, eol - pos);
      pos = eol + 1;
      if (l.empty()) continue;
      const std::size_t t1 = l.find('\t'), t2 = t1 == std::string::npos ? t1 : l.find('\t', t1 + 1);
      const long long at = t2 == std::string::npos ? -1 : dict_number(l.substr(t1 + 1, t2 - t1 - 1));
      const long long n = t2 == std::string::npos ? -1 : dict_number(l.substr(t2 + 1));
      if (at < 0 || n < 0) return base + ".index:" + std::to_string(line) + ": not a dictd index line (headword, offset, length)";
      const std::string headword = l.substr(0, t1);
      if (std::size_t(at + n) > text.size())
        return path + " holds " + std::to_string(text.size()) + " bytes, but " + base + ".index:" + std::to_string(line) +
               " places '" + headword + "' at bytes " + std::to_string(at) + " to " + std::to_string(at + n) +
               ": the dictionary is cut short, or the index is another dictionary's";
      if (!dictd_header(headword)) spans.push_back({at, n, headword});
    }
    if (spans.empty() && !text.empty())
      return base + ".index lists no entry for the " + std::to_string(text.size()) + " bytes of " + path +
             ": restore it, or remove it to read the entries by their blank lines";
    std::sort(spans.begin(), spans.end(), [](const span& a, const span& b) { return a.at < b.at; });
    for (std::size_t i = 0; i < spans.size(); ++i)
      if (i == 0 || spans[i].at != spans[i - 1].at)
        out.push_back({text.substr(std::size_t(spans[i].at), std::size_t(spans[i].n)) + "\n", spans[i].headword});
    return "";
  }
  std::size_t begin = 0;
  auto take = [&](std::size_t end) {
    const std::string e = text.substr(begin, end - begin);
    const std::string headword = e.substr(0, e.find_first_of(" \t\n"));
    if (e.find_first_not_of(" \t\n") != std::string::npos && !dictd_header(headword)) out.push_back({e, headword});
    begin = end;
  };
  for (std::size_t at = text.find("\n\n"); at != std::string::npos; at = text.find("\n\n", at + 1)) {
    std::size_t next = at + 2;
    while (next < text.size() && text[next] == '\n') ++next;
    if (next < text.size() && text[next] != ' ' && text[next] != '\t') take(next);
  }
  take(text.size());
  return "";
}

// Rank 0's part: the documents at `path`; "" or the problem.
inline std::string read_documents(const std::string& path, std::vector<document>& docs, std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::vector<std::string> files;
    if (std::string p = list_files(path, files); !p.empty()) return p;
    if (std::string p = read_files(files, path, read_any, [&](std::string&& one) { docs.push_back({std::move(one), ""}); });
        !p.empty())
      return p;
    what = path + ", " + std::to_string(docs.size()) + " files";
    return "";
  }
  std::string text;
  if (std::string p = read_any(path, text); !p.empty()) return p;
  if (ends_with(path, ".dict") || ends_with(path, ".dict.dz")) {
    bool indexed = false;
    if (std::string p = dictionary_entries(path, text, docs, indexed); !p.empty()) return p;
    what = path + ", " + std::to_string(docs.size()) + " dictionary entries" + (indexed ? " (by its .index)" : "");
  } else {
    docs.push_back({std::move(text), ""});
    what = path;
  }
  return "";
}

// Held out: a tenth of the headwords (by a hash of the lowercased headword,
// so an entry held out is a word the model never saw defined, not a shuffled
// copy of text it trained on: a good test for a small model), or of files
// every 10th; with fewer than 10 documents, the last 10% of the bytes.
inline corpus split_documents(std::vector<document>& docs, std::string what) {
  corpus c;
  std::size_t bytes = 0;
  for (const auto& d : docs) bytes += d.text.size();
  c.text.reserve(bytes);
  if (docs.size() >= 10) {
    std::vector<bool> held(docs.size());
    for (std::size_t i = 0; i < docs.size(); ++i) {
      std::string w = docs[i].headword;
      for (char& ch : w) ch = char(std::tolower(static_cast<unsigned char>(ch)));
      held[i] = w.empty() ? i % 10 == 9 : gshard::detail::fnv1a(w) % 10 == 9;
    }
    std::size_t n = 0;
    for (std::size_t i = 0; i < docs.size(); ++i)
      if (!held[i]) c.text += docs[i].text;
    c.split = c.text.size();
    for (std::size_t i = 0; i < docs.size(); ++i)
      if (held[i]) c.text += docs[i].text, ++n;
    c.source = what + " (" + std::to_string(n) + " held out: " +
               (docs[0].headword.empty() ? "every 10th" : "a tenth of the headwords") + ")";
  } else {
    for (const auto& d : docs) c.text += d.text;
    c.split = c.text.size() * 9 / 10;
    c.source = what + " (the last 10% held out)";
  }
  docs.clear();
  return c;
}

}  // namespace detail

// Rank 0 reads the corpus at `path` (empty: the dictionary, else the licence
// texts) and every rank receives it: the path need exist only there. A
// problem is rank 0's to find and every rank's to throw, as
// gshard::io_error naming the path and the reason.
inline corpus load_corpus(const std::string& program, const std::string& path) {
  const gshard::detail::axis_group& world = gshard::world_group();
  corpus c;
  std::string problem, header;
  if (world.rank == 0) {
    std::string from = path;
    std::error_code ec;
    if (from.empty()) from = std::filesystem::exists(default_dictionary, ec) ? default_dictionary : fallback_texts;
    std::vector<detail::document> docs;
    std::string what;
    problem = detail::read_documents(from, docs, what);
    if (problem.empty() && path.empty() && from == fallback_texts)
      what += "; scripts/setup installs the default corpus (apt-get install dict-gcide)";
    if (problem.empty()) c = detail::split_documents(docs, what);
    if (problem.empty() && c.text.size() > max_text_bytes)  // one MPI_Bcast carries it
      problem = "the text has " + std::to_string(c.text.size()) + " bytes; at most " + std::to_string(max_text_bytes) + " are read";
    header = std::to_string(c.split) + "\n" + c.source;
  }
  if (const std::string p = gshard::broadcast_text(world, problem); !p.empty())
    throw gshard::io_error("gshard " + program + ": " + p);
  header = gshard::broadcast_text(world, std::move(header));
  const std::size_t nl = header.find('\n');
  c.split = std::stoull(header.substr(0, nl));
  c.source = header.substr(nl + 1);
  c.text = gshard::broadcast_text(world, std::move(c.text));
  return c;
}

}  // namespace examples
