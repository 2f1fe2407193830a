#!/usr/bin/env python3
"""Deterministic training corpus for the tiny K3 model (models/kimi-k3-tiny).

Source: this Debian machine's Python standard library sources
(/usr/lib/python3.11, package libpython3.11-stdlib; PSF license). Every file
choice is a fixed rule, so the same package gives the same corpus, and the
manifest (sha256 of every file and of every output) says whether it did.

Selection (sorted by relative path, bytewise):
  - *.py regular files (symlinks skipped) under the root;
  - excluded: test suites (a path component test, tests, idle_test),
    __pycache__, site-packages, dist-packages; generated codec tables
    ("Character Mapping Codec" in the text); generated sysconfig data
    (_sysconfigdata*); files over --max-file-bytes (pydoc_data/topics.py);
    empty files; files that are not UTF-8.
  - split by file: the i-th kept file (0-based) goes to validation when
    i % --val-every == --val-every - 1, else to training.

Documents, in file order: the file's text, then the chat documents made from
that file (same split as the file). A chat document is a conversation in
K3's XTML format exactly as `deltafin run --chat --prompt P` renders it
(thinking-effort system message with effort "max", the user message, the
assistant's think and response channels, <|end_of_msg|>): the user asks for
a function of the file (its name, signature and docstring summary), the
answer is that function's source in a ```python fence. Functions are taken
in source order when their docstring has a summary line and their source is
120..1200 bytes; every --chat-every-th candidate is kept.

Tokens: deltafin's own tokenizer (`deltafin tokenize --model TOKDIR`), where
TOKDIR is written by `deltafin synth --arch kimi_k3 --tokenizer RANKS --vocab V`:
the 256 bytes and lowest ranks of cl100k_base fill ids 0..V-257 and K3's
specials the top 256 ids. File documents are tokenized without --special
(their special-looking spellings stay bytes); chat documents with --special
(their code is checked to hold no special spelling). Every document is
followed by the [EOS] id, so the model sees file boundaries.

Outputs under --out (default <repo>/.device-carry/train, gitignored):
  train.bin, val.bin       uint16 little-endian token ids
  train.docs.jsonl, val.docs.jsonl   one {"path", "kind", "text"} per document
  tokenizer/               tiktoken.model, tokenizer_config.json (to ship with
                           the model), config.json (synth's, for the ids)
  manifest.json            the selection, sha256 of each source file, of the
                           tokenizer files and of each output, token counts

Needs only Python 3 (no numpy) and build/deltafin.

    python3 tools/train/make_corpus.py            # writes .device-carry/train/
"""
import argparse
import array
import ast
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

EXCLUDED_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}

# deltafin's K3 chat rendering (src/text/chat.c, shared/K3.md section 2.3) for
# `run --chat --prompt P` with the default effort "max" and thinking on.
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the "
               "system is invoked with `thinking_effort=")
