// The multilingual translation example's parts: chrF against scores worked
// out by hand from sacreBLEU's definition, the FreeDict reader on small dictd
// files written here (entries, examples, duplicates, the headword hold-out,
// the bad inputs), rank 0's read broadcast to every rank, and M4's
// temperature sampling.
#include <gshard/model/chrf.hpp>

#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "../examples/freedict.hpp"
#include "testing.hpp"

using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using examples::language_corpus;
using examples::translation_pair;

// dictd's base64 number, the inverse of examples::detail::dict_number.
std::string dict_digits(std::size_t v) {
  static constexpr std::string_view digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string s;
  do s.insert(s.begin(), digits[v % 64]), v /= 64;
  while (v > 0);
  return s;
}

// A dictd database `dir`/freedict-`code`-eng.{dict.dz,index} of these
// entries (each headword line first), with dictd's own header entry; its path.
std::string write_dictionary(const std::string& dir, const std::string& code, const std::vector<std::string>& entries) {
  std::filesystem::create_directories(dir);
  const std::string base = dir + "/freedict-" + code + "-eng";
  std::string text = "00-database-short\n     Test-English FreeDict Dictionary\n", index;
  index += "00-database-short\tA\t" + dict_digits(text.size()) + "\n";
  for (const auto& e : entries) {
    index += e.substr(0, e.find(' ')) + "\t" + dict_digits(text.size()) + "\t" + dict_digits(e.size()) + "\n";
    text += e;
  }
  gzFile f = gzopen((base + ".dict.dz").c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, text.data(), unsigned(text.size())) == int(text.size()));
  REQUIRE(gzclose(f) == Z_OK);
  std::ofstream(base + ".index", std::ios::binary) << index;
  return base + ".dict.dz";
}

// Each rank's own directory: the reader's cases need no other rank.
std::string scratch(const std::string& what) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_translation_" + what + "_np" +
                                                                     std::to_string(world_size()) + "_rank" +
                                                                     std::to_string(world_rank()) + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  return dir;
}

bool has_pair(const std::vector<translation_pair>& v, const std::string& source, const std::string& target) {
  for (const auto& p : v)
    if (p.source == source && p.target == target) return true;
  return false;
}

}  // namespace

TEST_CASE("chrF of sentence pairs, worked out by hand from sacreBLEU's definition", "[translation][chrf]") {
  using gshard::model::chrf;
  using gshard::model::chrf_statistics;
  // Identical: 1-grams 2/2 matched, 2-grams 1/1; orders 3..6 have no
  // n-grams on either side and do not count. P = R = 1: 100.
  CHECK(chrf("ab", "ab") == 100);
  // Disjoint: orders 1 and 2 count with no match. P = R = 0: 0.
  CHECK(chrf("ab", "cd") == 0);
  // Partial, P = R: "abc" vs "abd". 1-grams 2 of 3 match (a, b), 2-grams 1 of 2
  // (ab), 3-grams 0 of 1. P = R = (2/3 + 1/2 + 0)/3 = 7/18; F = P: 38.888…
  CHECK(chrf("abc", "abd") == Approx(100.0 * 7 / 18).epsilon(1e-14));
  // P ≠ R: "ab" vs "abc". 1-grams: hyp 2, ref 3, match 2; 2-grams: hyp 1, ref 2,
  // match 1; 3-grams: the hypothesis has none, so the order does not count.
  // P = (1 + 1)/2 = 1, R = (2/3 + 1/2)/2 = 7/12,
  // F = 5·P·R / (4·P + R) = (35/12) / (55/12) = 7/11: 63.6363…
  CHECK(chrf("ab", "abc") == Approx(100.0 * 7 / 11).epsilon(1e-14));
  // Whitespace is removed (Python's: a no-break space too), so these are identical.
  CHECK(chrf("a b\tc", "abc") == 100);
  CHECK(chrf("a\xc2\xa0" "b", "ab") == 100);
  // Code points, not bytes: "äb" vs "äc" has 1-grams 1 of 2 matched, 2-grams 0
  // of 1: P = R = (1/2 + 0)/2 = 1/4: 25. (By bytes, ä's two bytes would match too.)
  CHECK(chrf("\xc3\xa4" "b", "\xc3\xa4" "c") == Approx(25).epsilon(1e-14));
  const auto s = chrf_statistics("\xc3\xa4" "b", "\xc3\xa4" "c");
  CHECK((s.hyp[0] == 2 && s.ref[0] == 2 && s.match[0] == 1 && s.hyp[1] == 1 && s.hyp[2] == 0));
  // An invalid byte is one character, equal only to itself.
  CHECK(chrf("\xff\xfe", "\xff\xfe") == 100);
  CHECK(chrf("\xff", "\xfe") == 0);
  // Counts are clipped: "aaa" vs "a" matches one 1-gram of 3 (P = 1/3, R = 1);
  // the reference has no 2-grams, so the hypothesis's count 0 there.
  // F = 5·(1/3)·1 / (4/3 + 1) = (5/3)/(7/3) = 5/7.
  const auto c = chrf_statistics("aaa", "a");
  CHECK((c.hyp[0] == 3 && c.ref[0] == 1 && c.match[0] == 1 && c.hyp[1] == 0 && c.ref[1] == 0));
  CHECK(chrf("aaa", "a") == Approx(100.0 * 5 / 7).epsilon(1e-14));
  // Nothing to compare: 0.
  CHECK(chrf("", "") == 0);
  CHECK(chrf("abc", "") == 0);
}

