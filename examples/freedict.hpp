// examples/freedict.hpp — translation pairs into English from the FreeDict
// dictionaries (Debian's dict-freedict-LLL-eng: /usr/share/dictd/
// freedict-LLL-eng.dict.dz and .index), for a multilingual model in the
// manner of GShard's M4: many languages into English, sampled by temperature.
// Each entry gives its headword → its first English sense, and each example
// sentence ("source" - English) as a pair of its own. Rank 0 reads, every
// rank receives:
//   auto langs = examples::load_freedict("translate", {"deu", "jpn"});
//   auto p = examples::temperature_sampling(sizes, 5);  // M4 sampled at T = 5
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <gshard/core/error.hpp>
#include <gshard/core/fnv1a.hpp>
#include <gshard/core/io.hpp>
#include <gshard/runtime/collectives.hpp>

#include "corpus.hpp"

namespace examples {

inline constexpr const char* freedict_dir = "/usr/share/dictd";

struct translation_pair {
  std::string source, target;  // target: English
};

struct language_corpus {
  std::string code;  // "deu": the LLL of freedict-LLL-eng
  std::string path;  // the .dict.dz read
  std::vector<translation_pair> train, held;
};

namespace detail {

// s without every span from `open` to its matching `close` (nested spans
// inside it too); an unclosed one runs to the end (some notes are cut short).
inline std::string strip_spans(std::string_view s, char open, char close) {
  std::string out;
  int depth = 0;
  for (char ch : s) {
    if (ch == open) ++depth;
    else if (ch == close && depth > 0) --depth;
    else if (depth == 0) out += ch;
  }
  return out;
}

// s without its pronunciations "/…/": from a slash at the start or after a
// space, not followed by one, to the next slash at the end or before a space,
// "," or ";" ("/ˌba<sup>j</sup>iˈrʲici/" is one). "and/or" and "a / b" stay.
inline std::string strip_pronunciations(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const bool opens = s[i] == '/' && (i == 0 || s[i - 1] == ' ') && i + 1 < s.size() && s[i + 1] != ' ';
    std::size_t end = opens ? s.find('/', i + 1) : std::string_view::npos;
    while (end != std::string_view::npos && end + 1 < s.size() && s[end + 1] != ' ' && s[end + 1] != ',' && s[end + 1] != ';')
      end = s.find('/', end + 1);
    if (end == std::string_view::npos) out += s[i];
    else i = end;
  }
  return out;
}

// Whitespace runs as one space, none before "," or ";", and no space, ","
// or ";" at either end.
inline std::string squeeze(std::string_view s) {
  std::string out;
  for (char ch : s) {
    const bool space = std::isspace(static_cast<unsigned char>(ch));
    if ((ch == ',' || ch == ';') && !out.empty() && out.back() == ' ') out.pop_back();
    if (!space) out += ch;
    else if (!out.empty() && out.back() != ' ') out += ' ';
  }
  const std::size_t b = out.find_first_not_of(" ,;"), e = out.find_last_not_of(" ,;");
  return b == std::string::npos ? std::string() : out.substr(b, e - b + 1);
}

inline std::string without_labels(std::string_view s) {  // <pos tags>, [domain labels], {cross references}
  return strip_spans(strip_spans(strip_spans(strip_pronunciations(s), '<', '>'), '[', ']'), '{', '}');
}

// The headword line's first form: "Haus /haʊs/ <n, neut>, Häuser" → "Haus".
inline std::string freedict_headword(std::string_view line) {
  const std::string s = strip_spans(without_labels(line), '(', ')');
  for (std::size_t from = 0; from <= s.size();) {
    std::size_t comma = s.find(',', from);
    while (comma != std::string::npos && comma + 1 < s.size() && !std::isspace(static_cast<unsigned char>(s[comma + 1])))
      comma = s.find(',', comma + 1);  // "0,47 litara": a decimal comma, not a second form
    const std::size_t end = comma == std::string::npos ? s.size() : comma;
    if (std::string form = squeeze(s.substr(from, end - from)); !form.empty()) return form;
    from = end + 1;
  }
  return "";
}

inline std::string_view trim(std::string_view s) {
  const std::size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string_view::npos ? std::string_view() : s.substr(b, e - b + 1);
}

// Lines about the entry rather than a sense of it.
inline bool freedict_remark(std::string_view t) {
  for (std::string_view label : {"Note:", "see:", "See also:", "Synonym:", "Synonyms:", "Antonym:", "Antonyms:", "der:"})
    if (t.substr(0, label.size()) == label) return true;
  return false;
}

// Whether t is one parenthesis from its first to its last character.
inline bool in_parentheses(std::string_view t) {
  if (t.empty() || t.front() != '(') return false;
  int depth = 0;
  for (std::size_t i = 0; i < t.size(); ++i) {
    depth += t[i] == '(' ? 1 : t[i] == ')' ? -1 : 0;
    if (depth == 0) return i + 1 == t.size();
  }
  return false;
}

// A sense line's English, or "" when the line holds none:
// "2. [jur.] (rare) hearing <n>" → "hearing"; "Plural of {ufagio}: broom" → "broom".
inline std::string freedict_sense(std::string_view line) {
  std::string_view t = trim(line);
  if (freedict_remark(t)) return "";
  std::size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  if (digits > 0 && digits < t.size() && t[digits] == '.' && (digits + 1 == t.size() || t[digits + 1] == ' '))
    t = trim(t.substr(digits + 1));  // "1. " numbers a sense; "1." alone has it on the next line
  if (in_parentheses(t)) return "";  // a grammatical note: "(noun (common) (futsuumeishi))"
  if (const std::size_t ref = t.rfind("}:"); ref != std::string_view::npos) t = t.substr(ref + 2);
  std::string s = squeeze(without_labels(t));
  while (!s.empty() && s.front() == '(') {  // leading notes in the source language: "(apie arbatą) infuse"
    std::size_t end = 0;
    for (int depth = 0; end < s.size(); ++end)
      if ((depth += s[end] == '(' ? 1 : s[end] == ')' ? -1 : 0) == 0) break;
    s = squeeze(end < s.size() ? s.substr(end + 1) : std::string());
  }
  const bool only_references = !s.empty() && s.back() == ':' && t.find('{') != std::string_view::npos;
  return only_references ? "" : s;  // "Inflection of: {…}" names no English
}

// Example sentences are indented and quoted; a sense may start with a
// quote too ("Shut up!", "Be quiet!"), but from the line's first column.
inline bool example_line(std::string_view line) {
  return !line.empty() && (line.front() == ' ' || line.front() == '\t') && trim(line).substr(0, 1) == "\"";
}

// An example line `"source sentence"  - English` as a pair; false for any
// other line (an example without its English among them).
inline bool freedict_example(std::string_view line, translation_pair& out) {
  if (!example_line(line)) return false;
  const std::string_view t = trim(line);
  for (std::size_t q = t.find('"', 1); q != std::string_view::npos; q = t.find('"', q + 1)) {
    std::size_t dash = q + 1;
    while (dash < t.size() && t[dash] == ' ') ++dash;
    if (dash > q + 1 && dash + 1 < t.size() && t[dash] == '-' && t[dash + 1] == ' ') {
      out = {squeeze(t.substr(1, q - 1)), squeeze(without_labels(t.substr(dash + 2)))};
      return true;
    }
  }
  return false;
}

// One entry's pairs, and the headword that places them on one side of the split.
inline std::string freedict_entry(std::string_view entry, std::vector<translation_pair>& pairs) {
  std::size_t eol = std::min(entry.find('\n'), entry.size());
  const std::string headword = freedict_headword(entry.substr(0, eol));
  std::string sense;
  while (eol < entry.size()) {
    const std::size_t from = eol + 1;
    eol = std::min(entry.find('\n', from), entry.size());
    const std::string_view line = entry.substr(from, eol - from);
    if (translation_pair example; freedict_example(line, example)) {
      if (!example.source.empty() && !example.target.empty()) pairs.push_back(std::move(example));
    } else if (sense.empty() && !example_line(line)) {
      sense = freedict_sense(line);
      if (!sense.empty() && !headword.empty()) pairs.insert(pairs.begin(), {headword, sense});
    }
  }
  return headword;
}

// "freedict-deu-eng.dict.dz" → "deu"; another name without its .dict[.dz].
inline std::string freedict_code(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  name.erase(name.size() - (ends_with(name, ".dict.dz") ? 8 : ends_with(name, ".dict") ? 5 : 0));
  if (name.rfind("freedict-", 0) == 0 && ends_with(name, "-eng")) return name.substr(9, name.size() - 13);
  return name;
}

}  // namespace detail

