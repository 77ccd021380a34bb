// Chat templates (keel/data/chat_template): the input is the Jinja text of a tokenizer_config.json
// "chat_template", parsed and rendered with a conversation as apply_chat_template's variables.
#include <nlohmann/json.hpp>

#include "keel/data/chat_template.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::json context = nlohmann::json::parse(R"({
    "messages": [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": " héllo 日本 "},
                 {"role": "assistant", "content": "hi", "tool_calls": [
                   {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})");
  const std::string source(reinterpret_cast<const char*>(data), size);
  keel::fuzz::expect_keel_errors_only([&] {
    const keel::data::ChatTemplate tmpl(source, "chat_template");
    tmpl.render(context, "2024-07-26");
  });
  return 0;
}