TEST_CASE("corpus chrF sums the statistics before scoring", "[translation][chrf]") {
  using gshard::model::chrf;
  using gshard::model::corpus_chrf;
  // ("abc", "abc") scores 100 and ("x", "y") 0: their mean is 50. Summed:
  // 1-grams hyp 4, ref 4, match 3; 2-grams 2, 2, 2; 3-grams 1, 1, 1.
  // P = R = (3/4 + 1 + 1)/3 = 11/12: 91.666…
  CHECK(chrf("abc", "abc") == 100);
  CHECK(chrf("x", "y") == 0);
  CHECK(corpus_chrf({"abc", "x"}, {"abc", "y"}) == Approx(100.0 * 11 / 12).epsilon(1e-14));
  gshard::model::chrf_stats total = gshard::model::chrf_statistics("abc", "abc");
  total += gshard::model::chrf_statistics("x", "y");
  CHECK(gshard::model::chrf_score(total) == corpus_chrf({"abc", "x"}, {"abc", "y"}));
  CHECK(corpus_chrf({}, {}) == 0);
  CHECK_THROWS_WITH(corpus_chrf({"a", "b"}, {"a"}),
                    "gshard::model::corpus_chrf: 2 hypotheses but 1 references; give one reference per hypothesis");
}

TEST_CASE("a FreeDict entry gives its headword's first sense and its example sentences", "[translation][freedict]") {
  const std::string dir = scratch("entries");
  const std::string path = write_dictionary(dir, "tst", {
      "Haus /haʊs/ <n, neut>, Häuser\nhouse <n>\n",
      // Labels, tags, numbered senses, notes and cross references around the first sense.
      "Gericht /ɡəˈʁɪçt/ <n, neut> (Speise) [jur.]\n"
      "   Synonym: {Hof}\n"
      "1. [jur.] court <n>, tribunal\n"
      "         Note: law\n"
      "2. dish\n"
      " see: {Gerichte}\n",
      // Remarks, a grammatical note and a cross reference before the sense;
      // examples with and without their English.
      "laufen /ˈlaʊfn̩/ <v>\n"
      " see: {rennen}\n"
      "1. (intransitive (verb))\n"
      "{gehen}run,  walk \n"
      "      \"Er läuft  schnell.\"  - He runs fast.\n"
      "      \"ohne Übersetzung\"\n",
      // The first of several forms, its reading in a label before it.
      " [news1]  数奇 /suːki/,  [news2] すうき /sɯki/\n(noun (common))\nmisfortune, adverse fortune\n",
      // A repeated pair, and an entry with no English.
      "Haus /haʊs/ <n>\nhouse\n",
      "leer /leːɐ/\n   See also: {voll}\n",
  });
  language_corpus c;
  REQUIRE(examples::read_freedict(path, c, 0) == "");
  CHECK(c.code == "tst");
  CHECK(c.path == path);
  CHECK(c.held.empty());
  const std::vector<translation_pair> expected = {
      {"Haus", "house"},
      {"Gericht", "court, tribunal"},
      {"laufen", "run, walk"},
      {"Er läuft schnell.", "He runs fast."},
      {"数奇", "misfortune, adverse fortune"},
  };
  REQUIRE(c.train.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("pair " << i << ": " << c.train[i].source << " => " << c.train[i].target);
    CHECK((c.train[i].source == expected[i].source && c.train[i].target == expected[i].target));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("the held-out pairs are a headword's, the same on every read", "[translation][freedict]") {
  const std::string dir = scratch("split");
  std::vector<std::string> entries;
  for (int i = 0; i < 200; ++i) {
    const std::string w = "w" + std::to_string(i);
    entries.push_back(w + " /x/\n" + w + " meaning\n      \"" + w + " satz\"  - " + w + " sentence\n");
  }
  entries.push_back("W7 /x/\nanother meaning\n");  // lowercased, the same headword as "w7"
  const std::string path = write_dictionary(dir, "spl", entries);
  language_corpus a, b;
  REQUIRE(examples::read_freedict(path, a, 5) == "");
  REQUIRE(examples::read_freedict(path, b, 5) == "");
  CHECK(a.train.size() + a.held.size() == 401);
  CHECK(a.held.size() > 40);  // about a fifth of 200 headwords, two pairs each
  CHECK(a.held.size() < 120);
  bool same = a.train.size() == b.train.size() && a.held.size() == b.held.size();
  for (std::size_t i = 0; same && i < a.held.size(); ++i) same = a.held[i].source == b.held[i].source;
  CHECK(same);
  for (int i = 0; i < 200; ++i) {
    const std::string w = "w" + std::to_string(i);
    const bool held = gshard::detail::fnv1a(w) % 5 == 0;
    const auto& side = held ? a.held : a.train;
    INFO(w << (held ? " held out" : " trained on"));
    CHECK(has_pair(side, w, w + " meaning"));
    CHECK(has_pair(side, w + " satz", w + " sentence"));
  }
  CHECK(has_pair(gshard::detail::fnv1a("w7") % 5 == 0 ? a.held : a.train, "W7", "another meaning"));
  REQUIRE(examples::read_freedict(path, a, 0) == "");
  CHECK((a.held.empty() && a.train.size() == 401));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the FreeDict reader names the path and the problem", "[translation][freedict]") {
  const std::string dir = scratch("bad");
  language_corpus c;
  const std::string missing = dir + "/freedict-xxx-eng.dict.dz";
  CHECK(examples::read_freedict(missing, c) == "cannot open " + missing + ": No such file or directory");

  // Cut short inside the compressed data.
  const std::string cut = write_dictionary(dir, "cut", {"Haus /haʊs/\nhouse\n"});
  std::filesystem::resize_file(cut, std::filesystem::file_size(cut) - 12);
  const std::string p = examples::read_freedict(cut, c);
  CHECK(p.rfind("cannot read " + cut + ": ", 0) == 0);
  CHECK(p.find("unexpected end of file") != std::string::npos);

  const std::string bad = write_dictionary(dir, "bad", {"Haus /haʊs/\nhouse\n"});
  const std::string base = dir + "/freedict-bad-eng";
  std::ofstream(base + ".index", std::ios::binary) << "Haus\tA\tS\nHaus\tA\n";
  CHECK(examples::read_freedict(bad, c) == base + ".index:2: not a dictd index line (headword, offset, length)");
  std::ofstream(base + ".index", std::ios::binary) << "Haus\tA\t/////\n";  // beyond the text
  const std::string beyond = examples::read_freedict(bad, c);
  CHECK(beyond.rfind(bad + " holds ", 0) == 0);
  CHECK(beyond.find(" bytes, but " + base + ".index:1 places 'Haus' at bytes 0 to 1073741823: the dictionary is cut short, "
                    "or the index is another dictionary's") != std::string::npos);
  std::ofstream(base + ".index", std::ios::binary) << "";  // lists nothing
  const std::string nothing = examples::read_freedict(bad, c);
  CHECK(nothing.rfind(base + ".index lists no entry for the ", 0) == 0);
  CHECK(nothing.find(" bytes of " + bad + ": restore it, or remove it to read the entries by their blank lines") != std::string::npos);
  std::filesystem::remove(base + ".index");
  CHECK(examples::read_freedict(bad, c) ==
        "cannot open " + base + ".index (the index of " + bad + "): No such file or directory");

  const std::string empty = write_dictionary(dir, "emp", {"leer /leːɐ/\n   See also: {voll}\n"});
  CHECK(examples::read_freedict(empty, c) == empty + " holds no translation pairs in its 1 entry");
  CHECK(examples::read_freedict(dir + "/notes.txt", c) ==
        dir + "/notes.txt is not a dictd dictionary (a .dict.dz or .dict file, its .index beside it)");
  std::filesystem::remove_all(dir);
}

TEST_CASE("rank 0 reads the dictionaries and every rank receives them", "[translation][freedict][mpi]") {
  // Only rank 0's directory exists: the others receive what it read.
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("gshard_translation_load_np" + std::to_string(world_size()) + "_rank" + std::to_string(world_rank()) + "_" +
                            std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  if (world_rank() == 0) {
    write_dictionary(dir, "abc", {"eins /aɪns/\none\n", "zwei /tsvaɪ/\ntwo\n      \"zwei Bäume\"  - two trees\n"});
    write_dictionary(dir, "xyz", {"tri /tri/\nthree\n"});
  }
  const auto all = examples::load_freedict("test", {}, dir, 0);
  GSHARD_REQUIRE(all.size() == 2);
  GSHARD_CHECK(all[0].code == "abc" && all[1].code == "xyz");
  GSHARD_CHECK(all[0].train.size() == 3 && all[0].held.empty() && all[1].train.size() == 1);
  GSHARD_CHECK(has_pair(all[0].train, "zwei Bäume", "two trees") && has_pair(all[1].train, "tri", "three"));
  GSHARD_CHECK(all[1].path.size() > 0 && all[1].path.find("freedict-xyz-eng.dict.dz") != std::string::npos);
  const auto one = examples::load_freedict("test", {"xyz"}, dir, 1);  // every headword held out
  GSHARD_CHECK(one.size() == 1 && one[0].code == "xyz" && one[0].train.empty() && one[0].held.size() == 1);

  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {"qqq"}, dir), gshard::io_error,
                             "gshard test: --languages: no FreeDict dictionary for the language 'qqq' in ");
  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {"qqq"}, dir), gshard::io_error,
                             "(freedict-qqq-eng.dict.dz, from the Debian package dict-freedict-qqq-eng); installed: abc, xyz");
  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {"abc", "abc"}, dir), gshard::io_error,
                             "gshard test: --languages names abc twice");
  // Named before any dictionary is read, after one that could be.
  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {"abc", "qqq"}, dir), gshard::io_error,
                             "gshard test: --languages: no FreeDict dictionary for the language 'qqq' in ");
  const std::string nowhere = dir + "/none";
  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {}, nowhere), gshard::io_error, "gshard test: no FreeDict dictionaries in ");
  GSHARD_REQUIRE_THROWS_WITH(examples::load_freedict("test", {}, nowhere), gshard::io_error,
                             "(freedict-LLL-eng.dict.dz and .index); install some, e.g. apt-get install dict-freedict-deu-eng "
                             "(the Debian packages dict-freedict-LLL-eng)");
  std::filesystem::remove_all(dir);
}