// The language's pairs into `out` (code, path, train, held); "" or the
// problem, naming the path. An entry is held out when the FNV-1a hash of
// its lowercased headword is 0 modulo `held_one_in` (0: none held), so the
// split is the same everywhere and a headword's pairs are all on one side.
// Pairs with an empty side are left out, repeated ones kept once.
inline std::string read_freedict(const std::string& path, language_corpus& out, unsigned held_one_in = 20) {
  out = {detail::freedict_code(path), path, {}, {}};
  if (!detail::ends_with(path, ".dict.dz") && !detail::ends_with(path, ".dict"))
    return path + " is not a dictd dictionary (a .dict.dz or .dict file, its .index beside it)";
  std::string text;
  if (std::string p = detail::read_any(path, text); !p.empty()) return p;
  const std::string index = path.substr(0, path.size() - (detail::ends_with(path, ".dz") ? 8 : 5)) + ".index";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(index, ec))
    return "cannot open " + index + " (the index of " + path + "): " +
           (std::filesystem::exists(index, ec) ? std::string("not a regular file") : gshard::io::reason(ENOENT));
  std::vector<detail::document> entries;
  bool indexed = false;
  if (std::string p = detail::dictionary_entries(path, text, entries, indexed); !p.empty()) return p;
  text.clear();
  text.shrink_to_fit();
  std::unordered_set<std::string> seen;
  std::vector<translation_pair> pairs;
  for (const auto& e : entries) {
    pairs.clear();
    std::string key = detail::freedict_entry(e.text, pairs);
    if (key.empty()) key = e.headword;
    for (char& ch : key) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    const bool held = held_one_in != 0 && gshard::detail::fnv1a(key) % held_one_in == 0;
    for (auto& p : pairs)
      if (seen.insert(p.source + '\0' + p.target).second) (held ? out.held : out.train).push_back(std::move(p));
  }
  if (out.train.empty() && out.held.empty())
    return path + " holds no translation pairs in its " + std::to_string(entries.size()) +
           (entries.size() == 1 ? " entry" : " entries");
  return "";
}

