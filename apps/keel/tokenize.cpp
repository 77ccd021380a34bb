// `keel tokenize [TEXT] --tokenizer SPEC [--pieces] [--json]`: the ids (or the vocabulary's pieces)
// of a text under any tokenizer `data.tokenizer` accepts (byte, gpt2:DIR, hf:PATH, PATH);
// `--decode` turns ids back into text. The text comes from the argument, --file or stdin.
// `--output FILE` writes the ids as an llm.c token file instead (data.task = "tokens" trains on
// it as on the text packed: the same rows, mapped instead of held). `--chat` reads a conversation
// and shows it as the model trains on it: its chat template's text, tokens and targets.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/keel/commands.h"
#include "apps/keel/flags.h"
#include "apps/keel/input_text.h"
#include "keel/data/chat.h"
#include "keel/data/text_pieces.h"
#include "keel/data/token_file.h"
#include "keel/data/tokenizer_base.h"
#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::cli {

namespace {
struct TokenizeArgs {
  std::string tokenizer = "byte", text, file, output, chat_date;
  bool decode = false, pieces = false, json = false, chat = false;
};

// Ids written as "1 2 3", "1,2,3", "1, 2, 3" or a JSON array "[1, 2, 3]": whitespace and commas
// separate them. Each mistake names its position (counted from 0, as decoding's "cannot decode
// id N at position P" does): "1,,2" and a trailing comma were read as "1 2" without a word, so a
// list with an id lost in editing decoded to other text. No ids at all returns an empty list
// (the caller says where the input came from).
std::vector<int32_t> parse_ids(std::string s) {
  const auto trim = [](std::string& t) {
    const size_t b = t.find_first_not_of(" \t\r\n"), e = t.find_last_not_of(" \t\r\n");
    t = b == std::string::npos ? "" : t.substr(b, e - b + 1);
  };
  trim(s);
  // A JSON array. Text after its ']' ("[72, 105],") was blamed on '[72', the array's first word.
  if (const size_t close = s.rfind(']');
      s.starts_with('[') && close != std::string::npos && close + 1 < s.size())
    throw Error("tokenize --decode: '" + s.substr(close + 1) +
                    "' after the list's closing ']': drop it (e.g. \"[72, 105]\")",
                Error::kUsage);
  if (s.starts_with('[') && s.ends_with(']')) s = s.substr(1, s.size() - 2);
  std::vector<std::string> fields;  // the text between the commas
  for (size_t from = 0;;) {
    const size_t comma = s.find(',', from);
    fields.push_back(s.substr(from, comma - from));
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  std::vector<int32_t> ids;
  std::string empty_at;  // the first comma with no id before or after it
  for (size_t f = 0; f < fields.size(); ++f) {
    std::istringstream in(fields[f]);
    std::string word;
    bool any = false;
    while (in >> word) {
      any = true;
      const std::string at = "at position " + std::to_string(ids.size());
      const size_t sign = word[0] == '-' ? 1 : 0;
      if (word.size() == sign || word.find_first_not_of("0123456789", sign) != std::string::npos)
        throw Error("tokenize --decode: '" + word + "' is not a token id (" + at +
                        "); give integers separated by spaces or commas "
                        "(e.g. \"72 105\" or \"[72, 105]\")",
                    Error::kUsage);
      long long v = 0;
      try {
        v = std::stoll(word);
      } catch (const std::out_of_range&) {
        v = word[0] == '-' ? LLONG_MIN : LLONG_MAX;  // beyond int64: beyond every vocabulary too
      }
      // A typed negative id got the tokenizer's "produced by a model with another vocab_size?".
      if (v < 0)
        throw Error("tokenize --decode: '" + word + "' is not a token id (" + at +
                        "): token ids are whole numbers >= 0",
                    Error::kUsage);
      if (v > INT32_MAX)
        throw Error("tokenize --decode: '" + word + "' is outside every vocabulary (" + at +
                        "; token ids are below 2^31)",
                    Error::kUsage);
      ids.push_back(static_cast<int32_t>(v));
    }
    if (!any && fields.size() > 1 && empty_at.empty()) {
      const std::string at = std::to_string(ids.size());
      empty_at = f == 0 ? "a comma before the first id: drop it"
                 : f + 1 == fields.size()
                     ? "a comma after the last id (position " + std::to_string(ids.size() - 1) +
                           ") with no id after it: drop it"
                     : "no id between two commas at position " + at +
                           ": give one id between each two commas (e.g. "
                           "\"1,2\"), or drop one comma";
    }
  }
  if (!ids.empty() && !empty_at.empty())
    throw Error("tokenize --decode: " + empty_at, Error::kUsage);
  return ids;
}

// JSON text of `j`; bytes that are not UTF-8 (a byte token >= 0x80 alone) become U+FFFD.
std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Where the text came from, for messages: "the argument", "stdin" or "--file F".
std::string input_name(const TokenizeArgs& a, bool has_text) {
  return has_text ? "the argument" : a.file.empty() ? "stdin" : "--file " + a.file;
}

// --output: the text read and encoded 1 MiB at a time (data::encode_in_pieces: the ids of
// encoding it whole), written as it comes; a corpus larger than memory converts.
int write_token_file(const TokenizeArgs& a, bool has_text) {
  const auto in = open_input_text(has_text, a.text, a.file, "--file");
  // The ids are renamed over --output when whole: over the text itself, the corpus was lost.
  std::error_code ec;
  if (!a.file.empty() && std::filesystem::equivalent(a.file, a.output, ec))
    throw Error("--output " + a.output +
                    " is the --file it reads: writing it would replace the "
                    "text with its token ids; give another path (e.g. " +
                    a.file + ".bin)",
                Error::kUsage);
  const auto tok = data::load_tokenizer(a.tokenizer, "--tokenizer");
  data::TokenFileWriter out(a.output, tok->vocab_size());
  size_t piece = data::kTextPieceBytes;
  if (const char* p = std::getenv("KEEL_TEST_TOKENIZE_PIECE_BYTES"))  // tests: many pieces
    piece = std::max<size_t>(1, std::strtoull(p, nullptr, 10));
  // The stream starts as a packed text file's does (Llama-3's <|begin_of_text|>): data.task =
  // "tokens" on this file trains on the rows data.task = "text" gives the text.
  if (const auto prefix = static_cast<int32_t>(tok->prefix_id()); prefix >= 0)
    out.append(std::span<const int32_t>(&prefix, 1));
  data::encode_in_pieces(*tok, *in, piece, [&](std::span<const int32_t> ids) { out.append(ids); });
  // An empty text made a 0-token file, exit 0, that keel train and keel eval then refused.
  if (out.tokens() < data::kTokenFileMinTokens)
    throw Error("tokenize --output: " + input_name(a, has_text) + " encodes to " +
                    std::to_string(out.tokens()) + (out.tokens() == 1 ? " token" : " tokens") +
                    "; a token file needs at least " + std::to_string(data::kTokenFileMinTokens) +
                    " to train or evaluate on (one to predict the other): give a text with more "
                    "content (nothing was written to " +
                    a.output + ")",
                Error::kUsage);
  out.commit();
  std::fprintf(stderr, "keel tokenize | wrote %lld tokens (%lld bytes) to %s\n",
               static_cast<long long>(out.tokens()), static_cast<long long>(out.bytes()),
               a.output.c_str());
  return 0;
}

// --chat: a conversation (a JSON array of messages, or a JSONL line in any of the conversational
// formats data.task = "jsonl" reads: chat.h) as the model sees it: the chat template's text and
// its tokens, each marked as training marks it (a target: the assistant's reply and the end of its
// turn, or a prompt-completion line's completion). Messages without an assistant message are a
// prompt, rendered with the assistant's turn opened as `generate --chat` prompts.
int run_tokenize_chat(const TokenizeArgs& a, bool has_text) {
  const std::string input = read_input_text(has_text, a.text, a.file, "--file");
  const auto tok = data::load_tokenizer(a.tokenizer, "--tokenizer");
  const data::ChatFormat* chat = tok->chat_format();
  if (!chat)
    throw Error("tokenize --chat: " + data::no_chat_template("the tokenizer " + a.tokenizer),
                Error::kUsage);
  const std::string source = input_name(a, has_text);
  data::Conversation c;
  try {
    c = data::parse_conversation(input, source);
  } catch (const Error& err) {
    throw Error(std::string("tokenize --chat: ") + err.what(), Error::kUsage);
  }
  // What training sees: one example, or one per reply where the template rewrites earlier turns
  // (data::conversation_examples). A conversation without a reply is the prompt generate gives.
  std::vector<data::ConversationExample> examples;
  try {
    const bool has_reply =
        c.prompt_size > 0 || std::any_of(c.messages.begin(), c.messages.end(),
                                         [](const auto& m) { return m["role"] == "assistant"; });
    if (has_reply) {
      examples = data::conversation_examples(*tok, c, a.chat_date);
    } else {
      data::ConversationExample& p = examples.emplace_back();
      p.text = data::render_chat(*chat, c.messages, /*add_generation_prompt=*/true, a.chat_date,
                                 c.variables);
      p.example.tokens = tok->encode(p.text);
      p.example.target.assign(p.example.tokens.size(), 0);
    }
  } catch (const Error& err) {  // the template's refusal
    throw Error("tokenize --chat: " + source + ": " + err.what(), Error::kUsage);
  }
  auto pieces_of = [&](const data::Example& e) {
    std::vector<std::string> pieces;
    for (int32_t id : e.tokens) pieces.push_back(tok->id_to_token(id));
    return pieces;
  };
  auto to_json = [&](const data::ConversationExample& x) {
    return nlohmann::json{{"text", x.text},
                          {"ids", x.example.tokens},
                          {"pieces", pieces_of(x.example)},
                          {"targets", x.example.target},
                          {"count", x.example.tokens.size()}};
  };
  if (a.json) {
    // One example as an object; several as {"examples": [...]}.
    nlohmann::json all = nlohmann::json::array();
    for (const data::ConversationExample& x : examples) all.push_back(to_json(x));
    std::printf("%s\n", dump(all.size() == 1 ? all[0] : nlohmann::json{{"examples", all}}).c_str());
    return 0;
  }
  for (size_t k = 0; k < examples.size(); ++k) {
    const data::ConversationExample& x = examples[k];
    if (examples.size() > 1)
      std::printf(
          "%s--- example %zu of %zu (the chat template renders earlier turns otherwise "
          "once later ones follow: each reply is trained in the text that prompts it)\n",
          k > 0 && !a.pieces ? "\n" : "", k + 1, examples.size());
    if (a.pieces) {
      // "+" marks a target, as the loss sees it.
      const std::vector<std::string> pieces = pieces_of(x.example);
      for (size_t t = 0; t < pieces.size(); ++t)
        std::printf("%c %s\n", x.example.target[t] ? '+' : ' ', pieces[t].c_str());
    } else {
      std::fwrite(x.text.data(), 1, x.text.size(), stdout);
      if (!x.text.ends_with('\n')) std::fputc('\n', stdout);
    }
  }
  return 0;
}

int run_tokenize(const TokenizeArgs& a, bool has_text) {
  if (!a.output.empty()) return write_token_file(a, has_text);
  if (a.chat) return run_tokenize_chat(a, has_text);
  const std::string input = read_input_text(has_text, a.text, a.file, "--file");
  const auto tok = data::load_tokenizer(a.tokenizer, "--tokenizer");
  const std::vector<int32_t> ids = a.decode ? parse_ids(input) : tok->encode(input);
  // `--decode ""` printed nothing and exited 0, as if the ids had decoded to no text.
  if (a.decode && ids.empty())
    throw Error(
        "tokenize --decode: " + input_name(a, has_text) +
            " holds no token ids; --decode expects a list of token ids, separated by spaces or "
            "commas (e.g. --decode \"72 105\")",
        Error::kUsage);
  // The ids to decode are the user's: one the tokenizer has no token for is bad input, like 'x7'.
  // Decoded before the pieces are looked up, so that its error names the id's position.
  std::string text;
  if (a.decode) {
    try {
      text = tok->decode(ids);
    } catch (const Error& e) {
      throw Error("tokenize --decode: " + std::string(e.what()), Error::kUsage);
    }
  }
  std::vector<std::string> pieces;
  if (a.pieces || a.json)
    for (int32_t id : ids) pieces.push_back(tok->id_to_token(id));
  if (a.decode) {
    if (a.json)
      std::printf("%s\n", dump({{"text", text}, {"ids", ids}, {"pieces", pieces}}).c_str());
    else
      std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (a.json) {
    std::printf("%s\n", dump({{"ids", ids}, {"pieces", pieces}, {"count", ids.size()}}).c_str());
    return 0;
  }
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += a.pieces ? "\n" : " ";
    out += a.pieces ? pieces[i] : std::to_string(ids[i]);
  }
  std::printf("%s\n", out.c_str());
  return 0;
}
}  // namespace

Command add_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* sub = app.add_subcommand(
      "tokenize", "Encode text to token ids (or pieces) with a tokenizer, or decode ids to text");
  CLI::Option* text = sub->add_option("TEXT", a->text,
                                      "the text (or ids with --decode); "
                                      "default: --file or stdin");
  sub->add_option("--tokenizer", a->tokenizer,
                  "byte | gpt2:DIR | hf:PATH | PATH (as data.tokenizer)")
      ->capture_default_str();
  sub->add_option("--file", a->file, "read the text from this file");
  CLI::Option* decode =
      sub->add_flag("--decode", a->decode, "the input is token ids: print their text");
  // Decoding prints text: --pieces was ignored beside it.
  sub->add_flag("--pieces", a->pieces, "print the vocabulary's spelling of each token, one a line")
      ->excludes(decode);
  sub->add_flag("--json", a->json, "print one JSON object (ids, pieces, count / text)");
  CLI::Option* chat =
      sub->add_flag(
             "--chat", a->chat,
             "the input is a conversation (JSON messages, or a JSONL line's {\"messages\"}): "
             "print the chat template's text (--json: its ids and which are targets; "
             "--pieces: \"+\" before each target)")
          ->excludes(decode);
  sub->add_option("--chat-date", a->chat_date,
                  "with --chat: the day the chat template's strftime_now writes, YYYY-MM-DD "
                  "(data.chat_date; default: none, as training without it)")
      ->check(chat_date_check())
      ->needs(chat);
  sub->add_option("--output", a->output,
                  "write the ids as an llm.c token file (for data.task = \"tokens\")")
      ->excludes("--decode")
      ->excludes("--pieces")
      ->excludes("--json")
      ->excludes("--chat");
  return {sub, [a, text] { return run_tokenize(*a, text->count() > 0); }};
}

}  // namespace keel::cli
