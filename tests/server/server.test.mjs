// server.test.mjs — `deltafin serve` driven by the official openai client
// (node --test). tests/test_server.c starts two servers on a tiny synthetic
// K3 model with a tokenizer and passes them in the environment:
//   DF_URL, DF_KEY, DF_PID   the main server (--api-key, no delay)
//   DF_SLOW_URL              a slow one (--test-delay-ms, --queue 1, no key)
//   DF_RSS_SLACK_MB          allowed RSS growth over the load test (0: skip)
//   DF_MODEL_DIR             the model's folder (its tokenizer's special tokens)
// Every loop here is bounded in count and time and talks to loopback only.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const URL_MAIN = process.env.DF_URL;
const URL_SLOW = process.env.DF_SLOW_URL;
const KEY = process.env.DF_KEY;
const client = new OpenAI({ baseURL: `${URL_MAIN}/v1`, apiKey: KEY, maxRetries: 0, timeout: 60000 });
const slow = new OpenAI({ baseURL: `${URL_SLOW}/v1`, apiKey: 'none', maxRetries: 0, timeout: 60000 });
const hello = [{ role: 'user', content: 'Hello there' }];

async function metric(base, name) {
  const text = await (await fetch(`${base}/metrics`)).text();
  const m = text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, 'm'));
  return m ? Number(m[1]) : NaN;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A logit_bias that rules out every special token of the model's tokenizer:
// a sampled generation on random weights otherwise ends by itself now and
// then (about 3 in 100 chat replies stop within their first 4 tokens)
function noSpecials() {
  const cfg = JSON.parse(readFileSync(`${process.env.DF_MODEL_DIR}/tokenizer_config.json`, 'utf8'));
  const ids = Object.keys(cfg.added_tokens_decoder ?? {});
  assert.ok(ids.length > 0, 'the tokenizer names no special tokens');
  return Object.fromEntries(ids.map((id) => [id, -100]));
}

test('models list names the served model', async () => {
  const page = await client.models.list();
  assert.equal(page.data.length, 1);
  assert.equal(page.data[0].object, 'model');
});

test('chat non-streaming: message, usage, finish_reason', async () => {
  const r = await client.chat.completions.create({ model: 'm', messages: hello, max_tokens: 8, seed: 1, reasoning_effort: 'none' });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  const c = r.choices[0];
  assert.equal(c.message.role, 'assistant');
  assert.equal(typeof c.message.content, 'string');
  assert.ok(['length', 'stop'].includes(c.finish_reason));
  assert.ok(r.usage.prompt_tokens > 0);
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 8);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test('chat streaming: role delta first, deltas, finish_reason, usage chunk, [DONE]', async () => {
  const stream = await client.chat.completions.create({
    model: 'm', messages: hello, max_tokens: 12, seed: 2, stream: true, stream_options: { include_usage: true },
    reasoning_effort: 'none',
  });
  const chunks = [];
  for await (const ch of stream) chunks.push(ch);
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  assert.equal(chunks[0].object, 'chat.completion.chunk');
  const fin = chunks.filter((c) => c.choices.length && c.choices[0].finish_reason);
  assert.equal(fin.length, 1);
  const last = chunks[chunks.length - 1];
  assert.equal(last.choices.length, 0);
  assert.ok(last.usage.completion_tokens >= 1);
  const text = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
  // the same request without streaming gives the same text
  const r = await client.chat.completions.create({ model: 'm', messages: hello, max_tokens: 12, seed: 2, reasoning_effort: 'none' });
  assert.equal(r.choices[0].message.content, text);
  // raw SSE: data lines and the [DONE] sentinel
  const raw = await fetch(`${URL_MAIN}/v1/chat/completions`, {
    method: 'POST', headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'm', messages: hello, max_tokens: 3, stream: true }),
  });
  assert.match(raw.headers.get('content-type'), /text\/event-stream/);
  const body = await raw.text();
  assert.ok(body.endsWith('data: [DONE]\n\n'), body.slice(-80));
});

test('chat streaming: the thinking channel arrives as reasoning_content deltas', async () => {
  const stream = await client.chat.completions.create({ model: 'm', messages: hello, max_tokens: 6, seed: 3, stream: true, reasoning_effort: 'low' });
  let reasoning = '';
  for await (const ch of stream) reasoning += ch.choices[0]?.delta?.reasoning_content ?? '';
  assert.ok(reasoning.length > 0);
});

