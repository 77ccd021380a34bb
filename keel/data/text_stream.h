// Streaming the text of generated tokens: each new token yields the bytes that are now final,
// holding back any tail that could still become a stop string, and stopping at the first stop
// string (which is not printed). Decoding the whole sequence each time keeps multi-token
// characters intact (a UTF-8 character split over byte tokens appears once it is complete).
#pragma once
#include <string>
#include <vector>

#include "keel/data/tokenizer_base.h"

namespace keel::data {

class TextStream {
 public:
  TextStream(const Tokenizer& tok, std::vector<std::string> stops);
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
  bool stopped_ = false;
};

}  // namespace keel::data
