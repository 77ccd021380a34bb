#include "keel/data/hf_tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/data/chat.h"
#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::data {

namespace {

using nlohmann::json;

struct Loader {
  std::string file;
  BpeSpec spec;
  bool byte_level_seen = false;

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw Error(file + ": " + field + ": " + problem);
  }

  bool get_bool(const json& obj, const char* key, bool dflt, const std::string& field) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) fail(field + "." + key, "expected true or false");
    return it->get<bool>();
  }

  std::string get_string(const json& obj, const char* key, const std::string& field) const {
    const auto it = obj.find(key);
    if (it == obj.end() || !it->is_string()) fail(field + "." + key, "expected a string");
    return it->get<std::string>();
  }

  void model(const json& m) {
    if (!m.is_object()) fail("model", "expected an object");
    const std::string type = m.contains("type") ? get_string(m, "type", "model") : "BPE";
    if (type != "BPE")
      fail("model.type", "\"" + type + "\" is not supported; keel reads byte-level BPE models");
    if (m.contains("dropout") && !m["dropout"].is_null() &&
        !(m["dropout"].is_number() && m["dropout"].get<double>() == 0.0))
      fail("model.dropout", "BPE dropout is not supported (set it to null)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(key) && !m[key].is_null() && m[key] != "")
        fail(std::string("model.") + key, "not supported by byte-level BPE (expected null)");
    if (get_bool(m, "byte_fallback", false, "model"))
      fail("model.byte_fallback",
           "SentencePiece-style byte fallback is not supported; keel reads byte-level BPE");
    spec.ignore_merges = get_bool(m, "ignore_merges", false, "model");

    const auto vit = m.find("vocab");
    if (vit == m.end() || !vit->is_object())
      fail("model.vocab", "expected an object {\"token\": id, ...}");
    spec.vocab.reserve(vit->size());
    for (const auto& [tok, id] : vit->items()) {
      spec.vocab.emplace_back(
          tok, token_id_from_json(id, file + ": model.vocab: token \"" + tok + "\""));
    }

    const auto mit = m.find("merges");
    if (mit == m.end() || !mit->is_array()) fail("model.merges", "expected an array");
    spec.merges.reserve(mit->size());
    spec.merge_places.reserve(mit->size());
    for (size_t i = 0; i < mit->size(); ++i) {
      const json& e = (*mit)[i];
      const std::string place = "model.merges[" + std::to_string(i) + "]";
      if (e.is_string()) {
        // The "a b" form (tokenizers < 0.20): exactly one space, as HF requires.
        const std::string s = e.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail(place, "\"" + s + "\" is not two tokens separated by one space");
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        spec.merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      } else {
        fail(place, "expected \"a b\" or [\"a\", \"b\"]");
      }
      spec.merge_places.push_back(place);
    }
  }

  void pre_tokenizer(const json& p, const std::string& field) {
    if (p.is_null()) return;
    if (!p.is_object()) fail(field, "expected an object");
    const std::string type = get_string(p, "type", field);
    if (type == "Sequence") {
      const auto it = p.find("pretokenizers");
      if (it == p.end() || !it->is_array()) fail(field + ".pretokenizers", "expected an array");
      for (size_t i = 0; i < it->size(); ++i)
        pre_tokenizer((*it)[i], field + ".pretokenizers[" + std::to_string(i) + "]");
      return;
    }
    PreTokenizerStep step;
    if (type == "ByteLevel") {
      // HF's defaults: add_prefix_space = true, use_regex = true.
      step.kind = PreTokenizerStep::Kind::kByteLevel;
      step.add_prefix_space = get_bool(p, "add_prefix_space", true, field);
      if (get_bool(p, "use_regex", true, field))
        step.regex = std::make_shared<SplitRegex>(kGpt2Pattern, false, file + ": " + field);
      byte_level_seen = true;
    } else if (type == "Split") {
      // keel splits raw bytes and maps them to the byte-level alphabet at the end, which equals
      // HF's order only while every Split runs before the ByteLevel step.
      if (byte_level_seen)
        fail(field, "a Split after the ByteLevel pre-tokenizer is not supported");
      const auto pit = p.find("pattern");
      if (pit == p.end() || !pit->is_object())
        fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      const std::string where = file + ": " + field + ".pattern";
      if (pit->contains("Regex"))
        step.regex = std::make_shared<SplitRegex>(get_string(*pit, "Regex", field + ".pattern"),
                                                  false, where);
      else if (pit->contains("String"))
        step.regex = std::make_shared<SplitRegex>(get_string(*pit, "String", field + ".pattern"),
                                                  true, where);
      else
        fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      const std::string behavior = get_string(p, "behavior", field);
      if (behavior == "Removed")
        step.removed = true;
      else if (behavior != "Isolated")
        fail(field + ".behavior", "\"" + behavior + "\" is not supported (Isolated or Removed)");
      step.invert = get_bool(p, "invert", false, field);
    } else {
      fail(field + ".type", "\"" + type +
                                "\" is not supported (ByteLevel, Split or a Sequence of them; "
                                "keel reads byte-level BPE tokenizers)");
    }
    spec.pre_tokenizer.push_back(std::move(step));
  }

  void added_tokens(const json& a) {
    if (a.is_null()) return;
    if (!a.is_array()) fail("added_tokens", "expected an array");
    for (size_t i = 0; i < a.size(); ++i) {
      const json& t = a[i];
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      if (!t.is_object()) fail(field, "expected an object");
      const auto id = t.find("id");
      if (id == t.end()) fail(field + ".id", "expected an integer");
      AddedToken tok;
      tok.id = token_id_from_json(*id, file + ": " + field + ".id");
      tok.content = get_string(t, "content", field);
      tok.special = get_bool(t, "special", false, field);
      tok.lstrip = get_bool(t, "lstrip", false, field);
      tok.rstrip = get_bool(t, "rstrip", false, field);
      tok.single_word = get_bool(t, "single_word", false, field);
      spec.added_tokens.push_back(std::move(tok));
    }
  }

  // The id of a token named by content, from the vocabulary or the added tokens.
  int64_t find_token(const std::string& content) const {
    for (const AddedToken& a : spec.added_tokens)
      if (a.content == content) return a.id;
    for (const auto& [tok, id] : spec.vocab)
      if (tok == content) return id;
    return -1;
  }
};