// The LLL of every freedict-LLL-eng.dict.dz in `dir`, sorted; none if `dir`
// cannot be listed.
inline std::vector<std::string> installed_freedict(const std::string& dir = freedict_dir) {
  std::vector<std::string> codes;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("freedict-", 0) == 0 && detail::ends_with(name, "-eng.dict.dz") && name.size() > 21)
      codes.push_back(detail::freedict_code(name));
  }
  std::sort(codes.begin(), codes.end());
  return codes;
}

namespace detail {

// Length-prefixed strings ("5:hello"): any bytes, one broadcast per language.
inline void put_field(std::string& out, std::string_view s) {
  out += std::to_string(s.size());
  out += ':';
  out += s;
}
inline std::string take_field(const std::string& in, std::size_t& at) {
  const std::size_t colon = in.find(':', at);
  const std::size_t n = std::stoull(in.substr(at, colon - at));
  at = colon + 1 + n;
  return in.substr(colon + 1, n);
}

inline std::string pack_language(const language_corpus& c) {
  std::string out;
  put_field(out, c.code);
  put_field(out, c.path);
  for (const auto* side : {&c.train, &c.held}) {
    put_field(out, std::to_string(side->size()));
    for (const auto& p : *side) put_field(out, p.source), put_field(out, p.target);
  }
  return out;
}
inline language_corpus unpack_language(const std::string& in) {
  language_corpus c;
  std::size_t at = 0;
  c.code = take_field(in, at);
  c.path = take_field(in, at);
  for (auto* side : {&c.train, &c.held}) {
    side->resize(std::stoull(take_field(in, at)));
    for (auto& p : *side) p.source = take_field(in, at), p.target = take_field(in, at);
  }
  return c;
}

}  // namespace detail