USER_TEMPLATES = [
    "Write a Python function `{name}{sig}`: {summary}",
    "Implement `{name}{sig}` in Python. {summary}",
    "How would the `{module}` module define `{name}`? {summary}",
]
THINK_TEMPLATES = [
    "The user wants `{name}`. {summary} I will write it the way the `{module}` module does.",
    "`{name}{sig}` belongs in `{module}`. I will give the function with its docstring.",
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sha256_bytes(b):
    return hashlib.sha256(b).hexdigest()


def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for blk in iter(lambda: f.read(1 << 20), b""):
            h.update(blk)
    return h.hexdigest()


def pick(key, n):
    """A deterministic choice in [0, n) from a string."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def chat_user(content):
    return "<|open|>message role=\"user\"<|sep|>%s<|close|>message<|sep|><|end_of_msg|>" % content


def chat_prompt(user_text, effort="max"):
    """What `deltafin run --chat --prompt USER_TEXT` evaluates (the generation
    prompt opens the assistant message and its think channel)."""
    sys_msg = ("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>%s%s`.<|close|>message<|sep|>"
               "<|end_of_msg|>" % (EFFORT_TEXT, effort))
    return sys_msg + chat_user(user_text) + "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"


def chat_document(user_text, think, response):
    return (chat_prompt(user_text) + think + "<|close|>think<|sep|><|open|>response<|sep|>" + response +
            "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------

def select_files(root, max_bytes):
    kept, excluded = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        if any(p in EXCLUDED_DIRS for p in parts):
            dirnames[:] = []
            continue
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = os.path.join(dirpath, fn)
            rel = "/".join(parts + [fn])
            if os.path.islink(p) or not os.path.isfile(p):
                excluded.append((rel, "symlink or not a regular file"))
                continue
            data = open(p, "rb").read()
            reason = None
            if fn.startswith("_sysconfigdata"):
                reason = "generated sysconfig data"
            elif len(data) == 0:
                reason = "empty"
            elif len(data) > max_bytes:
                reason = "over %d bytes (%d)" % (max_bytes, len(data))
            elif b"Character Mapping Codec" in data:
                reason = "generated codec table"
            else:
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    reason = "not UTF-8"
            if reason:
                excluded.append((rel, reason))
            else:
                kept.append((rel, data))
    kept.sort(key=lambda x: x[0].encode())
    excluded.sort(key=lambda x: x[0].encode())
    return kept, excluded


def function_candidates(rel, text):
    """(qualname, name, sig, summary, code) for the functions of one file, in source order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []

    def visit(node, prefix):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = prefix + ch.name
                doc = ast.get_docstring(ch, clean=True)
                summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""
                start = min([ch.lineno] + [d.lineno for d in ch.decorator_list])
                code = textwrap.dedent("".join(lines[start - 1: ch.end_lineno])).rstrip() + "\n"
                if summary and 120 <= len(code.encode()) <= 1200 and len(summary) <= 200:
                    sig = "(" + ast.unparse(ch.args) + ")"
                    out.append((qual, ch.name, sig, summary, code))
                visit(ch, qual + ".")
            elif isinstance(ch, ast.ClassDef):
                visit(ch, prefix + ch.name + ".")
    visit(tree, "")
    return out


def module_name(rel):
    m = rel[:-3].replace("/", ".")
    return m[: -len(".__init__")] if m.endswith(".__init__") else m


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------

class Tok:
    def __init__(self, deltafin, tokdir, work):
        self.deltafin, self.tokdir, self.work = deltafin, tokdir, work
        self.n = 0

    def encode(self, text, special=False):
        p = os.path.join(self.work, "doc.txt")
        with open(p, "wb") as f:
            f.write(text.encode("utf-8"))
        cmd = [self.deltafin, "tokenize", "--model", self.tokdir, "--text-file", p] + (["--special"] if special else [])
        r = subprocess.run(cmd, check=True, capture_output=True, text=True)
        self.n += 1
        return [int(x) for x in r.stdout.split()]

    def decode(self, ids):
        r = subprocess.run([self.deltafin, "detokenize", "--model", self.tokdir],
                           input=" ".join(map(str, ids)).encode(), check=True, capture_output=True)
        return r.stdout.decode("utf-8")


def write_u16(path, ids):
    a = array.array("H", ids)
    if sys.byteorder != "little":
        a.byteswap()
    with open(path, "wb") as f:
        a.tofile(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", default="/usr/lib/python3.11")
    ap.add_argument("--out", default=os.path.join(REPO, ".device-carry", "train"))
    ap.add_argument("--deltafin", default=os.path.join(REPO, "build", "deltafin"))
    ap.add_argument("--ranks", default=os.path.join(REPO, "tests", "text", "cl100k_base.tiktoken.gz"),
                    help="tiktoken rank file (plain or .gz)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--val-every", type=int, default=20)
    ap.add_argument("--max-file-bytes", type=int, default=250000)
    ap.add_argument("--chat-every", type=int, default=3, help="keep every n-th function candidate as a chat document")
    a = ap.parse_args()
    if a.vocab > 65536:
        sys.exit("vocab must fit uint16")
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="k3corpus_")
    try:
        # tokenizer: synth writes it cut to the vocabulary, with K3's specials on top
        ranks = a.ranks
        if ranks.endswith(".gz"):
            ranks = os.path.join(work, "ranks.tiktoken")
            with gzip.open(a.ranks, "rb") as fi, open(ranks, "wb") as fo:
                shutil.copyfileobj(fi, fo)
        syn = os.path.join(work, "syn")
        subprocess.run([a.deltafin, "synth", "--arch", "kimi_k3", "--out", syn, "--tokenizer", ranks,
                        "--vocab", str(a.vocab), "--quiet"], check=True)
        tokdir = os.path.join(a.out, "tokenizer")
        os.makedirs(tokdir, exist_ok=True)
        for fn in ("tiktoken.model", "tokenizer_config.json", "config.json"):
            shutil.copyfile(os.path.join(syn, fn), os.path.join(tokdir, fn))
        tcfg = json.load(open(os.path.join(tokdir, "tokenizer_config.json")))
        scfg = json.load(open(os.path.join(tokdir, "config.json")))
        specials = {v["content"]: int(k) for k, v in tcfg["added_tokens_decoder"].items()}
        eos_doc = specials["[EOS]"]
        ids_cfg = {k: scfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        tok = Tok(a.deltafin, tokdir, work)

        # segments tokenized apart == the --special path (what the renderer does)
        probe = chat_document("Write `f(x)`: Return x.", "Easy.", "```python\ndef f(x):\n    return x\n```")
        seg_ids, rest = [], probe
        while rest:
            cut = min([(rest.find(s), s) for s in specials if rest.find(s) >= 0] or [(len(rest), None)])
            if cut[0] > 0:
                seg_ids += tok.encode(rest[: cut[0]])
            if cut[1] is None:
                break
            seg_ids.append(specials[cut[1]])
            rest = rest[cut[0] + len(cut[1]):]
        if seg_ids != tok.encode(probe, special=True):
            sys.exit("tokenize --special does not split at special spellings as the chat renderer does")

        kept, excluded = select_files(a.stdlib, a.max_file_bytes)
        log("[corpus] %d files kept (%d bytes), %d excluded" % (
            len(kept), sum(len(d) for _, d in kept), len(excluded)))
        splits = {"train": [], "val": []}
        files_meta = []
        n_cand = 0
        spell = sorted(specials, key=len, reverse=True)
        for i, (rel, data) in enumerate(kept):
            split = "val" if i % a.val_every == a.val_every - 1 else "train"
            text = data.decode("utf-8")
            docs = [("file", rel, text)]
            cands = function_candidates(rel, text)
            for qual, name, sig, summary, code in cands:
                n_cand += 1
                if (n_cand - 1) % a.chat_every:
                    continue
                if any(s in code or s in summary for s in spell):
                    continue
                key = rel + ":" + qual
                fmt = dict(name=name, sig=sig, summary=summary, module=module_name(rel))
                user = USER_TEMPLATES[pick(key, len(USER_TEMPLATES))].format(**fmt)
                think = THINK_TEMPLATES[pick(key + "#think", len(THINK_TEMPLATES))].format(**fmt)
                docs.append(("chat", key, chat_document(user, think, "```python\n" + code + "```")))
            splits[split].append(docs)
            files_meta.append({"path": rel, "bytes": len(data), "sha256": sha256_bytes(data), "split": split,
                               "chat_docs": len(docs) - 1})

        outputs, stats = {}, {}
        for split, groups in splits.items():
            ids_all, n_docs, n_chat, n_bytes = [], 0, 0, 0
            jl = os.path.join(a.out, split + ".docs.jsonl")
            with open(jl, "w", encoding="utf-8") as fj:
                for docs in groups:
                    for kind, path, text in docs:
                        ids = tok.encode(text, special=(kind == "chat"))
                        if not ids or max(ids) >= a.vocab or eos_doc in ids:
                            sys.exit("%s: bad token ids (empty, out of vocabulary, or [EOS] inside)" % path)
                        if split == "val" and tok.decode(ids) != text:
                            sys.exit("%s: detokenize(tokenize(text)) != text" % path)
                        ids_all += ids + [eos_doc]
                        n_docs += 1
                        n_chat += kind == "chat"
                        n_bytes += len(text.encode("utf-8"))
                        fj.write(json.dumps({"path": path, "kind": kind, "text": text}, ensure_ascii=False) + "\n")
            binp = os.path.join(a.out, split + ".bin")
            write_u16(binp, ids_all)
            outputs[split + ".bin"] = sha256_file(binp)
            outputs[split + ".docs.jsonl"] = sha256_file(jl)
            stats[split] = {"documents": n_docs, "chat_documents": n_chat, "text_bytes": n_bytes,
                            "tokens": len(ids_all), "bytes_per_token": round(n_bytes / len(ids_all), 4)}
            log("[corpus] %s: %d documents (%d chat), %d bytes of text, %d tokens" % (
                split, n_docs, n_chat, n_bytes, len(ids_all)))
        for fn in ("tiktoken.model", "tokenizer_config.json", "config.json"):
            outputs["tokenizer/" + fn] = sha256_file(os.path.join(tokdir, fn))

        def pkg_version(p):
            try:
                return subprocess.run(["dpkg-query", "-W", "-f", "${Version}", p], capture_output=True,
                                      text=True).stdout.strip() or None
            except OSError:
                return None

        def git_head():
            try:
                return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                      text=True).stdout.strip() or None
            except OSError:
                return None

        manifest = {
            "what": "tiny K3 training corpus: Python standard library sources + chat documents made from them",
            "source": {"root": a.stdlib, "debian_package": "libpython3.11-stdlib",
                       "package_version": pkg_version("libpython3.11-stdlib"), "license": "PSF-2.0"},
            "rules": {"val_every": a.val_every, "val_rule": "i %% %d == %d over the sorted kept files" % (
                          a.val_every, a.val_every - 1),
                      "max_file_bytes": a.max_file_bytes, "chat_every": a.chat_every,
                      "excluded_dirs": sorted(EXCLUDED_DIRS),
                      "document_separator": "[EOS] id %d after every document" % eos_doc,
                      "chat_format": "deltafin run --chat rendering (K3 XTML), effort max, thinking on"},
            "tokenizer": {"rank_file": os.path.relpath(a.ranks, REPO) if a.ranks.startswith(REPO) else a.ranks,
                          "rank_file_sha256": sha256_file(a.ranks), "vocab": a.vocab,
                          "ranks_used": a.vocab - 256, "special_ids": {k: specials[k] for k in (
                              "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[PAD]")},
                          "config_ids": ids_cfg, "deltafin_commit": git_head(),
                          "made_by": "deltafin synth --arch kimi_k3 --tokenizer RANKS --vocab %d" % a.vocab},
            "stats": stats,
            "outputs_sha256": outputs,
            "files": files_meta,
            "excluded": [{"path": p, "reason": r} for p, r in excluded],
        }
        with open(os.path.join(a.out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        log("[corpus] wrote %s (%d tokenizer calls, %.0fs)" % (a.out, tok.n, time.time() - t0))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
