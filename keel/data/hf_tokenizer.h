// HF tokenizer.json BPE: byte-level (GPT-2, Llama-3/3.1, Qwen2, Phi-4 style files) and
// SentencePiece-style (Llama-2, Mistral, TinyLlama, Gemma style files).
#pragma once
#include <memory>
#include <string>

#include "keel/data/bpe.h"

namespace keel::data {

// Loads `path` (a tokenizer.json file, or a directory holding one). Supported, as HF tokenizers
// runs them:
//   model: type "BPE" with vocab and merges ("a b" strings or ["a", "b"] pairs), ignore_merges,
//     byte_fallback, unk_token and fuse_unk (SentencePiece-style);
//   normalizer: null, or Prepend("▁") and Replace(" ", "▁") (Llama-2's), or the Replace alone
//     (Gemma's);
//   pre_tokenizer: ByteLevel (add_prefix_space, use_regex), Split (Regex or String pattern,
//     behavior Isolated or Removed, invert), or a Sequence of them with ByteLevel last; or
//     Metaspace (prepend_scheme, split false); in a SentencePiece-style file only Gemma's
//     Split(" "), which finds no space after its normalizer;
//   decoder: ByteLevel (or null); SentencePiece-style: Replace("▁", " "), ByteFallback, Fuse,
//     Strip(" ", n, 0), Metaspace;
//   added_tokens (special or not, lstrip/rstrip/single_word), matched before pre-tokenization.
// Anything else (WordPiece/Unigram models, other normalizers, Metaspace split true, BPE dropout)
// is an Error naming the file and the field.
// bos/eos/pad: from tokenizer_config.json beside the file when it exists (bos_token, eos_token,
// pad_token), else bos from the post_processor's template and "<|endoftext|>" as bos and eos
// when the vocabulary has it; -1 when unknown. Llama-3.1 has no pad token (pad_id() == -1).
// `key`: the setting or flag that named the file (in errors).
std::unique_ptr<BpeTokenizer> load_hf_tokenizer(const std::string& path,
                                                const std::string& key = "data.tokenizer");

}  // namespace keel::data
