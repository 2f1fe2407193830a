#!/usr/bin/env python3
"""make_seeds.py - writes the committed seed corpora of tests/fuzz/corpus/
and the dictionaries tests/fuzz/NAME.dict.

Run from the repository root: python3 tests/fuzz/make_seeds.py. Seeds come
from the committed fixtures (configs, safetensors headers and indexes, the
tokenizer references) and from samples written here; each stays small.
Inputs that once crashed a harness are kept beside them as regress-* files
(this script never touches those). Dictionaries: JSON's tokens plus the
names the parser looks for (string literals of its source).
"""
import base64
import json
import os
import re
import struct

SEP = b"\n--8<--\n"
OUT = "tests/fuzz/corpus"
FIX = "tests/fixtures"


def put(harness, name, data):
    d = os.path.join(OUT, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


JSON_TOKENS = ["{", "}", "[", "]", ":", ",", "\"", "null", "true", "false", "0", "-1", "1e308",
               "2147483648", "9223372036854775808", "\\u0000", "\\ud800", "--8<--"]


def dict_entry(t):
    return '"' + "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "\\x%02x" % b
                         for c in t for b in c.encode()) + '"'


def put_dict(harness, tokens, sources=()):
    words = list(tokens)
    for src in sources:
        for w in re.findall(r'"([A-Za-z_][A-Za-z0-9_.]{1,40})"', open(src).read()):
            if w not in words:
                words.append(w)
    with open("tests/fuzz/%s.dict" % harness, "w") as f:
        f.write("# written by make_seeds.py\n")
        for w in words:
            f.write(dict_entry(w) + "\n")


# ---- cli_args: SIZE FZ_SEP TOKENS FZ_SEP CPUS ---------------------------------
put("cli_args", "size_and_tokens", "512M" + SEP.decode() + "1,7,300,2,99,512,3,1000,42")
put("cli_args", "spaces", "1.5TiB" + SEP.decode() + " 7 , 300,\t2")
put("cli_args", "bytes", "4096")
put("cli_args", "max_id", "12GB" + SEP.decode() + "2147483647")
put("cli_args", "bad", "kB" + SEP.decode() + "3,")
put("cli_args", "cpus", "1G" + SEP.decode() + "1,2" + SEP.decode() + "0-1,0")
put("cli_args", "cpus_range", "" + SEP.decode() + "" + SEP.decode() + "0,1-1")
put_dict("cli_args", ["--8<--", "K", "M", "G", "T", "iB", "B", ",", "e", ".", "-", "0x", "nan", "inf", "0-1"])

# ---- chat_parser: [flags][piece sizes] then K3 output -------------------------
K3_OUT = [
    "Let me think about <b> tags.<|close|>think<|sep|><|open|>response<|sep|>Answer: 42 \U0001F916"
    "<|close|>response<|sep|><|close|>message<|sep|>",
    "Need weather.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|><|open|>tools<|sep|>"
    "<|open|>call tool=\"get_weather\" index=\"0\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
    "<|open|>argument key=\"q&quot;\" type=\"object\"<|sep|>{\"b\": 1, \"a\": [1, 2]}<|close|>argument<|sep|>"
    "<|close|>call<|sep|>"
    "<|open|>call tool=\"bad\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|>"
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
    "partial <|clo",
    "caf\u00e9 \u4e2d\u6587<|close|>think<|sep|>gap text<|open|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"x\"",
]
for i, t in enumerate(K3_OUT):
    put("chat_parser", "k3_%d" % i, bytes([1, 7 + i * 9]) + t.encode())
put("chat_parser", "no_think", bytes([0, 0x85]) + K3_OUT[0].split("<|open|>response<|sep|>")[1].encode())
put_dict("chat_parser", ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|close|>think<|sep|>",
                         "<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|open|>tools<|sep|>",
                         "<|close|>tools<|sep|>", "<|close|>message<|sep|>", "<|open|>call", "<|close|>call<|sep|>",
                         "<|open|>argument", "<|close|>argument<|sep|>", "<|open|>json", "<|close|>json<|sep|>",
                         " tool=\"", " key=\"", " type=\"", "&quot;", "&amp;", "\u4e2d", "\U0001F916"])


