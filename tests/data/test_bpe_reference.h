// The obviously correct BPE of the tests, kept beside them for good (DESIGN §7): GPT-2's
// encoder.py algorithm on strings — find the adjacent pair of lowest rank, merge every occurrence
// of it left to right, repeat — with the vocabulary and merges read straight from the files, no
// ids, no heap, no cache. keel's BpeTokenizer (ids, a heap, leftmost-first among equal ranks)
// must give the same tokens.
#pragma once
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "keel/data/bpe.h"

namespace keel::data::test_ref {

struct ReferenceBpe {
  std::map<std::pair<std::string, std::string>, size_t> ranks;
  std::map<std::string, int32_t> vocab;

  // encoder.json + vocab.bpe (first line "#version", then "a b" per line).
  static ReferenceBpe from_gpt2_files(const std::string& encoder_json,
                                      const std::string& vocab_bpe) {
    ReferenceBpe r;
    std::ifstream enc(encoder_json);
    const nlohmann::json j = nlohmann::json::parse(enc);
    for (const auto& [tok, id] : j.items()) r.vocab[tok] = id.get<int32_t>();
    std::ifstream merges(vocab_bpe);
    std::string line;
    std::getline(merges, line);  // #version
    size_t rank = 0;
    while (std::getline(merges, line)) {
      if (line.empty()) continue;
      std::istringstream ss(line);
      std::string a, b;
      ss >> a >> b;
      r.ranks[{a, b}] = rank++;  // a pair listed twice keeps its last rank, as encoder.py
    }
    return r;
  }

  // tokenizer.json's model.vocab and model.merges (either form).
  static ReferenceBpe from_hf_json(const nlohmann::json& model) {
    ReferenceBpe r;
    for (const auto& [tok, id] : model["vocab"].items()) r.vocab[tok] = id.get<int32_t>();
    size_t rank = 0;
    for (const auto& m : model["merges"]) {
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        r.ranks[{s.substr(0, sp), s.substr(sp + 1)}] = rank++;
      } else {
        r.ranks[{m[0].get<std::string>(), m[1].get<std::string>()}] = rank++;
      }
    }
    return r;
  }

  // The tokens of one pre-token given as raw bytes.
  std::vector<std::string> tokens(const std::string& bytes) const {
    std::vector<std::string> word;
    for (char c : bytes) word.push_back(bytes_to_byte_level(std::string(1, c)));
    while (word.size() > 1) {
      size_t best = SIZE_MAX;
      std::pair<std::string, std::string> bigram;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const auto it = ranks.find({word[i], word[i + 1]});
        if (it != ranks.end() && it->second < best) best = it->second, bigram = it->first;
      }
      if (best == SIZE_MAX) break;
      std::vector<std::string> merged;
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == bigram.first && word[i + 1] == bigram.second) {
          merged.push_back(word[i] + word[i + 1]);
          i += 2;
        } else {
          merged.push_back(word[i++]);
        }
      }
      word.swap(merged);
    }
    return word;
  }

  // Their ids; -1 for a token missing from the vocabulary (a broken merges file).
  std::vector<int32_t> ids(const std::string& bytes) const {
    std::vector<int32_t> out;
    for (const std::string& t : tokens(bytes)) {
      const auto it = vocab.find(t);
      out.push_back(it == vocab.end() ? -1 : it->second);
    }
    return out;
  }
};

}  // namespace keel::data::test_ref
