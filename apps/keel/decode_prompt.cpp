#include "apps/keel/decode_prompt.h"

#include <ctime>
#include <limits>

#include "apps/keel/flags.h"
#include "keel/io/hf_config.h"
#include "keel/numerics/text.h"

namespace keel::cli {

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &local);
  return buf;
}

std::string chat_prompt(const data::Conversation& c, const data::Tokenizer& tok,
                        const std::string& tokenizer_spec) {
  const data::ChatFormat* chat = tok.chat_format();
  if (!chat)
    throw Error("--chat: " + data::no_chat_template("the tokenizer " + tokenizer_spec) +
                    "; or leave --chat out to continue the prompt as text",
                Error::kUsage);
  return data::render_chat(*chat, c.messages, /*add_generation_prompt=*/true, today(), c.variables);
}

std::vector<int32_t> prompt_ids(const data::Tokenizer& tok, const std::string& tokenizer_spec,
                                const std::string& prompt, bool chat, bool bos, bool no_bos,
                                const std::string& empty_why) {
  std::vector<int32_t> ids = tok.encode(prompt);
  // The library's "the prompt is empty: give at least one token" named neither where the prompt
  // was read (an empty stdin or file) nor --bos, which starts a prompt-less decode as HF does.
  if (ids.empty() && !bos)
    throw Error("the prompt is empty " + empty_why + ": give a prompt" +
                    (tok.bos_id() >= 0 ? ", or --bos to start from the tokenizer's bos token" : ""),
                Error::kUsage);
  if (bos) {
    if (tok.bos_id() < 0)
      throw Error("--bos: the tokenizer (" + tokenizer_spec +
                      ") has no bos token to start the prompt with: leave --bos out",
                  Error::kUsage);
    if (ids.empty() || ids[0] != tok.bos_id())
      ids.insert(ids.begin(), static_cast<int32_t>(tok.bos_id()));
  } else if (!chat && !no_bos && tok.prefix_id() >= 0 && ids[0] != tok.prefix_id()) {
    // As the model trained (keel's datasets start each text so) and as transformers' tokenizer
    // and llama.cpp start a Llama-3 prompt: without <|begin_of_text|> its first tokens are
    // predicted from no attention sink. A prompt written with it already gets no second one.
    ids.insert(ids.begin(), static_cast<int32_t>(tok.prefix_id()));
  }
  return ids;
}

void set_stop_ids(models::GenerateOptions& opt, const ModelForUse& m, bool no_cache) {
  const data::Tokenizer& tok = *m.tokenizer;
  opt.eos_ids = {tok.eos_id()};
  std::vector<std::string> dirs = {m.trained.dir};
  if (m.trained.checkpoint && !m.trained.base_model.empty()) dirs.push_back(m.trained.base_model);
  for (const std::string& dir : dirs)
    for (int64_t id : io::generation_eos_ids(dir))
      if (id < tok.vocab_size()) opt.eos_ids.push_back(id);
  opt.choosable = tok.vocab_size();  // not the rows the model has beyond it
  opt.use_cache = !no_cache;
}

nlohmann::ordered_json parse_template_kwargs(const std::string& text) {
  if (text.empty()) return nlohmann::ordered_json::object();
  nlohmann::ordered_json kwargs;
  try {
    kwargs = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error("--chat-template-kwargs is not JSON (" + json_error_detail(e.what()) +
                    "); give an object, as '{\"enable_thinking\": false}'",
                Error::kUsage);
  }
  return data::template_kwargs(kwargs, "--chat-template-kwargs");
}

void with_template_kwargs(data::Conversation& c, const nlohmann::ordered_json& kwargs) {
  nlohmann::ordered_json variables = kwargs;
  for (const auto& [name, value] : c.variables.items()) variables[name] = value;
  c.variables = std::move(variables);
}

std::function<void()> add_sampling_options(CLI::App* sub, models::GenerateOptions& opt,
                                           std::vector<std::string>& stops) {
  sub->add_option("--temperature", opt.sampling.temperature, "0 = greedy")
      ->check(real_check(0, std::numeric_limits<double>::max(), false, false, " (0: greedy)"))
      ->capture_default_str();
  sub->add_option("--top-k", opt.sampling.top_k, "sample among the k most likely (0 = all)")
      ->check(whole_check(0, INT64_MAX, " (0: all)"))
      ->capture_default_str();
  sub->add_option("--top-p", opt.sampling.top_p, "nucleus: the most likely tokens of mass p")
      ->check(real_check(0, 1, true))
      ->capture_default_str();
  sub->add_option("--min-p", opt.sampling.min_p,
                  "sample only tokens at least this fraction of the most likely one's "
                  "probability (0 = off)")
      ->check(real_check(0, 1, false, true, " (0: off)"))
      ->capture_default_str();
  sub->add_option("--repetition-penalty", opt.sampling.repetition_penalty,
                  "divide the logits of tokens already in the text (prompt included) by this "
                  "(multiply where negative), as HF's repetition_penalty; 1 = off")
      ->check(real_check(0, std::numeric_limits<double>::max(), true, false, " (1: off)"))
      ->capture_default_str();
  CLI::Option* seed = sub->add_option("--seed", opt.seed, "sampling seed")
                          ->check(whole_check(0, UINT64_MAX))
                          ->capture_default_str();
  // One string an occurrence: with CLI11's default a vector option also took the arguments after
  // it, so `--stop x "17+05="` made the prompt a second stop string and read stdin instead.
  sub->add_option("--stop", stops,
                  "stop before this string, which is not printed (repeatable); it may begin in "
                  "the prompt and end in the new text, as HF's stop_strings")
      ->allow_extra_args(false)
      ->check([](const std::string& v) {
        return v.empty() ? std::string("\"\": an empty string would never stop") : "";
      });
  return [seed, &opt] {
    // Greedy decoding draws nothing: a --seed was accepted and ignored, as --top-k was.
    if (seed->count() > 0 && opt.sampling.temperature == 0)
      throw Error("--seed " + std::to_string(opt.seed) +
                      " seeds the sampling, but --temperature 0 decodes greedily (the most "
                      "likely token each step) and draws nothing: give a --temperature above 0 "
                      "(e.g. 0.7) to sample, or leave --seed out",
                  Error::kUsage);
  };
}

}  // namespace keel::cli