// Rank 0 reads the languages `codes` (empty: every one installed in `dir`)
// and every rank receives them, in the order given: the dictionaries need
// exist only there. A problem is rank 0's to find and every rank's to
// throw, as gshard::io_error naming the path and the reason.
inline std::vector<language_corpus> load_freedict(const std::string& program, std::vector<std::string> codes = {},
                                                  const std::string& dir = freedict_dir, unsigned held_one_in = 20) {
  const gshard::detail::axis_group& world = gshard::world_group();
  std::vector<std::string> packed;
  std::string problem;
  if (world.rank == 0) {
    const std::vector<std::string> installed = installed_freedict(dir);
    if (installed.empty())
      problem = "no FreeDict dictionaries in " + dir +
                " (freedict-LLL-eng.dict.dz and .index); install some, e.g. apt-get install dict-freedict-deu-eng "
                "(the Debian packages dict-freedict-LLL-eng)";
    if (codes.empty()) codes = installed;
    // Every code checked before any dictionary is read: a bad one is named in
    // well under a second, not after the ones before it were read.
    for (std::size_t i = 0; i < codes.size() && problem.empty(); ++i) {
      const std::string& code = codes[i];
      if (std::find(codes.begin(), codes.begin() + std::ptrdiff_t(i), code) != codes.begin() + std::ptrdiff_t(i))
        problem = "--languages names " + code + " twice";
      else if (!std::binary_search(installed.begin(), installed.end(), code)) {
        std::string all;
        for (const auto& c : installed) all += (all.empty() ? "" : ", ") + c;
        problem = "--languages: no FreeDict dictionary for the language '" + code + "' in " + dir + " (freedict-" + code +
                  "-eng.dict.dz, from the Debian package dict-freedict-" + code + "-eng); installed: " + all;
      }
    }
    for (std::size_t i = 0; i < codes.size() && problem.empty(); ++i) {
      language_corpus c;
      problem = read_freedict(dir + "/freedict-" + codes[i] + "-eng.dict.dz", c, held_one_in);
      packed.push_back(detail::pack_language(c));
      if (problem.empty() && packed.back().size() > max_text_bytes)  // one MPI_Bcast carries it
        problem = c.path + " gives " + std::to_string(packed.back().size()) + " bytes of pairs; at most " + std::to_string(max_text_bytes) + " are sent";
    }
  }
  if (const std::string p = gshard::broadcast_text(world, problem); !p.empty())
    throw gshard::io_error("gshard " + program + ": " + p);
  const std::size_t n = std::stoull(gshard::broadcast_text(world, std::to_string(packed.size())));
  std::vector<language_corpus> out;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(detail::unpack_language(
        gshard::broadcast_text(world, world.rank == 0 ? std::move(packed[i]) : std::string())));
  return out;
}

// M4's sampling distribution over languages of `sizes` pairs:
// p_i ∝ (n_i / Σn)^(1/T). T = 1 samples in proportion to the data, a large T
// nearly uniformly (low-resource languages up-sampled). Computed from logs,
// so a small T cannot underflow every weight.
inline std::vector<double> temperature_sampling(const std::vector<std::size_t>& sizes, double T) {
  if (!(T > 0) || !std::isfinite(T)) {
    std::ostringstream t;
    t << T;
    throw gshard::error("examples::temperature_sampling: the temperature T is " + t.str() +
                        "; it must be a finite number above 0");
  }
  const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  if (largest == 0)
    throw gshard::error("examples::temperature_sampling: the " + std::to_string(sizes.size()) +
                        " sizes sum to 0; at least one language needs data");
  std::vector<double> p(sizes.size());
  double sum = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    sum += p[i] = sizes[i] == 0 ? 0 : std::exp((std::log(double(sizes[i])) - std::log(double(largest))) / T);
  for (double& x : p) x /= sum;
  return p;
}

}  // namespace examples
