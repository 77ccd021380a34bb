// `keel chat MODEL`: a conversation with a model in its chat template. Each line of stdin is the
// user's message; the reply streams to stdout as it is made and joins the conversation, so the next
// message is answered with every turn before it (as `generate --messages` answers the whole).
// "/reset" starts over (the --system message stays), "/save FILE" appends the conversation to a
// JSONL dataset, "/exit" or the end of stdin ends. A
// conversation longer than the model's context drops its oldest exchange, with a note. The turns
// so far stay in the key/value cache, so a turn computes its own tokens only. --json prints one
// JSON line a turn instead (turn, reply, tokens, stop, prompt and reused tokens) for scripts.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/keel/commands.h"
#include "apps/keel/decode_prompt.h"
#include "apps/keel/model_args.h"
#include "keel/amp/autocast.h"
#include "keel/data/text_stream.h"
#include "keel/numerics/text.h"

namespace keel::cli {

namespace {
struct ChatArgs {
  ModelArgs m;
  std::string system, template_kwargs;
  std::vector<std::string> stops;
  models::GenerateOptions opt;
  bool json = false, no_cache = false;
};

void write_out(const std::string& s) {
  write_stdout(s, [] {
    return "the conversation stopped; send the replies to a reader that reads them all";
  });
}

std::string trimmed_path(std::string s) {
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  return s;
}

// "/save FILE": the conversation as the model holds it (the system message, each message and
// reply; --chat-template-kwargs as its chat_template_kwargs) appended to FILE as one JSONL line
// of a dataset (data.task = "jsonl"). A failure is said and the conversation goes on.
void save_conversation(const data::Conversation& c, const std::string& path) {
  if (path.empty()) {
    std::fputs("keel: /save FILE appends the conversation to FILE as a JSONL line; give FILE\n",
               stderr);
    return;
  }
  nlohmann::ordered_json line = {{"messages", c.messages}};
  if (!c.variables.empty()) line["chat_template_kwargs"] = c.variables;
  const std::string text =
      line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  std::FILE* f = std::fopen(path.c_str(), "a");
  bool ok = f && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  int err = errno;
  if (f && std::fclose(f) != 0 && ok) ok = false, err = errno;
  if (!ok) {
    std::fprintf(stderr, "keel: cannot write %s: %s; the conversation goes on, unsaved\n",
                 path.c_str(), std::strerror(err));
    return;
  }
  std::fprintf(stderr, "keel: the conversation (%zu messages) appended to %s\n", c.messages.size(),
               path.c_str());
}

int run_chat(ChatArgs& a) {
  const nlohmann::ordered_json kwargs = parse_template_kwargs(a.template_kwargs);
  ModelForUse m = load_model_for_use(a.m);
  const data::Tokenizer& tok = *m.tokenizer;
  if (!tok.chat_format())
    throw Error("keel chat: " + data::no_chat_template("the tokenizer " + m.tokenizer_spec) +
                    "; keel generate continues a text prompt without one",
                Error::kUsage);
  set_stop_ids(a.opt, m, a.no_cache);
  const int64_t context = m.trained.model->spec().max_seq_len;
  const bool terminal = isatty(STDIN_FILENO) && !a.json;
  data::Conversation c;
  c.variables = kwargs;
  auto start = [&] {
    c.messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) c.messages.push_back({{"role", "system"}, {"content", a.system}});
  };
  start();
  const size_t first_turn = c.messages.size();  // after the system message
  amp::AutocastGuard autocast(m.policy.autocast, m.policy.compute_dtype);
  const uint64_t seed = a.opt.seed;
  int64_t turn = 0;
  // The turns so far stay in the key/value cache: a turn computes only its own tokens.
  models::GenerateSession session;
  for (std::string line;;) {
    if (terminal) std::fputs("> ", stderr);
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "/exit") break;
    if (line == "/reset") {
      start();
      if (terminal) std::fputs("keel: the conversation starts over\n", stderr);
      continue;
    }
    if (line.rfind("/save", 0) == 0 && (line.size() == 5 || line[5] == ' ')) {
      save_conversation(c, trimmed_path(line.substr(5)));
      continue;
    }
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    c.messages.push_back({{"role", "user"}, {"content", line}});
    // The oldest exchanges leave while the prompt and a reply's first token do not fit.
    std::string prompt = chat_prompt(c, tok, m.tokenizer_spec);
    std::vector<int32_t> ids = prompt_ids(tok, m.tokenizer_spec, prompt, true, false, false, "");
    while (static_cast<int64_t>(ids.size()) >= context && c.messages.size() > first_turn + 1) {
      size_t drop = 1;  // the oldest message and the replies after it, up to the next user's
      while (first_turn + drop < c.messages.size() - 1 &&
             c.messages[first_turn + drop]["role"] != "user")
        ++drop;
      c.messages.erase(c.messages.begin() + static_cast<ptrdiff_t>(first_turn),
                       c.messages.begin() + static_cast<ptrdiff_t>(first_turn + drop));
      std::fprintf(stderr,
                   "keel: the conversation outgrew the model's context (%lld tokens): its oldest "
                   "exchange is dropped\n",
                   static_cast<long long>(context));
      prompt = chat_prompt(c, tok, m.tokenizer_spec);
      ids = prompt_ids(tok, m.tokenizer_spec, prompt, true, false, false, "");
    }
    if (static_cast<int64_t>(ids.size()) >= context) {
      std::fprintf(stderr,
                   "keel: this message alone is %zu tokens in the chat template, more than the "
                   "model's context (%lld): say it shorter\n",
                   ids.size(), static_cast<long long>(context));
      c.messages.erase(c.messages.end() - 1);
      continue;
    }
    // Each turn its own draws (the same for the same turn of the same conversation and --seed).
    a.opt.seed = seed + static_cast<uint64_t>(turn);
    data::TextStream stream(tok, a.stops, prompt);
    models::GenerateResult r = models::generate(
        *m.trained.model, ids, a.opt,
        [&](int32_t id) {
          const std::string s = stream.push(id);
          if (!a.json) write_out(s);
          return !stream.stopped();
        },
        &session);
    const std::string rest = stream.finish();
    if (stream.stopped()) r.stop = "stop_string";
    ++turn;
    if (a.json) {
      const nlohmann::ordered_json j = {
          {"turn", turn},   {"reply", stream.text()},      {"tokens", r.tokens.size()},
          {"stop", r.stop}, {"prompt_tokens", ids.size()}, {"reused_tokens", session.reused}};
      write_out(j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");
    } else {
      write_out(rest + "\n");
    }
    if (r.stop == "nonfinite")
      throw Error("the reply of turn " + std::to_string(turn) +
                  " stopped: " + std::to_string(r.nonfinite_logits) +
                  " logits are NaN or inf, so any token chosen from them would be arbitrary; " +
                  nonfinite_advice(a.m, m.policy));
    c.messages.push_back({{"role", "assistant"}, {"content", stream.text()}});
  }
  return 0;
}
}  // namespace

