// `keel generate MODEL [PROMPT]`: text from a model — an HF directory, a run's checkpoint or its
// out_dir, optionally with a PEFT adapter directory — greedy or sampled (temperature, top-k,
// top-p, seed), with the key/value cache, streamed to stdout as it is produced, stopping at eos,
// a --stop string or --max-new-tokens. The prompt comes from the argument, --prompt-file or
// stdin; with --chat it is a user's message in the model's chat template, with --messages a
// conversation (JSON) to answer. A summary (tokens, tokens/s, why it stopped) goes to stderr, or
// all of it as --json. With --input FILE --output OUT, a reply to every prompt of a JSONL file.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "apps/keel/commands.h"
#include "apps/keel/decode_prompt.h"
#include "apps/keel/input_text.h"
#include "apps/keel/model_args.h"
#include "apps/keel/output_dir.h"
#include "keel/amp/autocast.h"
#include "keel/data/chat.h"
#include "keel/data/text_stream.h"
#include "keel/models/generate.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/text.h"

namespace keel::cli {

namespace {
struct GenerateArgs {
  ModelArgs m;
  std::string prompt, prompt_file, input, output;
  std::vector<std::string> stops;
  models::GenerateOptions opt;
  std::string system, template_kwargs;
  bool chat = false, messages = false, bos = false, no_bos = false, no_cache = false, json = false;
  int64_t batch_size = 0;  // --input: prompts decoded side by side (0: not given, 1)
};

// Where the prompt was read, for errors.
std::string prompt_source(const GenerateArgs& a, bool has_prompt) {
  return has_prompt              ? "the PROMPT argument"
         : a.prompt_file.empty() ? "stdin"
                                 : "--prompt-file " + a.prompt_file;
}

// --messages: the prompt is a conversation to answer, as JSON: an array of messages, or a JSONL
// line in any of the conversational formats a dataset reads (data/chat.h), its "tools" and
// "chat_template_kwargs" included. A prompt-completion line gives its prompt: the completion is
// what the model is asked to write, so a line of a run's eval data can be tried as it is. Read and
// checked before the model is loaded.
data::Conversation conversation_prompt(const std::string& text, const std::string& source) {
  data::Conversation c;
  try {
    c = data::parse_conversation(text, source);
  } catch (const Error& e) {
    throw Error(std::string("--messages: ") + e.what(), Error::kUsage);
  }
  if (c.prompt_size > 0)  // a prompt-completion line: its prompt
    c.messages.erase(c.messages.begin() + static_cast<ptrdiff_t>(c.prompt_size), c.messages.end());
  if (c.messages.back()["role"] == "assistant")
    throw Error(
        "--messages: " + source +
            " ends with the assistant's message, which is what the model is to write: remove it "
            "(or "
            "give the line as {\"prompt\": [...], \"completion\": [...]}, whose prompt is used)",
        Error::kUsage);
  return c;
}

// --input: one prompt a line of a JSONL file, as a dataset holds them, and what the line says the
// answer is (the reference written beside the model's).
struct BatchPrompt {
  int64_t line = 0;
  bool conversational = false;
  data::Conversation conversation;   // a conversational line's messages to answer
  std::string text;                  // a {"prompt": "..."} line's prompt
  nlohmann::ordered_json reference;  // its completion, or the reply that ends its conversation
};

// Every line of --input read and checked before the model loads (minutes for a large one), each
// error naming the file and line: a {"prompt": ..., "completion": ...} line is its prompt (the
// completion the reference), a conversation in any of the formats a dataset reads is answered as
// --messages answers it (the reply that ends it, or its completion, the reference).
std::vector<BatchPrompt> read_batch_prompts(const std::string& path) {
  const std::string text = read_input_file(path, "prompt file", "--input");
  std::vector<BatchPrompt> out;
  int64_t number = 0;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + at, end - at);
    at = end + 1;
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    auto bad = [&](const std::string& what) {
      return Error("--input " + path + ": line " + std::to_string(number) + ": " + what,
                   Error::kUsage);
    };
    nlohmann::ordered_json obj;
    try {
      obj = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw bad("invalid JSON (" + json_error_detail(e.what()) +
                "); give one object a line: {\"prompt\": ...} or a conversation");
    }
    if (!obj.is_object())
      throw bad(std::string("a JSON ") + obj.type_name() +
                " instead of an object: {\"prompt\": ...} or a conversation");
    BatchPrompt p;
    p.line = number;
    if (data::is_conversation(obj)) {
      p.conversational = true;
      try {
        p.conversation = data::conversation_of(obj);
      } catch (const Error& e) {
        throw bad(e.what());
      }
      data::Conversation& c = p.conversation;
      if (c.prompt_size > 0) {
        p.reference = nlohmann::ordered_json(
            c.messages.begin() + static_cast<ptrdiff_t>(c.prompt_size), c.messages.end());
        c.messages.erase(c.messages.begin() + static_cast<ptrdiff_t>(c.prompt_size),
                         c.messages.end());
      } else if (c.messages.back()["role"] == "assistant") {
        p.reference = c.messages.back()["content"];
        c.messages.erase(c.messages.end() - 1);
      }
      if (c.messages.empty())
        throw bad("the conversation is the assistant's reply alone: give the messages it answers");
    } else if (obj.contains("prompt") && obj["prompt"].is_string()) {
      p.text = obj["prompt"].get<std::string>();
      if (obj.contains("completion")) p.reference = obj["completion"];
    } else if (obj.contains("prompt")) {
      throw bad(std::string("\"prompt\" is a JSON ") + obj["prompt"].type_name() +
                "; give the prompt's text, or its messages as a list");
    } else {
      throw bad(obj.contains("text")
                    ? "a {\"text\": ...} line has no prompt to answer; give "
                      "{\"prompt\": ..., \"completion\": ...} lines or conversations"
                    : "holds no prompt: give {\"prompt\": ...} or a conversation "
                      "({\"messages\": [...]})");
    }
    out.push_back(std::move(p));
  }
  if (out.empty())
    throw Error("--input " + path + " holds no prompt (it is empty or holds only blank lines)",
                Error::kUsage);
  return out;
}

