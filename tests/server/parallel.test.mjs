// parallel.test.mjs — `deltafin serve --parallel N` (optionally with --spec
// ngram) against a plain one-at-a-time server, driven by the official openai
// client (node --test). tests/test_server.c starts both on the trained tiny
// K3 (models/kimi-k3-tiny) and passes them in the environment:
//   DF_PAR_URL    --parallel 3 --spec ngram --spec-fixed --spec-depth 4 --retain 5
//   DF_SOLO_URL   the defaults (one generation at a time, no drafts)
// Every request's text, finish reason, usage and logprobs through the
// concurrent server must be those of the same request run alone.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const par = new OpenAI({ baseURL: `${process.env.DF_PAR_URL}/v1`, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const solo = new OpenAI({ baseURL: `${process.env.DF_SOLO_URL}/v1`, apiKey: 'none', maxRetries: 0, timeout: 120000 });

const code = 'def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n';
const reqs = [
  { kind: 'cmp', body: { prompt: code + 'def div(a, b):\n', max_tokens: 48, temperature: 0, logprobs: 2 } },
  { kind: 'cmp', body: { prompt: code, max_tokens: 40, temperature: 0.8, top_p: 0.95, seed: 11, logprobs: 1 } },
  { kind: 'chat', body: { messages: [{ role: 'user', content: 'import os\nimport sys\n' }], max_tokens: 30, temperature: 0,
                          logprobs: true, top_logprobs: 2, reasoning_effort: 'none' } },
  { kind: 'cmp', body: { prompt: 'class Foo:\n    def __init__(self):\n        self.x = 1\n', max_tokens: 25, temperature: 1, seed: 5 } },
  { kind: 'cmp', body: { prompt: code + code, max_tokens: 60, temperature: 0 } },
  { kind: 'chat', body: { messages: [{ role: 'user', content: 'for i in range(10):\n' }], max_tokens: 20, temperature: 0.7,
                          seed: 3, reasoning_effort: 'none' } },
];

// One request, streamed: the text pieces and logprob entries in order, the
// finish reason and usage.
async function streamed(client, r) {
  const out = { text: '', lp: [], finish: null, usage: null };
  if (r.kind === 'cmp') {
    const s = await client.completions.create({ model: 'm', ...r.body, stream: true, stream_options: { include_usage: true } });
    for await (const ch of s) {
      if (ch.usage) out.usage = ch.usage;
      const c = ch.choices[0];
      if (!c) continue;
      out.text += c.text ?? '';
      if (c.logprobs) out.lp.push(JSON.stringify(c.logprobs));
      if (c.finish_reason) out.finish = c.finish_reason;
    }
  } else {
    const s = await client.chat.completions.create({ model: 'm', ...r.body, stream: true, stream_options: { include_usage: true } });
    for await (const ch of s) {
      if (ch.usage) out.usage = ch.usage;
      const c = ch.choices[0];
      if (!c) continue;
      out.text += c.delta?.content ?? '';
      if (c.logprobs) out.lp.push(JSON.stringify(c.logprobs.content));
      if (c.finish_reason) out.finish = c.finish_reason;
    }
  }
  out.lp = out.lp.join('');
  return out;
}

async function metric(base, name) {
  const text = await (await fetch(`${base}/metrics`)).text();
  const m = text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, 'm'));
  return m ? Number(m[1]) : NaN;
}

test('concurrent streams equal solo runs (tokens, logprobs, usage)', async () => {
  const alone = [];
  for (const r of reqs) alone.push(await streamed(solo, r));
  // all at once: 3 decode together, the others join as slots free up
  const together = await Promise.all(reqs.map((r) => streamed(par, r)));
  for (let i = 0; i < reqs.length; i++) {
    assert.ok(alone[i].text.length > 0, `request ${i}: empty output`);
    assert.equal(together[i].text, alone[i].text, `request ${i}: text`);
    assert.equal(together[i].lp, alone[i].lp, `request ${i}: logprobs`);
    assert.equal(together[i].finish, alone[i].finish, `request ${i}: finish_reason`);
    assert.equal(together[i].usage.completion_tokens, alone[i].usage.completion_tokens, `request ${i}: usage`);
  }
  const url = process.env.DF_PAR_URL;
  assert.ok((await metric(url, 'deltafin_passes_shared_total')) > 0, 'no pass shared rows of two generations');
  assert.ok((await metric(url, 'deltafin_rows_per_step')) > 1, 'one row per step');
  assert.ok((await metric(url, 'deltafin_expert_union_total')) < (await metric(url, 'deltafin_expert_solo_total')),
    'the union of experts saved nothing');
  assert.ok((await metric(url, 'deltafin_spec_accepted_total')) > 0, 'no draft accepted on repetitive code');
  assert.equal(await metric(url, 'deltafin_generating'), 0);
  console.log(`# parallel: rows/step ${await metric(url, 'deltafin_rows_per_step')}, ` +
    `drafts ${await metric(url, 'deltafin_spec_accepted_total')}/${await metric(url, 'deltafin_spec_drafted_total')} accepted`);
});

test('kept sessions: a follow-up prompt reuses its conversation while others ran', async () => {
  const a = { kind: 'cmp', body: { prompt: code, max_tokens: 12, temperature: 0 } };
  const first = await streamed(par, a);
  // other conversations in between (fewer than --retain)
  await Promise.all([streamed(par, reqs[3]), streamed(par, reqs[5])]);
  const reused0 = await metric(process.env.DF_PAR_URL, 'deltafin_prompt_tokens_reused_total');
  const next = { kind: 'cmp', body: { prompt: code + first.text + '\n', max_tokens: 8, temperature: 0 } };
  const r = await streamed(par, next);
  const reused = (await metric(process.env.DF_PAR_URL, 'deltafin_prompt_tokens_reused_total')) - reused0;
  assert.ok(reused > 20, `only ${reused} prompt tokens reused`);
  assert.equal(r.text, (await streamed(solo, next)).text);
});
