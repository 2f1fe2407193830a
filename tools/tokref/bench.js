// bench.js — js-tiktoken throughput on a text file: node bench.js FILE o200k_base|cl100k_base
// Prints "js-tiktoken ENC: N bytes -> T tokens in S s: X MB/s" (encoding only,
// after one warm-up pass over the first 64 KB).
"use strict";
const fs = require("fs");
const { Tiktoken } = require("js-tiktoken/lite");
const [file, name] = process.argv.slice(2);
const text = fs.readFileSync(file, "utf8");
const bytes = Buffer.byteLength(text);
const enc = new Tiktoken(require(`js-tiktoken/ranks/${name}`));
enc.encode(text.slice(0, 65536), [], []);
const t0 = process.hrtime.bigint();
const ids = enc.encode(text, [], []);
const s = Number(process.hrtime.bigint() - t0) / 1e9;
console.log(`js-tiktoken ${name}: ${bytes} bytes -> ${ids.length} tokens in ${s.toFixed(3)} s: ${(bytes / s / 1e6).toFixed(2)} MB/s`);
