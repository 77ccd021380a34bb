// Tokenizer: the interface every tokenizer of the data layer implements — the dependency-free
// ByteTokenizer (tokenizer.h), GPT-2's byte-level BPE (gpt2_tokenizer.h) and HF tokenizer.json BPE
// (hf_tokenizer.h) — and load_tokenizer(), which builds one from the config's `data.tokenizer`.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data {

struct ChatFormat;  // chat.h

class Tokenizer {
 public:
  virtual ~Tokenizer();

  // Token ids of `text` (any bytes). No bos/eos is added: callers add the specials they want.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Token ids of `text` as it is encoded where it continues an earlier text (a completion after
  // its prompt, a reply after the conversation's header): what the tokenizer puts before a text
  // of its own is left out (SentencePiece's "▁", a ByteLevel add_prefix_space), as a text
  // encoded whole gives its middle. Equal to encode() for the tokenizers that put nothing there.
  virtual std::vector<int32_t> encode_continuation(std::string_view text) const {
    return encode(text);
  }
  // The text of `ids`; special tokens are skipped (HF's skip_special_tokens=True), so that
  // decode(encode(s)) == s for text without special tokens. An id that names no token is an Error
  // naming the id and its position.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  // One past the largest id (the model's embedding rows must be at least this many).
  virtual int64_t vocab_size() const = 0;
  // Ids of the special tokens, -1 when the tokenizer has none (GPT-2 and Llama-3.1 have no pad).
  virtual int64_t pad_id() const = 0;
  virtual int64_t bos_id() const = 0;
  virtual int64_t eos_id() const = 0;
  // Whether `id` is a special token (skipped by decode; never produced from ordinary text).
  virtual bool is_special(int64_t id) const = 0;
  // The special token the tokenizer's own convention puts before every text, -1 for none: an HF
  // tokenizer.json whose post-processor template starts with one (Llama-3's <|begin_of_text|>,
  // which transformers' tokenizer(text) adds and Llama-3 was pretrained behind). GPT-2's and
  // keel's byte tokenizer add none.
  virtual int64_t prefix_id() const { return -1; }
  // The model's chat template and its variables (an HF tokenizer's tokenizer_config.json
  // "chat_template", or chat_template.jinja beside it); nullptr when it has none.
  virtual const ChatFormat* chat_format() const { return nullptr; }

  // The id of a token given in the vocabulary's spelling (byte-level BPE: "Ġthe" for " the";
  // added tokens: their content, "<|endoftext|>"); -1 when it is not a token.
  virtual int64_t token_to_id(std::string_view token) const = 0;
  // The vocabulary's spelling of `id`; "" for an id in [0, vocab_size()) that names no token (a
  // hole in the vocabulary). An id outside [0, vocab_size()) is an Error.
  virtual std::string id_to_token(int64_t id) const = 0;
};

// Whether using `pad_id` as the padding id would make padding indistinguishable from text: it
// names a real token — an ordinary vocabulary token (Llama-3.1's id 0 is "!"), including a pad
// token the tokenizer declares but text can produce, or the bos/eos token, whose masking would stop
// the model from learning to start or stop (pad = eos). Not a collision: a negative id (no pad
// configured), an id at or past vocab_size() (a new row added for padding), a hole in the ids, and
// any other special token — a dedicated pad such as ByteTokenizer's, or one of Llama-3's
// <|reserved_special_token_N|> — which ordinary text never produces.
bool pad_collides(const Tokenizer& tok, int64_t pad_id);

// encode(text) behind tok.prefix_id() when it has one: a text as the tokenizer's convention
// starts it (datasets, eval and generate's prompt).
std::vector<int32_t> encode_with_prefix(const Tokenizer& tok, std::string_view text);

// Builds the tokenizer named by `spec` (the config's data.tokenizer):
//   "byte"                 ByteTokenizer;
//   "gpt2:DIR"             GPT-2 byte-level BPE from DIR/encoder.json (or vocab.json) and
//                          DIR/vocab.bpe (or merges.txt);
//   "hf:PATH"              HF tokenizer.json BPE; PATH is the file or a directory holding it;
//   PATH                   without a prefix: a .json file is an HF tokenizer.json; a directory
//                          holding tokenizer.json is HF, one holding vocab.bpe/merges.txt is GPT-2.
// Errors (kind kUsage for a spec that names nothing usable) name the spec and the fix.
// `key`: the setting or flag the spec came from (--tokenizer for the commands' flag).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec,
                                          const std::string& key = "data.tokenizer");

}  // namespace keel::data
