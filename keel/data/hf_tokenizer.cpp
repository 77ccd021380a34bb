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
  std::string unk_token;  // model.unk_token; "" for none

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
    spec.metaspace.byte_fallback = get_bool(m, "byte_fallback", false, "model");
    spec.metaspace.fuse_unk = get_bool(m, "fuse_unk", false, "model");
    if (m.contains("unk_token") && !m["unk_token"].is_null())
      unk_token = get_string(m, "unk_token", "model");
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
    if (type == "Metaspace") {  // transformers' legacy=false Llama/Mistral files
      metaspace_replacement(p, field);
      spec.metaspace.split = get_bool(p, "split", true, field);
      // Files before prepend_scheme hold add_prefix_space (true: "always").
      std::string scheme = get_bool(p, "add_prefix_space", true, field) ? "always" : "never";
      if (p.contains("prepend_scheme")) scheme = get_string(p, "prepend_scheme", field);
      using P = Metaspace::Prepend;
      if (scheme == "first")
        spec.metaspace.prepend = P::kFirst;
      else if (scheme == "always")
        spec.metaspace.prepend = P::kAlways;
      else if (scheme == "never")
        spec.metaspace.prepend = P::kNever;
      else
        fail(field + ".prepend_scheme", "\"" + scheme + "\" is not first, always or never");
      spec.metaspace.on = true;
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
      if (spec.metaspace.on) {
        // Gemma's Split(" ", MergedWithPrevious) (transformers' GemmaConverter) runs after its
        // normalizer has spelled every space "▁": it finds nothing to split at. Any other split
        // of a SentencePiece-style file would change the words keel merges. (Inverted, a
        // pattern that never matches makes the whole text the delimiter: not a no-op.)
        if (pit->contains("String") && get_string(*pit, "String", field + ".pattern") == " " &&
            !get_bool(p, "invert", false, field))
          return;
        fail(field,
             "a Split in a SentencePiece-style file (\"\u2581\" for spaces) is not "
             "supported, other than Gemma's Split(\" \"), which finds no space left");
      }
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
    } else if (type == "Digits") {
      // StarCoder2's, Granite's and SmolLM2's files: Digits(individual_digits) before ByteLevel.
      // HF splits at char::is_numeric (categories Nd, Nl, No: PCRE2's \p{N}), each numeric
      // character its own piece, or a run of them one piece when individual_digits is false.
      if (byte_level_seen)
        fail(field, "a Digits step after the ByteLevel pre-tokenizer is not supported");
      const bool individual = get_bool(p, "individual_digits", false, field);
      step.regex = std::make_shared<SplitRegex>(individual ? "\\p{N}" : "\\p{N}+", false,
                                                file + ": " + field);
    } else {
      fail(field + ".type", "\"" + type +
                                "\" is not supported (ByteLevel, Split, Digits or a Sequence of "
                                "them, or Metaspace; keel reads BPE tokenizers)");
    }
    spec.pre_tokenizer.push_back(std::move(step));
  }

  // Metaspace's replacement must be "▁" (U+2581), as every SentencePiece model writes it.
  void metaspace_replacement(const json& p, const std::string& field) const {
    if (p.contains("replacement") && get_string(p, "replacement", field) != "\u2581")
      fail(field + ".replacement", "only \"\u2581\" (U+2581) is supported");
  }

  // Whether `p` is {"pattern": {"String": from}, "content": to} (a Replace step).
  bool replaces(const json& p, const std::string& field, const char* from, const char* to) const {
    const auto pat = p.find("pattern");
    return pat != p.end() && pat->is_object() && pat->contains("String") &&
           get_string(*pat, "String", field + ".pattern") == from &&
           get_string(p, "content", field) == to;
  }

  // The normalizer: null (byte-level files), NFC (Qwen2's, Qwen3's: Unicode's composed form,
  // before the pre-tokenizer), or Llama-2's SentencePiece spelling, Prepend("▁") and
  // Replace(" ", "▁") (in either order, or the Replace alone), in a Sequence with NFC or not.
  void normalizer(const json& n) {
    if (n.is_null()) return;
    std::vector<std::pair<const json*, std::string>> steps;
    if (n.is_object() && n.value("type", json()) == "Sequence" && n.contains("normalizers") &&
        n["normalizers"].is_array()) {
      for (size_t i = 0; i < n["normalizers"].size(); ++i)
        steps.emplace_back(&n["normalizers"][i],
                           "normalizer.normalizers[" + std::to_string(i) + "]");
    } else {
      steps.emplace_back(&n, "normalizer");
    }
    bool replaced = false, prepended = false;
    for (const auto& [step, field] : steps) {
      if (!step->is_object()) fail(field, "expected an object");
      const std::string type = get_string(*step, "type", field);
      if (type == "NFC") {
        spec.nfc = true;
      } else if (type == "Prepend" && get_string(*step, "prepend", field) == "\u2581") {
        spec.metaspace.prepend = Metaspace::Prepend::kEvery;
        prepended = true;
      } else if (type == "Replace" && replaces(*step, field, " ", "\u2581")) {
        replaced = true;
      } else {
        fail(field, "the " + type +
                        " normalizer is not supported (keel reads null, NFC, or Llama-2's "
                        "Prepend(\"\u2581\") and Replace(\" \", \"\u2581\"))");
      }
    }
    if (!prepended && !replaced) return;  // NFC alone: a byte-level file's
    if (!replaced)
      fail("normalizer",
           "a \"\u2581\" prepended without Replace(\" \", \"\u2581\") is not "
           "supported");
    spec.metaspace.on = true;
  }

  // The decoder: ByteLevel for byte-level files; for SentencePiece-style ones Llama-2's Sequence
  // of Replace("▁", " "), ByteFallback, Fuse and Strip(" ", n, 0), or Metaspace's.
  void decoder(const json& d) {
    if (d.is_null()) return;
    if (!d.is_object()) fail("decoder", "expected an object");
    if (!spec.metaspace.on) {
      if (get_string(d, "type", "decoder") != "ByteLevel")
        fail("decoder.type", "only the ByteLevel decoder is supported for byte-level BPE");
      return;
    }
    std::vector<std::pair<const json*, std::string>> steps;
    if (get_string(d, "type", "decoder") == "Sequence") {
      const auto list = d.find("decoders");
      if (list == d.end() || !list->is_array()) fail("decoder.decoders", "expected an array");
      for (size_t i = 0; i < list->size(); ++i)
        steps.emplace_back(&(*list)[i], "decoder.decoders[" + std::to_string(i) + "]");
    } else {
      steps.emplace_back(&d, "decoder");
    }
    Metaspace& m = spec.metaspace;
    bool fused = false;
    for (const auto& [step, field] : steps) {
      if (!step->is_object()) fail(field, "expected an object");
      const std::string type = get_string(*step, "type", field);
      if (type == "Replace" && replaces(*step, field, "\u2581", " ")) {
        m.decode_metaspace = true;
      } else if (type == "ByteFallback") {
        m.decode_bytes = true;
      } else if (type == "Fuse") {
        fused = true;
      } else if (type == "Strip") {
        const auto start = step->find("start"), stop = step->find("stop");
        if (get_string(*step, "content", field) != " " || !fused || start == step->end() ||
            !start->is_number_unsigned() || start->get<uint64_t>() > 8 ||
            (stop != step->end() && !(stop->is_number_integer() && stop->get<int64_t>() == 0)))
          fail(field, "only Strip(\" \", start, 0) after Fuse is supported (Llama-2's)");
        m.strip_leading = static_cast<int>(start->get<uint64_t>());
      } else if (type == "Metaspace") {
        metaspace_replacement(*step, field);
        m.decode_metaspace = true;
        std::string scheme = get_bool(*step, "add_prefix_space", true, field) ? "always" : "never";
        if (step->contains("prepend_scheme")) scheme = get_string(*step, "prepend_scheme", field);
        m.drop_first_metaspace = scheme != "never";
      } else {
        fail(field, "the " + type +
                        " decoder is not supported for SentencePiece-style BPE (keel reads "
                        "Replace, ByteFallback, Fuse, Strip and Metaspace)");
      }
    }
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
  if (root.contains("normalizer")) ld.normalizer(root["normalizer"]);
  if (root.contains("pre_tokenizer")) ld.pre_tokenizer(root["pre_tokenizer"], "pre_tokenizer");
  // Byte-level BPE (GPT-2, Llama-3, Qwen2) or SentencePiece-style (Llama-2, Mistral, TinyLlama).
  if (ld.byte_level_seen && ld.spec.metaspace.on)
    ld.fail("pre_tokenizer",
            "a ByteLevel step in a SentencePiece-style file (\"\u2581\" for spaces): keel reads "
            "one or the other");
  if (ld.spec.metaspace.on && !ld.spec.pre_tokenizer.empty())  // a Split before the Metaspace
    ld.fail("pre_tokenizer",
            "a Split or Digits step in a SentencePiece-style file (\"\u2581\" for spaces) is not "
            "supported, other than Gemma's Split(\" \") after its Replace normalizer");
  if (!ld.byte_level_seen && !ld.spec.metaspace.on)
    ld.fail("pre_tokenizer",
            "no ByteLevel step and no \"\u2581\" for spaces: keel reads byte-level BPE (GPT-2, "
            "Llama-3 and Qwen2 style) and SentencePiece-style BPE (Llama-2, Mistral)");
  if (ld.spec.metaspace.byte_fallback && !ld.spec.metaspace.on)
    ld.fail("model.byte_fallback",
            "true in a byte-level file, whose 256 byte symbols leave nothing to fall back to");
  if (root.contains("decoder")) ld.decoder(root["decoder"]);
  if (root.contains("added_tokens")) ld.added_tokens(root["added_tokens"]);
  if (ld.spec.metaspace.on && !ld.unk_token.empty()) {  // (byte-level BPE never needs one)
    ld.spec.metaspace.unk_id = ld.find_token(ld.unk_token);
    if (ld.spec.metaspace.unk_id < 0)
      ld.fail("model.unk_token", "\"" + ld.unk_token + "\" is not a token of the file");
  }

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