TEST_CASE("temperature sampling: p_i ∝ (n_i / Σn)^(1/T)", "[translation][sampling]") {
  using examples::temperature_sampling;
  const auto p1 = temperature_sampling({100, 300, 600}, 1);  // in proportion to the data
  CHECK(p1[0] == Approx(0.1));
  CHECK(p1[1] == Approx(0.3));
  CHECK(p1[2] == Approx(0.6));
  // T = 2: weights √0.1, √0.3, √0.6, normalised.
  const auto p2 = temperature_sampling({100, 300, 600}, 2);
  const double s2 = std::sqrt(0.1) + std::sqrt(0.3) + std::sqrt(0.6);
  CHECK(p2[0] == Approx(std::sqrt(0.1) / s2));
  CHECK(p2[2] == Approx(std::sqrt(0.6) / s2));
  const auto flat = temperature_sampling({10, 1000, 100000, 0}, 1e6);  // nearly uniform over the languages with data
  for (int i = 0; i < 3; ++i) CHECK(flat[std::size_t(i)] == Approx(1.0 / 3).epsilon(1e-4));
  CHECK(flat[3] == 0);
  const auto sharp = temperature_sampling({10, 1000}, 1e-3);  // no underflow: all to the largest
  CHECK((sharp[0] == 0 && sharp[1] == 1));
  for (double T : {0.5, 1.0, 5.0, 100.0}) {
    const auto p = temperature_sampling({5, 50, 500, 5000}, T);
    double sum = 0;
    for (double x : p) sum += x;
    CHECK(sum == Approx(1).epsilon(1e-12));
    CHECK((p[0] < p[1] && p[1] < p[2] && p[2] < p[3]));
  }
  CHECK_THROWS_WITH(temperature_sampling({1, 2}, 0),
                    "examples::temperature_sampling: the temperature T is 0; it must be a finite number above 0");
  CHECK_THROWS_AS(temperature_sampling({1, 2}, -1), gshard::error);
  CHECK_THROWS_AS(temperature_sampling({1, 2}, std::numeric_limits<double>::quiet_NaN()), gshard::error);
  CHECK_THROWS_AS(temperature_sampling({1, 2}, std::numeric_limits<double>::infinity()), gshard::error);
  CHECK_THROWS_WITH(temperature_sampling({0, 0}, 1),
                    "examples::temperature_sampling: the 2 sizes sum to 0; at least one language needs data");
  CHECK_THROWS_AS(temperature_sampling({}, 1), gshard::error);
}
