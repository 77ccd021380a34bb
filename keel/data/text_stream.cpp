#include "keel/data/text_stream.h"

#include <algorithm>

namespace keel::data {

TextStream::TextStream(const Tokenizer& tok, std::vector<std::string> stops,
                       const std::string& prompt)
    : tok_(tok), stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  size_t longest = 0;
  for (const std::string& s : stops_) longest = std::max(longest, s.size());
  const size_t keep = longest > 0 ? std::min(longest - 1, prompt.size()) : 0;
  tail_ = prompt.substr(prompt.size() - keep);
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return "";
  ids_.push_back(id);
  full_ = tok_.decode(ids_);
  // Each stop string is searched in the text after the prompt's last |s| - 1 bytes, where an
  // occurrence cannot lie in the prompt alone. The earliest ends the text; one that begins in the
  // prompt leaves none of the new text.
  size_t first = std::string::npos;  // where it begins, counted from tail_'s start
  for (const std::string& s : stops_) {
    const size_t k = std::min(s.size() - 1, tail_.size());
    const size_t at = (tail_.substr(tail_.size() - k) + full_).find(s);
    if (at != std::string::npos) first = std::min(first, at + tail_.size() - k);
  }
  if (first != std::string::npos) {
    full_.resize(first > tail_.size() ? first - tail_.size() : 0);
    stopped_ = true;
  }
  // Final: everything but a tail that is a proper prefix of some stop string (which may begin in
  // the prompt).
  size_t ready = full_.size();
  if (!stopped_)
    for (const std::string& s : stops_) {
      const std::string seen =
          tail_.substr(tail_.size() - std::min(s.size() - 1, tail_.size())) + full_;
      for (size_t n = std::min(s.size() - 1, seen.size()); n > 0; --n)
        if (seen.compare(seen.size() - n, n, s, 0, n) == 0) {
          ready = std::min(ready, full_.size() - std::min(n, full_.size()));
          break;
        }
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
