// export_ranks.js — writes js-tiktoken's bundled ranks as tiktoken rank files
// (`base64(bytes) rank` per line, sorted by rank), gzip-compressed, for
// deltafin's tests: tests/text/<name>.tiktoken.gz.
// Usage: node export_ranks.js OUTDIR   (run `npm install --ignore-scripts` first)
"use strict";
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const out = process.argv[2] || path.join(__dirname, "../../tests/text");
for (const name of ["o200k_base", "cl100k_base"]) {
  const r = require(`js-tiktoken/ranks/${name}`);
  // js-tiktoken's compact format: lines "<prefix> <first rank> <b64> <b64> ...",
  // consecutive ranks; the first field is a grouping key it ignores.
  const rows = [];
  for (const line of r.bpe_ranks.split("\n")) {
    if (!line) continue;
    const [, off, ...toks] = line.split(" ");
    const base = parseInt(off, 10);
    toks.forEach((t, i) => rows.push([base + i, t]));
  }
  rows.sort((a, b) => a[0] - b[0]);
  const text = rows.map(([rank, t]) => `${t} ${rank}`).join("\n") + "\n";
  const gz = zlib.gzipSync(Buffer.from(text), { level: 9 });
  fs.writeFileSync(path.join(out, `${name}.tiktoken.gz`), gz);
  console.log(`${name}: ${rows.length} ranks, ${text.length} bytes, ${gz.length} gzipped`);
}
