// Streaming the text of generated tokens: each new token yields the bytes that are now final,
// holding back any tail that could still become a stop string, and stopping at the first stop
// string (which is not printed). Decoding the whole sequence each time keeps multi-token
// characters intact (a UTF-8 character split over byte tokens appears once it is complete).
//
// A stop string may begin in the prompt and end in the new text ("\n\n" after a prompt ending in
// "\n", the model's first token "\n"): it stops there, and the part of it that is new is not
// emitted. HF transformers' StopStringCriteria does the same (it matches the end of the whole
// sequence, prompt included); llama.cpp's server searches the generated text alone, which let a
// text continue past a stop string the user can see in prompt + output. One wholly in the prompt
// never stops: a match must end in the new text.
#pragma once
#include <string>
#include <vector>

#include "keel/data/tokenizer_base.h"

namespace keel::data {

class TextStream {
 public:
  // `prompt`: the text the generated tokens continue (only its last bytes are kept).
  TextStream(const Tokenizer& tok, std::vector<std::string> stops, const std::string& prompt = "");
  // Adds a token; returns the text that became final (possibly empty).
  std::string push(int32_t id);
  // The text still held back (call at the end; nothing when a stop string was found).
  std::string finish();
  bool stopped() const { return stopped_; }          // a stop string appeared
  const std::string& text() const { return text_; }  // everything emitted so far

 private:
  const Tokenizer& tok_;
  std::vector<std::string> stops_;
  std::vector<int32_t> ids_;
  std::string text_;  // emitted
  std::string full_;  // decoded so far (stopped: cut at the stop string)
  std::string tail_;  // the prompt's last bytes, one fewer than the longest stop string
  bool stopped_ = false;
};

}  // namespace keel::data
