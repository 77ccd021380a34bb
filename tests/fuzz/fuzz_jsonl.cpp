// JSONL datasets (keel/data/dataset): {"text"}, {"prompt", "completion"} and conversation lines
// (chat.h: messages, prompt-completion of messages, ShareGPT's, with tools and template
// arguments). Each input is read with the byte tokenizer and with the tiny Llama-style one given a
// chat template of Llama-3's shape that prints the tools and a template argument, and that
// rewrites every reply but the last (as Qwen3's drops their reasoning): a conversation of several
// replies is an example a reply. Read with the byte tokenizer, the examples are also packed into
// rows (data.pack) and collated.
#include <filesystem>
#include <fstream>

#include "keel/data/dataset.h"
#include "keel/data/loader.h"
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
  // Packed (data.pack): every row fits seq_len unless it is one example, holds every example once,
  // and collates (position_ids restarting at each example, no label across an end).
  keel::fuzz::expect_keel_errors_only([&] {
    auto packed = keel::data::load_dataset("jsonl", path, "data.path", tok, 12, /*pack=*/true);
    int64_t examples = 0;
    std::vector<int64_t> all;
    for (int64_t i = 0; i < packed->size(); ++i) {
      const keel::data::ExampleView row = packed->get(i);
      const size_t held = row.example_starts.size() - 1;
      if (held == 0 || (held > 1 && row.size() > 12)) __builtin_trap();
      examples += static_cast<int64_t>(held);
      all.push_back(i);
    }
    if (examples != packed->examples()) __builtin_trap();
    if (!all.empty()) keel::data::collate(*packed, all, 12, 0);
  });
  return 0;
}