Command add_chat(CLI::App& app) {
  auto a = std::make_shared<ChatArgs>();
  a->opt.max_new_tokens = 256;
  CLI::App* sub = app.add_subcommand(
      "chat",
      "Talk with a model in its chat template: each line of stdin a message, each reply streamed "
      "(/reset starts over, /exit ends)");
  add_model_options(sub, a->m);
  sub->add_option("--system", a->system, "the system message the conversation starts with");
  sub->add_option("--chat-template-kwargs", a->template_kwargs,
                  "the chat template's variables as a JSON object, e.g. '{\"enable_thinking\": "
                  "false}'");
  sub->add_option("--max-new-tokens", a->opt.max_new_tokens, "at most this many tokens a reply")
      ->check(whole_check(1, INT64_MAX))
      ->capture_default_str();
  // (turn n of a conversation draws with --seed + n - 1)
  const std::function<void()> check_sampling = add_sampling_options(sub, a->opt, a->stops);
  sub->add_flag("--no-cache", a->no_cache, "re-run the whole sequence every step (reference)");
  sub->add_flag("--json", a->json, "one JSON line a turn (turn, reply, tokens, stop)");
  return {sub, [a, check_sampling] {
            check_sampling();
            return run_chat(*a);
          }};
}

}  // namespace keel::cli
