#include "keel/data/text_stream.h"

#include <algorithm>

namespace keel::data {

TextStream::TextStream(const Tokenizer& tok, std::vector<std::string> stops)
    : tok_(tok), stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return "";
  ids_.push_back(id);
  full_ = tok_.decode(ids_);
  // The earliest stop string ends the text.
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, full_.find(s));
  if (cut != std::string::npos) {
    full_.resize(cut);
    stopped_ = true;
  }
  // Final: everything but a tail that is a proper prefix of some stop string.
  size_t ready = full_.size();
  if (!stopped_)
    for (const std::string& s : stops_)
      for (size_t n = std::min(s.size() - 1, full_.size()); n > 0; --n)
        if (full_.compare(full_.size() - n, n, s, 0, n) == 0) {
          ready = std::min(ready, full_.size() - n);
          break;
        }
  // Decoding more tokens may rewrite the tail only in ways that keep what was emitted (byte-level
  // tokenizers concatenate); emit past what was already emitted.
  if (ready <= text_.size() || full_.compare(0, text_.size(), text_) != 0) return "";
  std::string out = full_.substr(text_.size(), ready - text_.size());
  text_ += out;
  return out;
}

std::string TextStream::finish() {
  if (full_.size() <= text_.size() || full_.compare(0, text_.size(), text_) != 0) return "";
  std::string out = full_.substr(text_.size());
  text_ += out;
  return out;
}

}  // namespace keel::data