// tokenizer_config.json's bos_token/eos_token/pad_token: a string, {"content": ...} or null
// (none: -1).
int64_t config_token(const Loader& ld, const json& cfg, const char* key,
                     const std::string& cfg_file) {
  const auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return -1;
  std::string content;
  if (it->is_string())
    content = it->get<std::string>();
  else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    content = (*it)["content"].get<std::string>();
  else
    throw Error(cfg_file + ": " + key + ": expected a string or {\"content\": ...}");
  const int64_t id = ld.find_token(content);
  if (id < 0)
    throw Error(cfg_file + ": " + key + " \"" + content + "\" is not a token of " + ld.file);
  return id;
}

// The text of a special token given in tokenizer_config.json: a string or {"content": ...};
// empty for null.
std::string config_token_text(const json& v, const std::string& where) {
  if (v.is_null()) return "";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  throw Error(where + ": expected a string or {\"content\": ...}");
}

// The model's chat template (chat_template.jinja beside the tokenizer, which transformers writes
// since 4.43 and reads before the config's; else tokenizer_config.json's "chat_template": a
// string, or a list of {"name", "template"} of which apply_chat_template takes "default") and the
// variables it is rendered with: transformers' special_tokens_map, the special tokens' text.
std::shared_ptr<const ChatFormat> chat_format_of(const json* cfg, const std::string& cfg_file,
                                                 const std::filesystem::path& dir, const Loader& ld,
                                                 const std::string& key) {
  std::string source, origin;
  std::error_code ec;
  const std::filesystem::path jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja, ec)) {
    source = read_tokenizer_file(jinja.string(), "chat template", key);
    origin = jinja.string();
  } else if (cfg && cfg->contains("chat_template") && !(*cfg)["chat_template"].is_null()) {
    const json& t = (*cfg)["chat_template"];
    origin = cfg_file + "'s chat_template";
    if (t.is_string()) {
      source = t.get<std::string>();
    } else if (t.is_array()) {
      for (const json& named : t)
        if (named.is_object() && named.value("name", json()) == "default" &&
            named.contains("template") && named["template"].is_string())
          source = named["template"].get<std::string>();
      if (source.empty())
        throw Error(cfg_file + ": chat_template: a list without a {\"name\": \"default\", " +
                        "\"template\": ...} entry (the one apply_chat_template uses); name one " +
                        "\"default\"",
                    Error::kUsage);
      origin += "[default]";
    } else {
      throw Error(cfg_file + ": chat_template: expected a string (the Jinja template), got " +
                      t.type_name(),
                  Error::kUsage);
    }
  } else {
    return nullptr;
  }
  auto chat = std::make_shared<ChatFormat>();
  chat->source = std::move(source);
  chat->origin = std::move(origin);
  // A token tokenizer_config.json does not name keeps the tokenizer.json's (its post-processor's
  // bos, <|endoftext|>), as the ids above.
  auto text_of = [&](int64_t id) -> std::string {
    for (const AddedToken& a : ld.spec.added_tokens)
      if (a.id == id) return a.content;
    for (const auto& [tok, tid] : ld.spec.vocab)
      if (tid == id) return tok;
    return "";
  };
  for (const char* name : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                           "cls_token", "mask_token"}) {
    std::string text;
    if (cfg && cfg->contains(name))
      text = config_token_text((*cfg)[name], cfg_file + ": " + name);
    else if (std::string(name) == "bos_token" && ld.spec.bos_id >= 0)
      text = text_of(ld.spec.bos_id);
    else if (std::string(name) == "eos_token" && ld.spec.eos_id >= 0)
      text = text_of(ld.spec.eos_id);
    if (!text.empty()) chat->special_tokens[name] = text;
  }
  if (cfg && cfg->contains("additional_special_tokens") &&
      (*cfg)["additional_special_tokens"].is_array()) {
    json list = json::array();
    for (const json& t : (*cfg)["additional_special_tokens"])
      list.push_back(config_token_text(t, cfg_file + ": additional_special_tokens"));
    chat->special_tokens["additional_special_tokens"] = std::move(list);
  }
  return chat;
}

}  // namespace