test('completions: non-streaming and streaming agree', async () => {
  const r = await client.completions.create({ model: 'm', prompt: 'Once upon a time', max_tokens: 10, seed: 4 });
  assert.equal(r.object, 'text_completion');
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 10);
  const s = await client.completions.create({ model: 'm', prompt: 'Once upon a time', max_tokens: 10, seed: 4, stream: true });
  let text = '';
  for await (const ch of s) text += ch.choices[0]?.text ?? '';
  assert.equal(text, r.choices[0].text);
  // echo: the streamed text starts with the prompt as the whole one does
  const e = await client.completions.create({ model: 'm', prompt: 'abc', echo: true, max_tokens: 6, seed: 4 });
  assert.ok(e.choices[0].text.startsWith('abc'), e.choices[0].text);
  const es = await client.completions.create({ model: 'm', prompt: 'abc', echo: true, max_tokens: 6, seed: 4, stream: true });
  let etext = '';
  for await (const ch of es) etext += ch.choices[0]?.text ?? '';
  assert.equal(etext, e.choices[0].text);
});

test('seed reproducibility at temperature 1', async () => {
  const ask = (seed) => client.completions.create({ model: 'm', prompt: 'The cat', max_tokens: 24, temperature: 1, seed });
  const a = await ask(42), b = await ask(42), c = await ask(43);
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.notEqual(a.choices[0].text, c.choices[0].text);
});

test('stop strings end the output before the match', async () => {
  const base = await client.completions.create({ model: 'm', prompt: 'abc', max_tokens: 30, seed: 7, temperature: 1 });
  const full = base.choices[0].text;
  assert.ok(full.length > 6, full);
  const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 2);
  const cut = full.slice(0, full.indexOf(stop));
  const r = await client.completions.create({ model: 'm', prompt: 'abc', max_tokens: 30, seed: 7, temperature: 1, stop: [stop] });
  assert.equal(r.choices[0].text, cut);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await client.completions.create({ model: 'm', prompt: 'abc', max_tokens: 30, seed: 7, temperature: 1, stop, stream: true });
  let text = '';
  for await (const ch of s) text += ch.choices[0]?.text ?? '';
  assert.equal(text, cut);
});

test('logit_bias and logprobs are honoured', async () => {
  // token 87 is "x": +100 makes it certain, greedy or not
  const r = await client.completions.create({ model: 'm', prompt: 'q', max_tokens: 5, logit_bias: { 87: 100 }, logprobs: 2, seed: 1 });
  assert.deepEqual(r.choices[0].logprobs.tokens, ['x', 'x', 'x', 'x', 'x']);
  assert.equal(r.choices[0].logprobs.top_logprobs[0] && Object.keys(r.choices[0].logprobs.top_logprobs[0]).length, 2);
  const c = await client.chat.completions.create({ model: 'm', messages: hello, max_tokens: 4, logprobs: true, top_logprobs: 3, reasoning_effort: 'none' });
  const lp = c.choices[0].logprobs.content;
  assert.equal(lp.length, c.usage.completion_tokens);
  for (const e of lp) {
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.logprob <= 0);
  }
});

test('ignore_eos: an end token neither ends the reply nor shows in it', async () => {
  const cfg = JSON.parse(readFileSync(`${process.env.DF_MODEL_DIR}/config.json`, 'utf8'));
  const eos = [cfg.eos_token_id ?? cfg.text_config?.eos_token_id].flat()[0];
  assert.ok(Number.isInteger(eos), 'config.json names no eos_token_id');
  const req = { model: 'm', prompt: 'q', max_tokens: 5, logit_bias: { [eos]: 100 }, temperature: 0 };
  const ended = await client.completions.create(req);
  assert.equal(ended.choices[0].finish_reason, 'stop');
  assert.equal(ended.usage.completion_tokens, 1);
  const on = await client.completions.create({ ...req, ignore_eos: true });
  assert.equal(on.choices[0].finish_reason, 'length');
  assert.equal(on.usage.completion_tokens, 5);
  assert.equal(on.choices[0].text, '');
  const chat = await client.chat.completions.create({
    model: 'm', messages: hello, max_tokens: 5, logit_bias: { [eos]: 100 }, reasoning_effort: 'none', ignore_eos: true, stream: true,
    stream_options: { include_usage: true },
  });
  let finish = null, usage = null;
  for await (const ch of chat) { finish = ch.choices[0]?.finish_reason ?? finish; usage = ch.usage ?? usage; }
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 5);
});

