#!/usr/bin/env python3
"""Writes nfc_cases.json: texts and their NFC by JavaScript's String.prototype.normalize (ICU), an
implementation independent of keel's (keel/data/unicode_nfc.cpp), for test_unicode_nfc.cpp.
Python picks the texts from the code points assigned in its Unicode version (that of keel's
tables, scripts/gen_unicode_nfc.py: ICU's newer marks are not in them), node normalizes them.
Every assigned code point of the blocks that hold canonical decompositions or combining marks, 64
to a text, each text also reversed (its marks then out of order); seeded random mixes of letters,
marks, Hangul jamo and syllables, singletons and composition exclusions.

    /usr/bin/python3 gen_nfc_cases.py
"""
import json
import pathlib
import random
import subprocess
import unicodedata

HERE = pathlib.Path(__file__).resolve().parent
BLOCKS = [(0xA0, 0x33FF), (0xA600, 0xABFF), (0xF900, 0xFB4F), (0xFE20, 0xFE2F), (0x10780, 0x107FF),
          (0x11000, 0x11FFF), (0x1D100, 0x1D1FF), (0x1E000, 0x1E8FF), (0x2F800, 0x2FA1F)]
POOL = (list(range(0x41, 0x7B)) + list(range(0x300, 0x370)) + list(range(0x1100, 0x1113)) +
        list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3)) +
        [0xAC00, 0xAC01, 0xD7A3, 0x212B, 0x2126, 0x1E0A, 0x0F73, 0x0F71, 0x0F72, 0x0F74, 0x0CC6, 0x0CC2,
         0x0CD5, 0x0B47, 0x0B3E, 0x0B57, 0x3099, 0x309A, 0x304B, 0x30CF, 0x1D15E, 0x1D165, 0x1D16E,
         0x05B4, 0x05BC, 0x0591, 0x0626, 0x0654, 0x0627, 0x0958, 0x0915, 0x093C, 0xFB1D, 0x20])


def main():
    texts = []
    for lo, hi in BLOCKS:
        cps = [cp for cp in range(lo, hi + 1) if unicodedata.category(chr(cp)) != "Cn"]
        for i in range(0, len(cps), 64):
            chunk = "".join(map(chr, cps[i:i + 64]))
            texts += [chunk, chunk[::-1]]
    rng = random.Random(12345)
    for _ in range(3000):
        texts.append("".join(chr(rng.choice(POOL)) for _ in range(rng.randint(1, 8))))
    out = subprocess.run(
        ["node", "-e", "const t = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
         "process.stdout.write(JSON.stringify({unicode: process.versions.unicode,"
         " nfc: t.map((s) => s.normalize('NFC'))}));"],
        input=json.dumps(texts), capture_output=True, text=True, check=True)
    icu = json.loads(out.stdout)
    for text, want in zip(texts, icu["nfc"]):  # two implementations, one answer
        assert unicodedata.normalize("NFC", text) == want, [hex(ord(c)) for c in text]
    path = HERE / "nfc_cases.json"
    path.write_text(json.dumps({"unicode": unicodedata.unidata_version, "icu_unicode": icu["unicode"],
                                "cases": [[t, w] for t, w in zip(texts, icu["nfc"])]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    print(f"wrote {path}: {len(texts)} texts, Unicode {unicodedata.unidata_version}, "
          f"ICU's {icu['unicode']}")


if __name__ == "__main__":
    main()
