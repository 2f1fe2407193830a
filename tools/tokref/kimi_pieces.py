#!/usr/bin/env python3
"""kimi_pieces.py — reference pre-tokenisation pieces for the Kimi pattern.

Applies Moonshot's pattern exactly as tokenization_kimi.py writes it (class
intersection `&&`, which Python's `regex` module supports in VERSION1 mode,
as tiktoken's fancy-regex does) to every string of tests/text/corpus.json
plus tests/text/kimi_extra.json, and writes tests/text/ref_kimi_pieces.json
= [{"text": ..., "pieces": [...]}]. deltafin compiles a PCRE2 translation
((?:(?!\\p{Han})[X]) for [X&&[^\\p{Han}]]); this file checks the translation.
Usage: python3 kimi_pieces.py [DIR]   (needs `pip install regex`)

Script: PCRE2 (10.40+) and Rust's regex crate (to which tiktoken's
fancy-regex hands plain classes) read a bare script name such as \\p{Han} as
Script_Extensions, so "。" (U+3002, scx Han) is Han. Python's regex module
reads it as Script, so this reference spells \\p{scx=Han}.
"""
import json
import os
import sys

import regex

PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../tests/text")
texts = json.load(open(os.path.join(d, "corpus.json"), encoding="utf-8"))
texts += json.load(open(os.path.join(d, "kimi_extra.json"), encoding="utf-8"))
rx = regex.compile(PAT.replace(r"\p{Han}", r"\p{scx=Han}"), regex.V1)
rows = []
for t in texts:
    pieces = [m.group(0) for m in rx.finditer(t)]
    assert "".join(pieces) == t, t  # the pattern covers every character
    rows.append({"text": t, "pieces": pieces})
with open(os.path.join(d, "ref_kimi_pieces.json"), "w", encoding="utf-8") as f:
    f.write("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n")
print(f"{len(rows)} strings")