test('prefix reuse: a prompt that extends the kept session is not prefilled again', async () => {
  const prompt = [40, 300, 264, 500, 13, 220];
  const a = await client.completions.create({ model: 'm', prompt, max_tokens: 4, logit_bias: { 87: 100 }, temperature: 0 });
  assert.equal(a.choices[0].text, 'xxxx');
  const b = await client.completions.create({ model: 'm', prompt: [...prompt, 87, 87, 87, 87, 13], max_tokens: 2, temperature: 0 });
  // the 4th x was sampled but never evaluated: 6 + 3 tokens are reused
  assert.equal(b.usage.prompt_tokens_details.cached_tokens, prompt.length + 3);
  const fresh = await client.completions.create({ model: 'm', prompt: [13, ...prompt], max_tokens: 2, temperature: 0 });
  assert.equal(fresh.usage.prompt_tokens_details.cached_tokens, 0);
});

test('tools: declarations, assistant tool_calls and tool results render; tool_choice required is refused', async () => {
  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
  const messages = [
    { role: 'user', content: 'Weather in Paris?' },
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temp": 21}' },
  ];
  const r = await client.chat.completions.create({ model: 'm', messages, tools, max_tokens: 4, reasoning_effort: 'none' });
  assert.equal(r.choices[0].message.role, 'assistant');
  await assert.rejects(client.chat.completions.create({ model: 'm', messages, tools, tool_choice: 'required', max_tokens: 4 }),
    (e) => e.status === 400 && e.param === 'tool_choice');
});

test('refused fields get an OpenAI 400 naming them', async () => {
  const cases = [
    [{ n: 2 }, 'n'], [{ frobnicate: 1 }, 'frobnicate'], [{ temperature: 'hot' }, 'temperature'],
    [{ response_format: { type: 'json_object' } }, 'response_format'], [{ max_tokens: 10 ** 7 }, 'max_tokens'],
    [{ reasoning_effort: 'extreme' }, 'reasoning_effort'], [{ logit_bias: { 999999: 1 } }, 'logit_bias'],
    [{ ignore_eos: 'yes' }, 'ignore_eos'],
  ];
  for (const [extra, param] of cases) {
    await assert.rejects(client.chat.completions.create({ model: 'm', messages: hello, max_tokens: 2, ...extra }),
      (e) => e.status === 400 && e.param === param && typeof e.message === 'string', JSON.stringify(extra));
  }
});