# ---- config: every fixture's config.json -------------------------------------
for d in sorted(os.listdir(FIX)):
    p = os.path.join(FIX, d, "config.json")
    if os.path.exists(p):
        put("config", d, open(p, "rb").read())
put_dict("config", JSON_TOKENS, ["src/format/config.c", "src/format/config_kimi.c"])


# ---- safetensors: [flags][data size, 3 bytes] INDEX SEP SHARD SEP ... --------
def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return f.read(n), os.path.getsize(path) - 8 - n


def st_input(flags, data_size, index, shards):
    head = bytes([flags]) + struct.pack("<I", data_size)[:3]
    return head + SEP.join([index] + shards)


TINY = {"__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
        "c": {"dtype": "I8", "shape": [0], "data_offsets": [22, 22]},
        "d": {"dtype": "F8_E4M3", "shape": [2, 1], "data_offsets": [22, 24]}}
TINY2 = {"e": {"dtype": "U8", "shape": [5], "data_offsets": [0, 5]},
         "f": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}
tiny = json.dumps(TINY).encode()
tiny2 = json.dumps(TINY2).encode()
index2 = json.dumps({"metadata": {"total_size": 45},
                     "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in TINY if k != "__metadata__"},
                                    **{k: "model-00002-of-00002.safetensors" for k in TINY2}}}).encode()
raw = lambda h, d: struct.pack("<Q", len(h)) + h + bytes(range(d))
put("safetensors", "tiny_index_built", st_input(4, 24, index2, [tiny, tiny2]))
put("safetensors", "tiny_index_raw_mmap", st_input(1, 0, index2, [raw(tiny, 24), raw(tiny2, 16)]))
put("safetensors", "tiny_glob_raw", st_input(2, 0, b"", [raw(tiny, 24)]))
put("safetensors", "tiny_glob_built_mmap", st_input(7, 24, b"", [tiny, tiny2]))
h, d = st_header(FIX + "/formats/quant.safetensors")
qi = json.dumps({"weight_map": {k: "quant.safetensors" for k in json.loads(h) if k != "__metadata__"}}).encode()
put("safetensors", "quant_built", st_input(4, d, qi, [h]))
qraw = open(FIX + "/formats/quant.safetensors", "rb").read()[:8 + len(h) + 512]
put("safetensors", "quant_truncated_glob", st_input(2, 0, b"", [qraw]))
h1, d1 = st_header(FIX + "/dsv3_qlora/model-00001-of-00002.safetensors")
h2, d2 = st_header(FIX + "/dsv3_qlora/model-00002-of-00002.safetensors")
put("safetensors", "dsv3_qlora_built", st_input(4, max(d1, d2), open(FIX + "/dsv3_qlora/model.safetensors.index.json", "rb").read(), [h1, h2]))
put_dict("safetensors", JSON_TOKENS + ["__metadata__", "weight_map", "dtype", "shape", "data_offsets", "F32", "BF16",
                                       "F16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL", "F64",
                                       "F4", "U32", ".safetensors", "../", "/"])


# ---- tiktoken: [flags] RANKS SEP CONFIG SEP TEXT SEP IDS ---------------------
import gzip

TEXTS = [t for t in json.load(open("tests/text/corpus.json")) if len(t.encode()) < 200][:8]
TEXTS += json.load(open("tests/text/kimi_extra.json"))[:4]
IDS = bytes(range(0, 64, 3)) + b"\xff\x00\x01\x01\x00\x01"


def ranks(name, lines):
    with gzip.open("tests/text/%s.tiktoken.gz" % name, "rb") as f:
        return b"".join(f.readline() for _ in range(lines))


CFG = json.dumps({"added_tokens_decoder": {"400": {"content": "<|im_end|>"}, "401": {"content": "<|open|>"},
                                           "402": {"content": "<|close|>"}, "10": {"content": "ignored"}}}).encode()
for i, t in enumerate(TEXTS):
    flags = [0, 1, 2, 4 | 8, 4 | 16, 2 | 8][i % 6]
    r = ranks("o200k_base" if flags & 3 == 1 else "cl100k_base", 400)
    put("tiktoken", "text_%02d" % i, SEP.join([bytes([flags]) + r, CFG, t.encode(), IDS]))
