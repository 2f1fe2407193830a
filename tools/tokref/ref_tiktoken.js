// ref_tiktoken.js — reference token ids from js-tiktoken for every string of
// tests/text/corpus.json, with o200k_base and cl100k_base; writes
// tests/text/ref_<name>.json = [{"text": ..., "ids": [...]}, ...].
// Special-token spellings in the corpus are encoded as ordinary text
// (disallowedSpecial = [] here), which is what deltafin does without
// DF_TOK_SPECIAL.
"use strict";
const fs = require("fs");
const path = require("path");
const { Tiktoken } = require("js-tiktoken/lite");
const dir = process.argv[2] || path.join(__dirname, "../../tests/text");
const corpus = JSON.parse(fs.readFileSync(path.join(dir, "corpus.json"), "utf8"));
for (const name of ["o200k_base", "cl100k_base"]) {
  const enc = new Tiktoken(require(`js-tiktoken/ranks/${name}`));
  const rows = corpus.map((text) => ({ text, ids: enc.encode(text, [], []) }));
  // one special-token case: allowed specials are recognised
  const sp = "a<|endoftext|>b";
  rows.push({ text: sp, ids: enc.encode(sp, "all"), special: true });
  fs.writeFileSync(path.join(dir, `ref_${name}.json`),
    "[\n" + rows.map((r) => JSON.stringify(r)).join(",\n") + "\n]\n");
  console.log(`${name}: ${rows.length} strings`);
}