std::unique_ptr<BpeTokenizer> load_hf_tokenizer(const std::string& path, const std::string& key) {
  std::error_code ec;
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file, ec)) file /= "tokenizer.json";
  Loader ld;
  ld.file = file.string();
  ld.spec.source = ld.file;
  json root;
  try {
    root = json::parse(read_tokenizer_file(ld.file, "HF tokenizer file", key));
  } catch (const json::exception& e) {
    throw Error(ld.file + ": not valid JSON: " + json_error_detail(e.what()));
  }
  if (!root.is_object()) ld.fail("(top level)", "expected a JSON object");
  if (!root.contains("model")) ld.fail("model", "missing");
  ld.model(root["model"]);
  if (root.contains("normalizer") && !root["normalizer"].is_null())
    ld.fail("normalizer", "normalizers are not supported (byte-level BPE files have null)");
  if (root.contains("pre_tokenizer")) ld.pre_tokenizer(root["pre_tokenizer"], "pre_tokenizer");
  if (!ld.byte_level_seen)
    ld.fail("pre_tokenizer",
            "no ByteLevel step: keel reads byte-level BPE (GPT-2, Llama-3 and Qwen2 style), not "
            "SentencePiece-style BPE such as Llama-2's");
  if (root.contains("decoder") && !root["decoder"].is_null()) {
    const json& d = root["decoder"];
    if (!d.is_object() || ld.get_string(d, "type", "decoder") != "ByteLevel")
      ld.fail("decoder.type", "only the ByteLevel decoder is supported");
  }
  if (root.contains("added_tokens")) ld.added_tokens(root["added_tokens"]);

  // Special ids: first the tokenizer.json's own conventions. The post-processor's template names
  // the token it puts before the text (Llama-3's <|begin_of_text|>).
  // Each processor's "type" is checked as a string: json::value("type", "") threw nlohmann's
  // raw "[json.exception.type_error.302] type must be string, but is number".
  auto type_of = [&](const json& p, const std::string& field) -> std::string {
    if (!p.is_object() || !p.contains("type")) return "";
    return ld.get_string(p, "type", field);
  };
  const json* pp = root.contains("post_processor") ? &root["post_processor"] : nullptr;
  std::vector<std::pair<const json*, std::string>> procs;  // processor, its field
  if (pp && pp->is_object()) {
    if (type_of(*pp, "post_processor") == "Sequence" && pp->contains("processors") &&
        (*pp)["processors"].is_array()) {
      const json& list = (*pp)["processors"];
      for (size_t i = 0; i < list.size(); ++i)
        procs.emplace_back(&list[i], "post_processor.processors[" + std::to_string(i) + "]");
    } else {
      procs.emplace_back(pp, "post_processor");
    }
  }
  for (const auto& [p, field] : procs) {
    if (type_of(*p, field) != "TemplateProcessing") continue;
    const auto single = p->find("single");
    if (single == p->end() || !single->is_array() || single->empty()) continue;
    const json& first = (*single)[0];
    if (first.contains("SpecialToken") && first["SpecialToken"].contains("id") &&
        first["SpecialToken"]["id"].is_string()) {
      // A token the vocabulary lacks left bos unset without a word (examples began without it).
      const std::string content = first["SpecialToken"]["id"].get<std::string>();
      ld.spec.bos_id = ld.find_token(content);
      ld.spec.prefix_id = ld.spec.bos_id;  // what tokenizer(text) puts first
      if (ld.spec.bos_id < 0)
        ld.fail(field + ".single[0].SpecialToken.id",
                "\"" + content +
                    "\" is not a token of the file (neither in model.vocab nor in added_tokens); "
                    "add it to added_tokens or name a token the file has");
    }
  }
  const int64_t eot = ld.find_token("<|endoftext|>");
  if (eot >= 0) {
    if (ld.spec.bos_id < 0) ld.spec.bos_id = eot;
    ld.spec.eos_id = eot;
  }
  // tokenizer_config.json (transformers' file) names them when present (null: none, as Qwen2's
  // bos_token). A token it does not mention keeps the file's: GPT-2's on the Hub holds only
  // {"model_max_length": 1024}, and its <|endoftext|> was dropped, leaving no eos to end an
  // example with.
  const std::filesystem::path cfg_path = file.parent_path() / "tokenizer_config.json";
  json cfg;
  const bool has_cfg = std::filesystem::exists(cfg_path, ec);
  if (has_cfg) {
    try {
      cfg = json::parse(read_tokenizer_file(cfg_path.string(), "tokenizer config", key));
    } catch (const json::exception& e) {
      throw Error(cfg_path.string() + ": not valid JSON: " + json_error_detail(e.what()));
    }
    if (!cfg.is_object()) throw Error(cfg_path.string() + ": expected a JSON object");
    for (auto [name, id] :
         {std::pair{"bos_token", &ld.spec.bos_id}, std::pair{"eos_token", &ld.spec.eos_id},
          std::pair{"pad_token", &ld.spec.pad_id}}) {
      if (cfg.contains(name)) *id = config_token(ld, cfg, name, cfg_path.string());
    }
    // transformers' add_bos_token (Llama's tokenizers rebuild their post-processor from it).
    if (const auto add = cfg.find("add_bos_token"); add != cfg.end() && add->is_boolean())
      ld.spec.prefix_id = !add->get<bool>()        ? -1
                          : ld.spec.prefix_id >= 0 ? ld.spec.prefix_id
                                                   : ld.spec.bos_id;
  }
  ld.spec.chat =
      chat_format_of(has_cfg ? &cfg : nullptr, cfg_path.string(), file.parent_path(), ld, key);
  if (root.contains("padding") && root["padding"].is_object() && ld.spec.pad_id < 0) {
    const json& p = root["padding"];
    if (p.contains("pad_id") && p["pad_id"].is_number_integer())
      ld.spec.pad_id = token_id_from_json(p["pad_id"], ld.file + ": padding.pad_id");
  }
  return std::make_unique<BpeTokenizer>(std::move(ld.spec));
}

}  // namespace keel::data