put("tiktoken", "special_spelled", SEP.join([bytes([4 | 8]) + ranks("cl100k_base", 300), CFG,
                                            b"a<|im_end|>b<|open|><|reserved_token_556|>c", IDS]))
put_dict("tiktoken", ["--8<--", " ", "\n", "==", "=", "+", "/", "<|im_end|>", "<|open|>", "<|reserved_token_",
                      "added_tokens_decoder", "content", "{", "}", "\"", ":"])

# ---- tokenizer_json: [flags] TOKENIZER_JSON SEP TEXT SEP IDS -----------------


def bytelevel(b):
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = {}, 0
    for x in range(256):
        if x in keep:
            cs[x] = chr(x)
        else:
            cs[x] = chr(256 + n)
            n += 1
    return "".join(cs[x] for x in b)


vocab = {bytelevel(bytes([b])): b for b in range(256)}
merges = []
for a, b in [(" ", "t"), ("h", "e"), (" t", "he"), ("i", "n"), ("e", "r"), ("a", "n"), (" ", "a"), ("in", "g")]:
    merges.append(bytelevel(a.encode()) + " " + bytelevel(b.encode()))
    vocab[bytelevel((a + b).encode())] = len(vocab)
added = [{"id": len(vocab), "content": "<|endoftext|>", "special": True},
         {"id": len(vocab) + 1, "content": "<\uff5cUser\uff5c>", "special": True}]
vocab["<\uff5cUser\uff5c>"] = len(vocab) + 1
SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"


def tokjson(pre, merges_as_pairs=False, extra=None):
    m = [x.split(" ") for x in merges] if merges_as_pairs else merges
    d = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": pre,
         "decoder": {"type": "ByteLevel"},
         "model": {"type": "BPE", "dropout": None, "vocab": vocab, "merges": m, "ignore_merges": False}}
    if extra:
        d.update(extra)
    return json.dumps(d, ensure_ascii=False).encode()


seq = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
TJ = [tokjson(seq), tokjson({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, True),
      tokjson({"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"String": "\\E."}, "behavior": "Removed"},
          {"type": "ByteLevel", "use_regex": False}]}, extra={"normalizer": {"type": "Sequence", "normalizers": []}})]
for i, t in enumerate(TEXTS[:6]):
    put("tokenizer_json", "text_%02d" % i, SEP.join([bytes([i & 3]) + TJ[i % 3], t.encode(), IDS]))
put("tokenizer_json", "special_spelled", SEP.join([bytes([1]) + TJ[0], "a<|endoftext|> the<\uff5cUser\uff5c>".encode(), IDS]))
put_dict("tokenizer_json", JSON_TOKENS + ["\\u0120", "\\u010a"], ["src/text/tokenizer.c"])


# ---- openai_request: [flags] BODY SEP OUTPUT_TEXT SEP TOOL_CALL ----------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x", "name": "dev"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}],
     "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
     "seed": 7, "stop": ["a", "b"], "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "logit_bias": {"65": -100, "66": 5},
     "reasoning_effort": "low", "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "n": 1,
     "user": "u", "metadata": {"a": "b"}, "store": False, "response_format": {"type": "text"}},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need weather.",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
     "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False, "reasoning_effort": "none"},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "tool_choice": "none", "tools": TOOLS},
]
CMP = [{"prompt": "hi", "max_tokens": 3}, {"prompt": [1, 2, 3], "echo": True, "logprobs": 2, "stream": True},
       {"prompt": ["one"], "suffix": "", "best_of": 1, "stop": "\n", "seed": 1}]
OUTPUT_TEXT = "caf\u00e9 \U0001F916".encode() + b"\xff\xc3"
CALL = b'{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
for i, b in enumerate(CHAT):
    put("openai_request", "chat_%d" % i, SEP.join([bytes([(i % 3) << 1 | (8 if i == 3 else 0)]) + json.dumps(b).encode(), OUTPUT_TEXT, CALL]))
for i, b in enumerate(CMP):
    put("openai_request", "completion_%d" % i, SEP.join([bytes([1 | (i % 3) << 1 | (8 if i == 0 else 0)]) + json.dumps(b).encode(), OUTPUT_TEXT]))
