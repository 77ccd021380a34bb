// What `keel generate` and `keel chat` share around a decode: a conversation as the model's chat
// template asks for a reply, the prompt's first ids, and the ids that end a reply.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "apps/keel/model_args.h"
#include "keel/data/chat.h"
#include "keel/models/generate.h"

namespace keel::cli {

// Today's date as "YYYY-MM-DD", local time: what transformers' strftime_now formats (Llama-3.2's
// template writes it into the system turn).
std::string today();

// The conversation in the model's chat template with the assistant's header opened, as
// apply_chat_template(add_generation_prompt=True) writes it. A tokenizer without a template is a
// usage error naming `tokenizer_spec` and the fixes.
std::string chat_prompt(const data::Conversation& c, const data::Tokenizer& tok,
                        const std::string& tokenizer_spec);

// The prompt's ids as the decode starts from them: `bos`'s token (--bos), or (plain text, not
// `no_bos`) the token the tokenizer puts before every text, as the model trained. `empty_why`
// says where an empty prompt came from.
std::vector<int32_t> prompt_ids(const data::Tokenizer& tok, const std::string& tokenizer_spec,
                                const std::string& prompt, bool chat, bool bos, bool no_bos,
                                const std::string& empty_why);

// The tokenizer's eos, and every id the model's generation_config.json ends a reply with (a run's
// checkpoint: its base's file), as transformers' generate stops; the ids a decode may choose; the
// cache unless `no_cache`.
void set_stop_ids(models::GenerateOptions& opt, const ModelForUse& m, bool no_cache);

// --chat-template-kwargs's JSON object: variables for the chat template (Qwen3's
// {"enable_thinking": false}), as llama.cpp's flag and apply_chat_template's keyword arguments
// give them; "" gives none. A conversation's own chat_template_kwargs go over them
// (with_template_kwargs). Errors (kUsage) name the flag.
nlohmann::ordered_json parse_template_kwargs(const std::string& text);
void with_template_kwargs(data::Conversation& c, const nlohmann::ordered_json& kwargs);

// --temperature, --top-k, --top-p, --seed and --stop (repeatable) of `sub` into `opt` and `stops`.
// The returned check refuses a --seed given with greedy decoding (it draws nothing): call it when
// the command runs.
std::function<void()> add_sampling_options(CLI::App* sub, models::GenerateOptions& opt,
                                           std::vector<std::string>& stops);

}  // namespace keel::cli