// A line's reference as text: its completion, or a completion of one assistant message (nullopt:
// none, or one that is no text to compare a reply with).
std::optional<std::string> reference_text(const nlohmann::ordered_json& ref) {
  if (ref.is_string()) return ref.get<std::string>();
  if (ref.is_array() && ref.size() == 1 && ref[0].is_object() &&
      ref[0].value("role", "") == "assistant" && ref[0].contains("content") &&
      ref[0]["content"].is_string())
    return ref[0]["content"].get<std::string>();
  return std::nullopt;
}

// `s` without the whitespace at either end (a completion's leading space, a reply's last newline).
std::string_view trimmed(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// --input FILE --output OUT: a reply to every prompt of FILE, one JSON line each in OUT (its line,
// the prompt as the model read it, the reply, the reference, the tokens and why it stopped). They
// are written and flushed as each is made to OUT.partial, renamed over OUT when all are: a run
// stopped midway keeps the replies made there, and an OUT of an earlier run stays whole. The
// sampling, stop and length flags apply to each prompt alike (a --seed gives each prompt the same
// draws, so a line's reply does not depend on the lines before it); --chat (and --system) writes
// the text prompts as a user's message in the chat template.
int run_generate_batch(GenerateArgs& a, bool has_prompt) {
  auto refuse = [](const std::string& what) { return Error(what, Error::kUsage); };
  if (has_prompt || !a.prompt_file.empty())
    throw refuse(
        "--input reads the prompts from its file: leave out the PROMPT argument and "
        "--prompt-file");
  if (a.messages)
    throw refuse(
        "--messages with --input: the conversations of --input are answered as "
        "--messages answers one; leave --messages out");
  if (a.json) throw refuse("--json with --input: --output is JSON lines already; leave --json out");
  if (a.output.empty()) throw refuse("--input needs --output: the file the replies are written to");
  if (!a.system.empty() && !a.chat)
    throw refuse(
        "--system is the system turn of a --chat prompt: give --chat too, or leave "
        "--system out");
  if (a.bos && a.no_bos) throw refuse("--bos and --no-bos contradict each other: give one");
  if (a.batch_size > 1 && a.no_cache)
    throw refuse("--batch-size " + std::to_string(a.batch_size) +
                 " decodes prompts side by side over their key/value caches, and --no-cache "
                 "has none: leave one out");
  check_output_file("--output", a.output, "--input", a.input, "the prompts with the replies");
  if (const std::string why = replaced_file_problem(a.output + ".partial"); !why.empty())
    throw refuse("--output " + a.output + ": " + why);
  const std::vector<BatchPrompt> prompts = read_batch_prompts(a.input);
  const nlohmann::ordered_json kwargs = parse_template_kwargs(a.template_kwargs);
  if (!a.template_kwargs.empty() && !a.chat &&
      std::none_of(prompts.begin(), prompts.end(),
                   [](const BatchPrompt& p) { return p.conversational; }))
    throw refuse("--chat-template-kwargs: --input " + a.input +
                 " holds no conversation and --chat is not given, so no chat template is "
                 "rendered; give --chat, or leave the flag out");
  ModelForUse m = load_model_for_use(a.m);
  const data::Tokenizer& tok = *m.tokenizer;
  const bool any_chat =
      a.chat || std::any_of(prompts.begin(), prompts.end(),
                            [](const BatchPrompt& p) { return p.conversational; });
  if (any_chat && !tok.chat_format())
    throw refuse("--input: " + data::no_chat_template("the tokenizer " + m.tokenizer_spec));
  const std::string partial = a.output + ".partial";
  std::FILE* out = std::fopen(partial.c_str(), "w");
  if (!out)
    throw Error("cannot write " + partial + " (--output " + a.output +
                    "): " + std::strerror(errno) + "; check the directory exists and is writable",
                Error::kUsage);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(out, std::fclose);
  set_stop_ids(a.opt, m, a.no_cache);
  amp::AutocastGuard autocast(m.policy.autocast, m.policy.compute_dtype);
  int64_t written = 0, compared = 0, matched = 0;
  const size_t batch = static_cast<size_t>(std::max<int64_t>(a.batch_size, 1));
  for (size_t first = 0; first < prompts.size(); first += batch) {
    // --batch-size prompts decoded side by side; their lines written in the file's order.
    const size_t end = std::min(prompts.size(), first + batch);
    std::vector<std::string> texts;
    std::vector<std::vector<int32_t>> ids;
    std::vector<data::TextStream> streams;
    for (size_t i = first; i < end; ++i) {
      const BatchPrompt& p = prompts[i];
      data::Conversation c = p.conversation;
      with_template_kwargs(c, kwargs);
      const bool chat = p.conversational || a.chat;
      if (!p.conversational && a.chat) {
        if (!a.system.empty()) c.messages.push_back({{"role", "system"}, {"content", a.system}});
        c.messages.push_back({{"role", "user"}, {"content", p.text}});
      }
      texts.push_back(chat ? chat_prompt(c, tok, m.tokenizer_spec) : p.text);
      ids.push_back(prompt_ids(tok, m.tokenizer_spec, texts.back(), chat, a.bos, a.no_bos,
                               "(--input line " + std::to_string(p.line) + ")"));
      streams.emplace_back(tok, a.stops, texts.back());
    }
    std::vector<models::GenerateResult> results =
        models::generate_rows(*m.trained.model, ids, a.opt, [&](size_t b, int32_t id) {
          streams[b].push(id);
          return !streams[b].stopped();
        });
    for (size_t i = first; i < end; ++i) {
      const BatchPrompt& p = prompts[i];
      data::TextStream& stream = streams[i - first];
      models::GenerateResult& r = results[i - first];
      stream.finish();
      if (stream.stopped()) r.stop = "stop_string";
      // Whether the reply is its reference, whitespace at either end aside (null: no reference).
      nlohmann::ordered_json exact;
      if (const std::optional<std::string> want = reference_text(p.reference)) {
        exact = trimmed(stream.text()) == trimmed(*want);
        ++compared;
        matched += exact.get<bool>();
      }
      const nlohmann::ordered_json line = {{"line", p.line},
                                           {"prompt", texts[i - first]},
                                           {"completion", stream.text()},
                                           {"reference", p.reference},
                                           {"exact_match", exact},
                                           {"tokens", r.tokens.size()},
                                           {"stop", r.stop}};
      const std::string text =
          line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
      if (std::fwrite(text.data(), 1, text.size(), out) != text.size() || std::fflush(out) != 0)
        throw Error("cannot write " + partial + " (--output " + a.output +
                    "): " + std::strerror(errno) + "; the " + std::to_string(written) + " of " +
                    std::to_string(prompts.size()) + " replies made before it are there");
      ++written;
      std::fprintf(stderr, "keel: line %lld: %s, stopped: %s (%lld of %zu)\n",
                   static_cast<long long>(p.line),
                   count_of(static_cast<long long>(r.tokens.size()), "token").c_str(),
                   r.stop.c_str(), static_cast<long long>(written), prompts.size());
      if (r.stop == "nonfinite")
        throw Error("generation of --input line " + std::to_string(p.line) + " stopped: " +
                    std::to_string(r.nonfinite_logits) + " logits are NaN or inf (the replies " +
                    "before it are in " + partial + "); " + nonfinite_advice(a.m, m.policy));
    }
  }
  if (std::fclose(closer.release()) != 0)
    throw Error("cannot write " + partial + " (--output " + a.output +
                "): " + std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(partial, a.output, ec);
  if (ec)
    throw Error("cannot rename " + partial + " to --output " + a.output + ": " + ec.message() +
                " (the replies are in " + partial + ")");
  if (compared > 0)
    std::fprintf(stderr,
                 "keel: %lld of %lld replies equal their reference (whitespace at either end "
                 "aside); the replies are in %s\n",
                 static_cast<long long>(matched), static_cast<long long>(compared),
                 a.output.c_str());
  return 0;
}

int run_generate(GenerateArgs& a, bool has_prompt) {
  if (!a.input.empty()) return run_generate_batch(a, has_prompt);
  if (!a.output.empty())
    throw Error(
        "--output is where --input's replies go: give --input FILE too, or leave "
        "--output out (the reply streams to stdout)",
        Error::kUsage);
  if (a.batch_size > 0)
    throw Error(
        "--batch-size decodes --input's prompts side by side: give --input FILE and "
        "--output OUT too, or leave --batch-size out (one prompt decodes alone)",
        Error::kUsage);
  std::string prompt = read_input_text(has_prompt, a.prompt, a.prompt_file, "--prompt-file");
  // A line read from stdin or a file ends with its newline, which became the prompt's last token
  // (`echo "17+05=" | keel generate` prompted "17+05=\n"). One line ending is dropped, as the
  // shell's $(cat file) does and as llama.cpp and HF pipeline users expect; the argument is kept.
  if (!has_prompt && prompt.ends_with('\n')) {
    prompt.pop_back();
    if (prompt.ends_with('\r')) prompt.pop_back();
  }
  // The flags that contradict each other, and a conversation keel cannot read, before a model of
  // gigabytes is loaded.
  if (a.messages) a.chat = true;
  if (a.messages && !a.system.empty())
    throw Error(
        "--system with --messages: the conversation gives its own system message; put it there "
        "as {\"role\": \"system\", ...}, or leave --system out",
        Error::kUsage);
  data::Conversation conversation;
  if (a.messages) {
    conversation = conversation_prompt(prompt, prompt_source(a, has_prompt));
  } else if (a.chat) {
    if (!a.system.empty())
      conversation.messages.push_back({{"role", "system"}, {"content", a.system}});
    conversation.messages.push_back({{"role", "user"}, {"content", prompt}});
  }
  if (!a.system.empty() && !a.chat)
    throw Error(
        "--system is the system turn of a --chat prompt: give --chat too, or leave --system "
        "out",
        Error::kUsage);
  if (!a.template_kwargs.empty() && !a.chat)
    throw Error(
        "--chat-template-kwargs are the chat template's variables: give --chat or --messages "
        "too, or leave the flag out",
        Error::kUsage);
  with_template_kwargs(conversation, parse_template_kwargs(a.template_kwargs));
  if (a.bos && a.no_bos)
    throw Error("--bos and --no-bos contradict each other: give one", Error::kUsage);
  if (a.chat && (a.bos || a.no_bos))
    throw Error(std::string(a.bos ? "--bos" : "--no-bos") +
                    " with --chat: the chat template writes how the conversation starts; leave " +
                    (a.bos ? "--bos" : "--no-bos") + " out",
                Error::kUsage);
  ModelForUse m = load_model_for_use(a.m);
  const data::Tokenizer* tok = m.tokenizer.get();
  const PrecisionPolicy& policy = m.policy;

  if (a.chat) prompt = chat_prompt(conversation, *tok, m.tokenizer_spec);
  const std::vector<int32_t> ids =
      prompt_ids(*tok, m.tokenizer_spec, prompt, a.chat, a.bos, a.no_bos,
                 "(" + prompt_source(a, has_prompt) + " held no text)");
  set_stop_ids(a.opt, m, a.no_cache);
  // The prompt's end counts toward a stop string (text_stream.h): only the new text was searched,
  // so "\n\n" never stopped a prompt ending in "\n" at the model's first "\n".
  data::TextStream stream(*tok, a.stops, prompt);
  // A closed pipe or full disk stops the decode at once: it went on to --max-new-tokens for no
  // reader and ended in exit 0.
  size_t emitted = 0;
  auto emit = [&](const std::string& s) {
    if (a.json) return;
    write_stdout(s, [&] {
      return "generation stopped after " + count_of(static_cast<long long>(emitted), "new token") +
             "; send the text to a file with space (> out.txt) or to a reader that reads it all";
    });
  };
  amp::AutocastGuard autocast(policy.autocast, policy.compute_dtype);
  models::GenerateResult r = models::generate(*m.trained.model, ids, a.opt, [&](int32_t id) {
    ++emitted;
    emit(stream.push(id));
    return !stream.stopped();
  });
  emit(stream.finish());
  if (stream.stopped()) r.stop = "stop_string";
  // The first new token comes from the prompt's pass; the rate is of the tokens after it, over
  // their own seconds ("5 tokens ... in 0.142 s (2051.9 tokens/s)" gave the rate of 4 tokens in
  // 0.002 s beside seconds that held the prompt's pass).
  const double secs = r.prompt_seconds + r.decode_seconds;
  const size_t decoded = r.tokens.size() > 1 ? r.tokens.size() - 1 : 0;
  const double tps =
      r.decode_seconds > 0 && decoded > 0 ? static_cast<double>(decoded) / r.decode_seconds : 0;
  if (a.json) {
    nlohmann::json j = {{"text", stream.text()},
                        {"tokens", r.tokens},
                        {"prompt_tokens", ids.size()},
                        {"stop", r.stop},
                        {"seconds", secs},
                        {"prompt_seconds", r.prompt_seconds},
                        {"decode_seconds", r.decode_seconds},
                        {"decode_tokens_per_s", tps},
                        {"tokenizer", m.tokenizer_spec},
                        {"precision", policy.name()}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("\n");
    std::string decode;
    if (decoded > 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, ", the next %s in %.3f s (%.1f tokens/s)",
                    count_of(static_cast<long long>(decoded), "token").c_str(), r.decode_seconds,
                    tps);
      decode = buf;
    }
    std::fprintf(stderr, "keel: %s after a %zu-token prompt: prompt pass %.3f s%s; stopped: %s\n",
                 count_of(static_cast<long long>(r.tokens.size()), "token").c_str(), ids.size(),
                 r.prompt_seconds, decode.c_str(), r.stop.c_str());
  }
  if (r.stop == "nonfinite")  // what was printed stands; the next token would have been arbitrary
    throw Error("generation stopped before new token " + std::to_string(r.tokens.size() + 1) +
                ": " + std::to_string(r.nonfinite_logits) + " of its " +
                std::to_string(m.trained.model->spec().vocab_size) +
                " logits are NaN or inf, so any token chosen from them would be arbitrary; " +
                nonfinite_advice(a.m, policy));
  return 0;
}
}  // namespace

Command add_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand(
      "generate", "Generate text from an HF model directory or a run's checkpoint (+ adapter)");
  add_model_options(sub, a->m);
  CLI::Option* prompt = sub->add_option("PROMPT", a->prompt,
                                        "the prompt (default: stdin, less one trailing newline)");
  sub->add_option("--prompt-file", a->prompt_file,
                  "read the prompt from this file, less one trailing newline");
  sub->add_option("--max-new-tokens", a->opt.max_new_tokens, "at most this many new tokens")
      ->check(whole_check(0, INT64_MAX, " (0: the prompt alone)"))  // -1 generated nothing
      ->capture_default_str();
  const std::function<void()> check_sampling = add_sampling_options(sub, a->opt, a->stops);
  sub->add_flag("--chat", a->chat,
                "the prompt is a user's message: written in the model's chat template "
                "(tokenizer_config.json's chat_template) with the assistant's turn opened, as "
                "transformers' apply_chat_template and llama.cpp's chat do");
  sub->add_option("--system", a->system, "with --chat: the system message before the prompt");
  sub->add_option("--chat-template-kwargs", a->template_kwargs,
                  "the chat template's variables as a JSON object, e.g. '{\"enable_thinking\": "
                  "false}' (a conversation's own chat_template_kwargs go over them)");
  sub->add_flag("--messages", a->messages,
                "the prompt is a conversation to answer, in JSON: [{\"role\", \"content\"}, ...] "
                "or a JSONL line of a conversational dataset (its tools and chat_template_kwargs "
                "apply; a prompt-completion line gives its prompt); implies --chat");
  sub->add_flag("--bos", a->bos, "start the prompt with the tokenizer's bos token");
  sub->add_flag("--no-bos", a->no_bos,
                "do not start the prompt with the token the tokenizer puts before every text "
                "(Llama-3's <|begin_of_text|>), as keel's datasets and transformers do");
  sub->add_flag("--no-cache", a->no_cache, "re-run the whole sequence every step (reference)");
  sub->add_flag("--json", a->json, "print one JSON object at the end instead of streaming");
  sub->add_option("--input", a->input,
                  "a JSONL file of prompts ({\"prompt\": ...} lines or conversations, as a "
                  "dataset holds them): a reply to each, written to --output");
  sub->add_option("--output", a->output,
                  "with --input: the JSON lines written, one a prompt (line, prompt, completion, "
                  "reference, exact_match, tokens, stop)");
  sub->add_option("--batch-size", a->batch_size,
                  "with --input: decode this many prompts side by side, each step reading the "
                  "weights once for all of them (default 1; each reply is its prompt's alone, up "
                  "to rounding)")
      ->check(whole_check(1, 4096));
  return {sub, [a, prompt, check_sampling] {
            check_sampling();
            return run_generate(*a, prompt->count() > 0);
          }};
}

}  // namespace keel::cli