test('401 with a wrong API key', async () => {
  const bad = new OpenAI({ baseURL: `${URL_MAIN}/v1`, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.chat.completions.create({ model: 'm', messages: hello, max_tokens: 2 }),
    (e) => e.status === 401 && e.code === 'invalid_api_key');
});

test('health, metrics and models answer while a generation runs', async () => {
  const long = slow.completions.create({ model: 'm', prompt: 'a', max_tokens: 60, temperature: 0 });
  await sleep(150);
  assert.equal(await metric(URL_SLOW, 'deltafin_generating'), 1);
  const t0 = Date.now();
  assert.equal((await fetch(`${URL_SLOW}/health`)).status, 200);
  assert.equal((await fetch(`${URL_SLOW}/v1/models`)).status, 200);
  assert.ok(Date.now() - t0 < 500, `took ${Date.now() - t0} ms`);
  await long;
});

test('429 with Retry-After once the queue is full', async () => {
  // --queue 1: one running + one waiting; the third is refused
  const body = JSON.stringify({ model: 'm', prompt: 'a', max_tokens: 25, temperature: 0 });
  const post = () => fetch(`${URL_SLOW}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
  const first = post();
  await sleep(100);
  const second = post();
  await sleep(100);
  const third = await post();
  assert.equal(third.status, 429);
  assert.ok(Number(third.headers.get('retry-after')) >= 1);
  const err = await third.json();
  assert.equal(err.error.type, 'rate_limit_error');
  assert.equal((await first).status, 200);
  assert.equal((await second).status, 200);
  // and the server serves again once the queue drains
  assert.equal((await slow.completions.create({ model: 'm', prompt: 'a', max_tokens: 1 })).choices.length, 1);
});

test('a client that disconnects mid-stream stops its generation', async () => {
  const before = await metric(URL_SLOW, 'deltafin_generation_tokens_total');
  const cancelled = await metric(URL_SLOW, 'deltafin_requests_cancelled_total');
  const stream = await slow.chat.completions.create({
    model: 'm', messages: hello, max_tokens: 800, stream: true, reasoning_effort: 'none', logit_bias: noSpecials(),
  });
  let n = 0;
  for await (const ch of stream) { if (++n === 4) break; } // break aborts the request
  assert.equal(n, 4, 'the stream ended before the client left');
  // 800 tokens at 25 ms take 20 s: the cancellation must come well before,
  // in fewer than half of them (on a loaded 2-core CI machine under ASan
  // the socket's close has taken more than 8 s to reach the server)
  const deadline = Date.now() + 16000;
  while (Date.now() < deadline && (await metric(URL_SLOW, 'deltafin_requests_cancelled_total')) === cancelled) await sleep(20);
  assert.equal(await metric(URL_SLOW, 'deltafin_requests_cancelled_total'), cancelled + 1);
  const made = (await metric(URL_SLOW, 'deltafin_generation_tokens_total')) - before;
  assert.ok(made < 400, `generated ${made} tokens after the client left`);
  assert.equal(await metric(URL_SLOW, 'deltafin_generating'), 0);
});

test('a queued request whose client left is never prefilled', async () => {
  const evaluated = await metric(URL_SLOW, 'deltafin_prompt_tokens_total');
  const cancelled = await metric(URL_SLOW, 'deltafin_requests_cancelled_total');
  const running = slow.completions.create({ model: 'm', prompt: [5, 6, 7], max_tokens: 40, temperature: 0 });
  await sleep(100);
  const ac = new AbortController();
  const long = Array.from({ length: 300 }, (_, i) => (i * 37) % 1000 + 1);
  const queued = slow.completions.create({ model: 'm', prompt: long, max_tokens: 2 }, { signal: ac.signal }).catch((e) => e);
  await sleep(100);
  ac.abort(); // gone while it waits behind the running one
  await queued;
  await running;
  const deadline = Date.now() + 3000;
  while (Date.now() < deadline && (await metric(URL_SLOW, 'deltafin_requests_cancelled_total')) === cancelled) await sleep(20);
  assert.equal(await metric(URL_SLOW, 'deltafin_requests_cancelled_total'), cancelled + 1);
  const made = (await metric(URL_SLOW, 'deltafin_prompt_tokens_total')) - evaluated;
  assert.ok(made <= 3, `${made} prompt tokens evaluated: the abandoned 300-token prompt was prefilled`);
});

test('load: 200 requests from 8 concurrent clients, none lost, bounded memory', async () => {
  const rss = () => Number(readFileSync(`/proc/${process.env.DF_PID}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)[1]) / 1024;
  const one = (i) => (i % 2
    ? client.chat.completions.create({ model: 'm', messages: [{ role: 'user', content: `req ${i}` }], max_tokens: 6, reasoning_effort: 'none', stream: i % 4 === 1 })
      .then(async (r) => { if (r[Symbol.asyncIterator]) { for await (const _ of r); } return 1; })
    : client.completions.create({ model: 'm', prompt: `load ${i}`, max_tokens: 6 }).then(() => 1));
  const run = async (total) => {
    let next = 0, ok = 0;
    const worker = async () => { while (next < total) { const i = next++; const v = await one(i); ok += v; } };
    await Promise.all(Array.from({ length: 8 }, worker));
    return ok;
  };
  await run(40); // warm-up: allocator pools, thread stacks
  const r0 = rss();
  const t0 = Date.now();
  assert.equal(await run(200), 200);
  const r1 = rss();
  const slack = Number(process.env.DF_RSS_SLACK_MB || 0);
  console.log(`# load: 200 requests in ${Date.now() - t0} ms, RSS ${r0.toFixed(1)} -> ${r1.toFixed(1)} MB`);
  if (slack > 0) assert.ok(r1 - r0 < slack, `RSS grew ${(r1 - r0).toFixed(1)} MB`);
});