put_dict("openai_request", JSON_TOKENS + ["system", "user", "assistant", "tool", "developer", "function", "text", "auto",
                                          "none", "low", "max", "xhigh", "<|open|>", "<|im_end|>"],
         ["src/server/api.c"])


# ---- hub_listing: [flags] INFO SEP PAGE ... [SEP LINK] --------------------------
SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
GIT = "ce013625030ba8dba906f756967f9e9ca394464a"
files = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json", "sub/tokenizer.json"]
full = {"id": "deltafin/tiny-k3", "sha": "0123456789abcdef0123456789abcdef01234567", "siblings": [
    {"rfilename": f, "blobId": GIT, "size": 100 + i, **({"lfs": {"sha256": SHA, "size": 100 + i, "pointerSize": 134}}
                                                        if f.endswith(".safetensors") else {})}
    for i, f in enumerate(files)]}
bare = {"sha": full["sha"], "siblings": [{"rfilename": f} for f in files]}
tree = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": "sub"}] + [
    {"type": "file", "oid": GIT, "size": 100 + i, "path": f,
     **({"lfs": {"oid": SHA, "size": 100 + i, "pointerSize": 134}} if f.endswith(".safetensors") else {})}
    for i, f in enumerate(files)]
LINK = b'<https://huggingface.co/api/models/r/tree/main?recursive=true&cursor=ZXlKbWFXeGx>; rel="next", <https://h/x>; rel="last"'
put("hub_listing", "info_full", bytes([0]) + json.dumps(full).encode())
put("hub_listing", "info_bare_two_pages", SEP.join([bytes([0]) + json.dumps(bare).encode(), json.dumps(tree[:3]).encode(),
                                                     json.dumps(tree[3:]).encode()]))
put("hub_listing", "page_and_link", SEP.join([bytes([1 | 6]) + json.dumps(bare).encode(), json.dumps(tree).encode(), LINK]))
put("hub_listing", "link_small", SEP.join([bytes([1 | 2]) + b"{}", b'<a>; rel=next, <bb>; Rel="prev next"; title="x, y"']))
put_dict("hub_listing", JSON_TOKENS + ["<", ">", ";", "rel=", "\"next\"", "next", ",", "sha", "siblings", "rfilename",
                                       "size", "blobId", "lfs", "sha256", "oid", "type", "file", "directory", "path", "..", "/"])


# ---- span_log: [flags][F, 2 bytes] LOG bytes, or 5-byte operations ------------
def rec(a, b, gone=False):
    if gone:
        a |= 1 << 63
    h = 1469598103934665603
    for x in struct.pack("<QQ", a, b):
        h = ((h ^ x) * 1099511628211) & (2 ** 64 - 1)
    return struct.pack("<QQQ", a, b, h ^ 0x9E3779B97F4A7C15)


def log(size, recs, tail=b""):
    return b"DFSPANS1" + struct.pack("<Q", size) + b"".join(rec(*r) for r in recs) + tail


F = struct.pack("<H", 999)  # the harness's F is 1 + this modulo 4096: 1000
put("span_log", "raw_three", bytes([0]) + F + log(1000, [(0, 100), (200, 300), (100, 150)]))
put("span_log", "raw_torn", bytes([0]) + F + log(1000, [(0, 100), (900, 1000, True), (900, 1000)], b"\x01\x02\x03\x04\x05"))
put("span_log", "raw_other_size", bytes([2]) + F + log(5000, [(10, 20), (30, 4000)]))
put("span_log", "raw_long", bytes([2]) + F + log(1000, [(i, i + 1, i % 3 == 0) for i in range(0, 140)]))
put("span_log", "raw_not_a_log", bytes([0]) + F + b"DFSPANS0" + bytes(30))
ops = b"".join(struct.pack("<BHH", op, a, b) for op, a, b in
               [(0, 0, 100), (0, 50, 200), (1, 20, 30), (2, 0, 0), (0, 300, 301), (1, 0, 1000), (0, 999, 1000), (2, 0, 0)]
               + [(i % 2, i * 7, i * 7 + 11) for i in range(80)] + [(3, 0, 0)]) + b"torn tail"
put("span_log", "ops", bytes([1]) + F + ops)
put_dict("span_log", ["DFSPANS1", "\x00\x00\x00\x00\x00\x00\x00\x80"])
