// JSONL datasets (keel/data/dataset): {"text"}, {"prompt", "completion"} and conversation lines
// (chat.h: messages, prompt-completion of messages, ShareGPT's, with tools and template
// arguments). Each input is read with the byte tokenizer and with the tiny Llama-style one given a
// chat template of Llama-3's shape that prints the tools and a template argument, and that
// rewrites every reply but the last (as Qwen3's drops their reasoning): a conversation of several
// replies is an example a reply.
#include <filesystem>
#include <fstream>

#include "keel/data/dataset.h"
#include "keel/data/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

std::unique_ptr<keel::data::Tokenizer> chat_tokenizer() {
  const std::string dir = keel::fuzz::work_dir() + "/chat-tokenizer";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny/llama_style/tokenizer.json",
      dir + "/tokenizer.json", std::filesystem::copy_options::overwrite_existing);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<|eot|>",
    "eos_token": "<|eot|>", "chat_template": "{{ bos_token }}{% if tools is not none %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% if think is defined and think %}think{% endif %}{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' and not loop.last %}[earlier reply]{% else %}{{ m['content'] | trim }}{% endif %}<|eot|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"})";
  return keel::data::load_tokenizer("hf:" + dir);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("train.jsonl", data, size);
  static const keel::data::ByteTokenizer tok;
  static const auto chat = chat_tokenizer();
  keel::fuzz::expect_keel_errors_only([&] { keel::data::load_jsonl_dataset(path, tok, 32); });
  keel::fuzz::expect_keel_errors_only([&] { keel::data::load_jsonl_dataset(path, *chat, 32); });
  return 0;
}
