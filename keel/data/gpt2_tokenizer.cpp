#include "keel/data/gpt2_tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::data {

namespace {

std::string first_existing(const std::string& dir, const char* a, const char* b,
                           const std::string& key) {
  std::error_code ec;
  const std::filesystem::path pa = std::filesystem::path(dir) / a;
  if (std::filesystem::exists(pa, ec)) return pa.string();
  const std::filesystem::path pb = std::filesystem::path(dir) / b;
  if (std::filesystem::exists(pb, ec)) return pb.string();
  throw Error("GPT-2 tokenizer directory " + dir + " holds neither " + a + " nor " + b + " (" +
                  key +
                  " = \"gpt2:DIR\" needs encoder.json/vocab.json and "
                  "vocab.bpe/merges.txt)",
              Error::kUsage);
}

}  // namespace

std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer(const std::string& dir, const std::string& key) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw Error("GPT-2 tokenizer directory " + dir +
                    (std::filesystem::exists(dir, ec)
                         ? " is a file, not a directory (" + key +
                               " = \"gpt2:DIR\" names the directory of encoder.json and "
                               "vocab.bpe; a tokenizer.json is read with \"hf:PATH\")"
                         : " does not exist (" + key + " = \"gpt2:DIR\")"),
                Error::kUsage);
  return load_gpt2_tokenizer_files(first_existing(dir, "encoder.json", "vocab.json", key),
                                   first_existing(dir, "vocab.bpe", "merges.txt", key), key);
}

std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer_files(const std::string& encoder_json,
                                                        const std::string& vocab_bpe,
                                                        const std::string& key) {
  BpeSpec spec;
  spec.source = encoder_json + " + " + vocab_bpe;

  // encoder.json: {"token": id, ...}.
  nlohmann::json enc;
  try {
    enc = nlohmann::json::parse(read_tokenizer_file(encoder_json, "GPT-2 vocabulary", key));
  } catch (const nlohmann::json::exception& e) {
    throw Error(encoder_json + ": not valid JSON: " + json_error_detail(e.what()));
  }
  if (!enc.is_object()) throw Error(encoder_json + ": expected a JSON object {\"token\": id, ...}");
  spec.vocab.reserve(enc.size());
  for (const auto& [tok, id] : enc.items()) {
    spec.vocab.emplace_back(tok, token_id_from_json(id, encoder_json + ": token \"" + tok + "\""));
  }

  // vocab.bpe: "#version: 0.2", then one merge per line: two tokens separated by a space.
  const std::string text = read_tokenizer_file(vocab_bpe, "GPT-2 merges file", key);
  size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.substr(0, 8) == "#version")) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos)
      throw Error(vocab_bpe + ":" + std::to_string(line_no) +
                  ": expected two tokens separated by "
                  "one space, got \"" +
                  std::string(line) + "\"");
    spec.merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
    spec.merge_places.push_back(vocab_bpe + ":" + std::to_string(line_no));
  }

  PreTokenizerStep byte_level;
  byte_level.kind = PreTokenizerStep::Kind::kByteLevel;
  byte_level.regex = std::make_shared<SplitRegex>(kGpt2Pattern, false, "GPT-2 pre-tokenizer");
  spec.pre_tokenizer.push_back(byte_level);

  const auto eot = enc.find("<|endoftext|>");
  if (eot != enc.end()) {
    AddedToken a;
    a.content = "<|endoftext|>";
    a.id = token_id_from_json(*eot, encoder_json + ": token \"<|endoftext|>\"");
    a.special = true;
    spec.added_tokens.push_back(a);
    spec.bos_id = spec.eos_id = a.id;
  }
  return std::make_unique<BpeTokenizer>(std::move(spec));
}

}  // namespace keel::data
