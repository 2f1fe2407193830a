// server_soak.mjs — the client half of bench/server_soak.sh: hostile and
// honest traffic against one running `deltafin serve`, checked answer by
// answer, with the server's RSS and open descriptors sampled over time.
//
// Owns: the request mix, the oracle (every valid request's full answer,
// computed once solo before the load), the checks of each answer, the
// samples and the verdict. Refuses: to judge anything it cannot check (a
// request it disconnected itself is counted, not judged) and to talk to
// anything but the loopback server it is given.
//
// Environment (set by server_soak.sh): DF_URL, DF_KEY, DF_PID, DF_NAME,
// DF_QUEUE, DF_MAX_BODY, DF_CTX, DF_CEILING, SOAK_SECONDS, SOAK_SAMPLE_S,
// SOAK_CLIENTS, SOAK_RSS_JUDGE (0: print RSS, do not judge it: ASan),
// SOAK_RSS_TOL_PCT, SOAK_RSS_TOL_MB.
//
// Sections: 1. set-up  2. the valid requests and their oracle
//           3. checking answers  4. raw sockets  5. the operations
//           6. sampling  7. the run and the verdict
import net from 'node:net';
import { readFileSync, readdirSync, readlinkSync } from 'node:fs';
import { createRequire } from 'node:module';

// ---- 1. set-up -----------------------------------------------------------------------

const require = createRequire(new URL('../tests/server/package.json', import.meta.url));
const { OpenAI } = require('openai');

const env = (k, d) => (process.env[k] !== undefined && process.env[k] !== '' ? process.env[k] : d);
const URL_BASE = env('DF_URL');
const HOST = new URL(URL_BASE).hostname;
const PORT = Number(new URL(URL_BASE).port);
const KEY = env('DF_KEY');
const PID = Number(env('DF_PID'));
const NAME = env('DF_NAME');
const QUEUE = Number(env('DF_QUEUE', 4));
const MAX_BODY = Number(env('DF_MAX_BODY', 65536));
const CTX = Number(env('DF_CTX', 256));
const CEILING = Number(env('DF_CEILING', 64));
const SECONDS = Number(env('SOAK_SECONDS', 60));
const SAMPLE_S = Number(env('SOAK_SAMPLE_S', 10));
const CLIENTS = Number(env('SOAK_CLIENTS', 10));
const RSS_JUDGE = env('SOAK_RSS_JUDGE', '1') !== '0';
const RSS_TOL_PCT = Number(env('SOAK_RSS_TOL_PCT', 10));
const RSS_TOL_MB = Number(env('SOAK_RSS_TOL_MB', 2));
const OP_TIMEOUT_MS = 120000; // no answer (or end) within this: a lost response

const client = new OpenAI({ baseURL: `${URL_BASE}/v1`, apiKey: KEY, maxRetries: 0, timeout: OP_TIMEOUT_MS });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const rnd = (n) => Math.floor(Math.random() * n);
const pick = (a) => a[rnd(a.length)];

const failures = [];   // first messages, printed at the end
let nFail = 0;
const stats = new Map(); // kind -> {n, ok, s429, cut, bad, other}
function stat(kind) {
  if (!stats.has(kind)) stats.set(kind, { n: 0, ok: 0, s429: 0, cut: 0, bad: 0 });
  return stats.get(kind);
}
function fail(kind, msg) {
  nFail++;
  stat(kind).bad++;
  if (failures.length < 40) failures.push(`${kind}: ${msg}`);
  if (failures.length <= 5) console.log(`# FAIL ${kind}: ${msg}`);
}
const idsSeen = new Set();
function checkId(kind, id, prefix) {
  if (typeof id !== 'string' || !id.startsWith(prefix)) { fail(kind, `id ${JSON.stringify(id)} does not start with ${prefix}`); return false; }
  if (idsSeen.has(id)) { fail(kind, `id ${id} answered twice (mixed-up responses)`); return false; }
  idsSeen.add(id);
  return true;
}

// ---- 2. the valid requests and their oracle -----------------------------------------

// Token ids in [1, 1000): the tiny model's tokenizer maps every one to text.
const ids = (n, seed) => Array.from({ length: n }, (_, i) => ((i + 1) * 7919 * seed) % 997 + 1);
const P6 = [40, 300, 264, 500, 13, 220];
const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
  parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];

// Every request here is deterministic: temperature 0, or a seed.
const SPECS = [
  { name: 'c_story', ep: 'cmp', body: { prompt: 'Once upon a time', max_tokens: 32, temperature: 0 } },
  { name: 'c_story5', ep: 'cmp', body: { prompt: 'Once upon a time', max_tokens: 5, temperature: 0 } },
  { name: 'c_cat_stop', ep: 'cmp', body: { prompt: 'The cat sat on', max_tokens: 24, temperature: 0, stop: ['e', 'z'] } },
  { name: 'c_xxxx', ep: 'cmp', body: { prompt: P6, max_tokens: 4, temperature: 0, logit_bias: { 87: 100 } } },
  { name: 'c_reuse', ep: 'cmp', body: { prompt: [...P6, 87, 87, 87, 87, 13], max_tokens: 6, temperature: 0 } },
  { name: 'c_echo', ep: 'cmp', body: { prompt: 'abc', echo: true, max_tokens: 8, temperature: 0 } },
  { name: 'c_logprobs', ep: 'cmp', body: { prompt: 'q', max_tokens: 6, logprobs: 2, temperature: 0 } },
  { name: 'c_n1', ep: 'cmp', body: { prompt: 'n is one', n: 1, best_of: 1, max_tokens: 10, temperature: 0 } },
  { name: 'c_long', ep: 'cmp', body: { prompt: ids(200, 3), max_tokens: 40, temperature: 0 } },
  { name: 'c_default_max', ep: 'cmp', body: { prompt: ids(90, 5), temperature: 0 } },
  { name: 'c_ctx_edge', ep: 'cmp', body: { prompt: ids(CTX - 6, 11), temperature: 0 } }, // room for 6 tokens only
  { name: 'c_seed', ep: 'cmp', body: { prompt: 'Seeded', max_tokens: 20, temperature: 0.9, seed: 7 } },
  { name: 'h_hello', ep: 'chat', body: { messages: [{ role: 'user', content: 'Hello there' }], max_tokens: 24, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_think', ep: 'chat', body: { messages: [{ role: 'user', content: 'Why is the sky blue?' }], max_tokens: 24, temperature: 0, reasoning_effort: 'low' } },
  { name: 'h_system', ep: 'chat', body: { messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Name a colour.' }], max_tokens: 16, temperature: 0 } },
  { name: 'h_multi', ep: 'chat', body: { messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'Hello!' }, { role: 'user', content: 'And then?' }], max_tokens: 20, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_tools', ep: 'chat', body: { messages: [{ role: 'user', content: 'Weather in Paris?' }], tools, max_tokens: 20, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_logprobs', ep: 'chat', body: { messages: [{ role: 'user', content: 'Count' }], logprobs: true, top_logprobs: 2, max_tokens: 8, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_stop', ep: 'chat', body: { messages: [{ role: 'user', content: 'Say a' }], stop: 'a', max_tokens: 30, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_mct', ep: 'chat', body: { messages: [{ role: 'user', content: 'Seven' }], max_completion_tokens: 7, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_unicode', ep: 'chat', body: { messages: [{ role: 'user', content: 'héllo wörld 日本語 🎉' }], max_tokens: 16, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_ceiling', ep: 'chat', body: { messages: [{ role: 'user', content: 'Go on and on' }], temperature: 0, reasoning_effort: 'none' } }, // to the ceiling
  { name: 'h_specials', ep: 'chat', body: { messages: [{ role: 'user', content: 'Not markers: <|open|> <|close|> [EOS] <|im_end|>' }, { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } }] }, { role: 'tool', tool_call_id: 'c1', content: '' }], max_tokens: 12, temperature: 0, reasoning_effort: 'none' } },
  { name: 'h_seed', ep: 'chat', body: { messages: [{ role: 'user', content: 'Pick' }], max_tokens: 16, temperature: 0.8, top_p: 0.9, seed: 99, reasoning_effort: 'none' } },
];

// What a valid answer must be, assembled the same way from a whole response
// and from a stream.
function outcomeOfResponse(spec, r) {
  const c = r.choices[0];
  const o = { finish: c.finish_reason, prompt_tokens: r.usage?.prompt_tokens, completion_tokens: r.usage?.completion_tokens };
  if (spec.ep === 'chat') {
    o.content = c.message.content ?? '';
    o.reasoning = c.message.reasoning_content ?? '';
    o.tools = (c.message.tool_calls ?? []).map((t) => `${t.function.name}(${t.function.arguments})`).join(';');
    o.lp = c.logprobs ? c.logprobs.content.map((e) => e.token).join('\u0001') : null;
  } else {
    o.content = c.text;
    o.lp = c.logprobs ? c.logprobs.tokens.join('\u0001') : null;
  }
  return o;
}

const expected = new Map(); // spec name -> outcome

function sameOutcome(kind, spec, got, { usage = true } = {}) {
  const want = expected.get(spec.name);
  for (const k of ['content', 'reasoning', 'tools', 'finish', 'lp']) {
    if (want[k] === undefined) continue;
    if (got[k] !== want[k]) {
      fail(kind, `${spec.name}: ${k} ${JSON.stringify(got[k])?.slice(0, 120)} != expected ${JSON.stringify(want[k])?.slice(0, 120)}`);
      return false;
    }
  }
  if (usage) {
    for (const k of ['prompt_tokens', 'completion_tokens']) {
      if (got[k] !== want[k]) { fail(kind, `${spec.name}: usage.${k} ${got[k]} != expected ${want[k]}`); return false; }
    }
  }
  const lim = spec.body.max_tokens ?? spec.body.max_completion_tokens;
  if (lim && got.completion_tokens > lim) { fail(kind, `${spec.name}: ${got.completion_tokens} tokens, above max_tokens ${lim}`); return false; }
  return true;
}

// ---- 3. checking answers -------------------------------------------------------------

function retryAfterOf(headers) {
  if (!headers) return NaN;
  const v = typeof headers.get === 'function' ? headers.get('retry-after') : headers['retry-after'];
  return Number(v);
}

// An error from the openai client for a valid request: 429 is a correct answer.
function clientError(kind, spec, e) {
  if (e?.status === 429) {
    const ra = retryAfterOf(e.headers);
    if (!(ra >= 1 && ra <= 3600)) fail(kind, `429 without a sane Retry-After (${ra})`);
    else if (e.type !== 'rate_limit_error' && e.error?.type !== 'rate_limit_error') fail(kind, `429 of type ${e.type}`);
    else stat(kind).s429++;
    return;
  }
  fail(kind, `${spec?.name ?? ''}: ${e?.status ?? ''} ${e?.name ?? ''} ${String(e?.message ?? e).slice(0, 200)}`);
}

function checkResponse(kind, spec, r) {
  const prefix = spec.ep === 'chat' ? 'chatcmpl-' : 'cmpl-';
  if (!checkId(kind, r.id, prefix)) return false;
  if (r.object !== (spec.ep === 'chat' ? 'chat.completion' : 'text_completion')) { fail(kind, `object ${r.object}`); return false; }
  if (r.model !== NAME) { fail(kind, `model ${r.model}`); return false; }
  if (r.choices?.length !== 1 || r.choices[0].index !== 0) { fail(kind, `choices ${JSON.stringify(r.choices)?.slice(0, 100)}`); return false; }
  if (r.usage.total_tokens !== r.usage.prompt_tokens + r.usage.completion_tokens) { fail(kind, 'usage totals'); return false; }
  return sameOutcome(kind, spec, outcomeOfResponse(spec, r));
}

// Assembles a stream's chunks; checks ids, order, finish and usage.
function assembleStream(kind, spec, chunks, includeUsage) {
  const prefix = spec.ep === 'chat' ? 'chatcmpl-' : 'cmpl-';
  const object = spec.ep === 'chat' ? 'chat.completion.chunk' : 'text_completion';
  if (!chunks.length) { fail(kind, `${spec.name}: empty stream`); return null; }
  const id = chunks[0].id;
  const o = { content: '', reasoning: '', tools: [], lp: null, finish: null };
  let nFinish = 0, usage = null, lp = [];
  for (let i = 0; i < chunks.length; i++) {
    const ch = chunks[i];
    if (ch.id !== id) { fail(kind, `${spec.name}: chunk ${i} has id ${ch.id}, the stream's is ${id} (mixed-up)`); return null; }
    if (ch.object !== object || ch.model !== NAME || ch.created !== chunks[0].created) { fail(kind, `${spec.name}: chunk ${i} object/model/created`); return null; }
    if (ch.usage) usage = ch.usage;
    if (!ch.choices.length) continue;
    const c = ch.choices[0];
    if (c.finish_reason) { nFinish++; o.finish = c.finish_reason; }
    if (spec.ep === 'chat') {
      if (i === 0 && c.delta.role !== 'assistant') { fail(kind, `${spec.name}: first chunk has no role`); return null; }
      o.content += c.delta.content ?? '';
      o.reasoning += c.delta.reasoning_content ?? '';
      for (const t of c.delta.tool_calls ?? []) o.tools.push(`${t.function.name}(${t.function.arguments})`);
      if (c.logprobs?.content) lp.push(...c.logprobs.content.map((e) => e.token));
    } else {
      o.content += c.text ?? '';
      if (c.logprobs?.tokens) lp.push(...c.logprobs.tokens);
    }
  }
  if (!checkId(kind, id, prefix)) return null;
  if (nFinish !== 1) { fail(kind, `${spec.name}: ${nFinish} finish_reason chunks (a cut or lost stream)`); return null; }
  if (includeUsage) {
    if (!usage) { fail(kind, `${spec.name}: no usage chunk`); return null; }
    if (chunks[chunks.length - 1].choices.length !== 0) { fail(kind, `${spec.name}: usage chunk not last`); return null; }
    o.prompt_tokens = usage.prompt_tokens;
    o.completion_tokens = usage.completion_tokens;
  }
  o.tools = o.tools.join(';');
  if (spec.body.logprobs !== undefined && spec.body.logprobs !== false) o.lp = lp.join('\u0001');
  return o;
}

// ---- 4. raw sockets ------------------------------------------------------------------

// Writes the steps (Buffer / string to send, {sleep: ms}, {close: true}) and
// collects what comes back until the server closes, `readBytes` arrive (then
// we close), or the timeout. Never rejects.
function raw(steps, { readBytes = Infinity, timeoutMs = 30000 } = {}) {
  return new Promise((resolve) => {
    const s = net.connect({ host: HOST, port: PORT });
    s.setNoDelay(true);
    const got = [];
    let n = 0, done = false, err = null, closedByUs = false;
    const finish = (how) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      s.destroy();
      resolve({ data: Buffer.concat(got), err, closedByUs, how });
    };
    const timer = setTimeout(() => { closedByUs = true; finish('timeout'); }, timeoutMs);
    s.on('data', (d) => { got.push(d); n += d.length; if (n >= readBytes) { closedByUs = true; finish('read enough'); } });
    s.on('error', (e) => { err = e.code || String(e); });
    s.on('close', () => finish('closed'));
    s.on('connect', async () => {
      for (const st of steps) {
        if (done) return;
        if (st && st.sleep !== undefined) await sleep(st.sleep);
        else if (st && st.close) { closedByUs = true; finish('we closed'); return; }
        else await new Promise((r) => s.write(st, () => r()));
      }
    });
  });
}

// HTTP/1.1 responses in a byte buffer (Content-Length or chunked bodies).
function parseResponses(buf) {
  const out = [];
  let at = 0;
  while (at < buf.length) {
    const he = buf.indexOf('\r\n\r\n', at);
    if (he < 0) break;
    const head = buf.subarray(at, he).toString('latin1').split('\r\n');
    const m = /^HTTP\/1\.[01] (\d{3})/.exec(head[0]);
    if (!m) break;
    const headers = {};
    for (const l of head.slice(1)) { const k = l.indexOf(':'); if (k > 0) headers[l.slice(0, k).toLowerCase()] = l.slice(k + 1).trim(); }
    let p = he + 4, body;
    if (headers['content-length'] !== undefined) {
      const len = Number(headers['content-length']);
      if (p + len > buf.length) { out.push({ status: Number(m[1]), headers, body: null, partial: true }); break; }
      body = buf.subarray(p, p + len);
      p += len;
    } else if (/chunked/i.test(headers['transfer-encoding'] ?? '')) {
      const parts = [];
      let complete = false;
      for (;;) {
        const le = buf.indexOf('\r\n', p);
        if (le < 0) break;
        const sz = parseInt(buf.subarray(p, le).toString('latin1'), 16);
        if (!(sz >= 0) || le + 2 + sz + 2 > buf.length) break;
        parts.push(buf.subarray(le + 2, le + 2 + sz));
        p = le + 2 + sz + 2;
        if (sz === 0) { complete = true; break; }
      }
      body = Buffer.concat(parts);
      if (!complete) { out.push({ status: Number(m[1]), headers, body, partial: true }); break; }
    } else {
      body = buf.subarray(p);
      p = buf.length;
    }
    out.push({ status: Number(m[1]), headers, body });
    at = p;
  }
  return out;
}

function httpHead(method, path, { length, extra = [], close = true, chunked = false } = {}) {
  const h = [`${method} ${path} HTTP/1.1`, `Host: ${HOST}:${PORT}`, `Authorization: Bearer ${KEY}`, 'Content-Type: application/json'];
  if (chunked) h.push('Transfer-Encoding: chunked');
  else if (length !== undefined) h.push(`Content-Length: ${length}`);
  if (close) h.push('Connection: close');
  return h.concat(extra).join('\r\n') + '\r\n\r\n';
}
const pathOf = (spec) => (spec.ep === 'chat' ? '/v1/chat/completions' : '/v1/completions');
function request(spec, { stream = false, close = true } = {}) {
  const body = JSON.stringify({ model: NAME, ...spec.body, ...(stream ? { stream: true } : {}) });
  return httpHead('POST', pathOf(spec), { length: Buffer.byteLength(body), close }) + body;
}

// A raw HTTP answer to a valid request: the expected outcome or a 429.
function checkRawAnswer(kind, spec, resp) {
  if (resp.status === 429) {
    const ra = Number(resp.headers['retry-after']);
    if (!(ra >= 1)) fail(kind, `429 without Retry-After`);
    else stat(kind).s429++;
    return;
  }
  if (resp.status !== 200 || resp.partial) { fail(kind, `${spec.name}: status ${resp.status}${resp.partial ? ' (cut short)' : ''} ${resp.body?.toString().slice(0, 160)}`); return; }
  let r;
  try { r = JSON.parse(resp.body.toString('utf8')); } catch (e) { fail(kind, `${spec.name}: body is not JSON: ${resp.body.toString().slice(0, 100)}`); return; }
  if (checkResponse(kind, spec, r)) stat(kind).ok++;
}

// ---- 5. the operations ---------------------------------------------------------------

const validSpec = () => pick(SPECS);
const withModel = (spec, extra = {}) => ({ model: NAME, ...spec.body, ...extra });
const endpoint = (spec) => (spec.ep === 'chat' ? client.chat.completions : client.completions);

async function opWhole(kind = 'whole') {
  const spec = validSpec();
  stat(kind).n++;
  try {
    const r = await endpoint(spec).create(withModel(spec));
    if (checkResponse(kind, spec, r)) stat(kind).ok++;
  } catch (e) { clientError(kind, spec, e); }
}

async function opStream() {
  const kind = 'stream';
  const spec = validSpec();
  const includeUsage = Math.random() < 0.5;
  stat(kind).n++;
  try {
    const s = await endpoint(spec).create(withModel(spec, { stream: true, ...(includeUsage ? { stream_options: { include_usage: true } } : {}) }));
    const chunks = [];
    for await (const ch of s) chunks.push(ch);
    const o = assembleStream(kind, spec, chunks, includeUsage);
    if (o && sameOutcome(kind, spec, o, { usage: includeUsage })) stat(kind).ok++;
  } catch (e) { clientError(kind, spec, e); }
}

// The client goes away mid-stream: after k chunks, or after a random time.
async function opStreamCut() {
  const kind = 'stream-disconnect';
  const spec = validSpec();
  stat(kind).n++;
  const ac = new AbortController();
  const byTime = Math.random() < 0.4;
  let timer = null;
  if (byTime) timer = setTimeout(() => ac.abort(), rnd(400));
  const k = rnd(12);
  try {
    const s = await endpoint(spec).create(withModel(spec, { stream: true }), { signal: ac.signal });
    const chunks = [];
    let ended = true;
    for await (const ch of s) {
      chunks.push(ch);
      if (!byTime && chunks.length > k) { ended = false; break; } // break aborts the request
    }
    if (ended && !ac.signal.aborted) { // it finished before our cut: then it must be whole and right
      const o = assembleStream(kind, spec, chunks, false);
      if (o && sameOutcome(kind, spec, o, { usage: false })) stat(kind).ok++;
    } else stat(kind).cut++;
  } catch (e) {
    if (e?.name === 'APIUserAbortError' || ac.signal.aborted) stat(kind).cut++;
    else clientError(kind, spec, e);
  } finally { clearTimeout(timer); }
}

// A non-streaming client that gives up while queued or generating.
async function opWholeCut() {
  const kind = 'whole-disconnect';
  const spec = validSpec();
  stat(kind).n++;
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), rnd(300));
  try {
    const r = await endpoint(spec).create(withModel(spec), { signal: ac.signal });
    if (checkResponse(kind, spec, r)) stat(kind).ok++;
  } catch (e) {
    if (e?.name === 'APIUserAbortError' || ac.signal.aborted) stat(kind).cut++;
    else clientError(kind, spec, e);
  } finally { clearTimeout(timer); }
}

// More simultaneous requests than the FIFO holds: each answer is right or a 429.
async function opBurst() {
  const kind = 'burst';
  const n = QUEUE + 2 + rnd(5);
  await Promise.all(Array.from({ length: n }, () => opWhole(kind)));
}

const hello = [{ role: 'user', content: 'hi' }];
const deep = '['.repeat(5000) + ']'.repeat(5000);
// Bodies a server must refuse with a 4xx and an OpenAI error object (param where it names one).
const BAD = [
  { n: 'truncated JSON', p: '/v1/chat/completions', b: '{"model": "m", "messages": [', s: 400 },
  { n: 'not JSON', p: '/v1/completions', b: 'hello world', s: 400 },
  { n: 'not an object', p: '/v1/chat/completions', b: '[1, 2, 3]', s: 400 },
  { n: 'empty body', p: '/v1/completions', b: '', s: 400 },
  { n: 'duplicate keys', p: '/v1/completions', b: '{"prompt": "a", "prompt": "b"}', s: 400 },
  { n: 'deep nesting', p: '/v1/completions', b: `{"prompt": ${deep}}`, s: 400 },
  { n: 'NUL in a string', p: '/v1/completions', b: '{"prompt": "a\\u0000b"}', s: 400 },
  { n: 'invalid UTF-8', p: '/v1/completions', b: Buffer.from([0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]), s: 400 },
  { n: 'huge number', p: '/v1/completions', b: '{"prompt": "a", "max_tokens": 1e400}', s: 400 },
  { n: 'NaN', p: '/v1/completions', b: '{"prompt": "a", "temperature": NaN}', s: 400 },
  { n: 'temperature string', p: '/v1/chat/completions', b: { messages: hello, temperature: 'hot' }, s: 400, param: 'temperature' },
  { n: 'temperature range', p: '/v1/completions', b: { prompt: 'a', temperature: 7 }, s: 400, param: 'temperature' },
  { n: 'max_tokens string', p: '/v1/chat/completions', b: { messages: hello, max_tokens: '5' }, s: 400, param: 'max_tokens' },
  { n: 'max_tokens 0', p: '/v1/completions', b: { prompt: 'a', max_tokens: 0 }, s: 400, param: 'max_tokens' },
  { n: 'max_tokens above the ceiling', p: '/v1/completions', b: { prompt: 'a', max_tokens: CEILING + 1 }, s: 400, param: 'max_tokens' },
  { n: 'max_tokens float', p: '/v1/completions', b: { prompt: 'a', max_tokens: 2.5 }, s: 400, param: 'max_tokens' },
  { n: 'stream 1', p: '/v1/completions', b: { prompt: 'x', stream: 1 }, s: 400, param: 'stream' },
  { n: 'stream_options without stream', p: '/v1/completions', b: { prompt: 'x', stream_options: { include_usage: true } }, s: 400, param: 'stream_options' },
  { n: 'stream_options unknown', p: '/v1/completions', b: { prompt: 'x', stream: true, stream_options: { frob: 1 } }, s: 400, param: 'stream_options.frob' },
  { n: 'messages string', p: '/v1/chat/completions', b: { messages: 'hi' }, s: 400, param: 'messages' },
  { n: 'messages empty', p: '/v1/chat/completions', b: { messages: [] }, s: 400, param: 'messages' },
  { n: 'messages missing', p: '/v1/chat/completions', b: { model: 'm' }, s: 400, param: 'messages' },
  { n: 'message not an object', p: '/v1/chat/completions', b: { messages: [5] }, s: 400, param: 'messages[0]' },
  { n: 'bad role', p: '/v1/chat/completions', b: { messages: [{ role: 'wizard', content: 'x' }] }, s: 400, param: 'messages[0].role' },
  { n: 'image part', p: '/v1/chat/completions', b: { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }, s: 400, param: 'messages[0].content[0].type' },
  { n: 'tool without id', p: '/v1/chat/completions', b: { messages: [{ role: 'tool', content: 'x' }] }, s: 400, param: 'messages[0].tool_call_id' },
  { n: 'prompt missing', p: '/v1/completions', b: { max_tokens: 3 }, s: 400, param: 'prompt' },
  { n: 'prompt object', p: '/v1/completions', b: { prompt: { a: 1 } }, s: 400, param: 'prompt' },
  { n: 'prompt empty', p: '/v1/completions', b: { prompt: '' }, s: 400, param: 'prompt' },
  { n: 'prompt token out of vocab', p: '/v1/completions', b: { prompt: [1, 2, 10 ** 9] }, s: 400, param: 'prompt' },
  { n: 'prompt negative token', p: '/v1/completions', b: { prompt: [1, -2] }, s: 400, param: 'prompt' },
  { n: 'two prompts', p: '/v1/completions', b: { prompt: ['a', 'b'] }, s: 400, param: 'prompt' },
  { n: 'prompt past the context', p: '/v1/completions', b: { prompt: ids(CTX + 10, 7), max_tokens: 4 }, s: 400, param: 'prompt' },
  { n: 'prompt + max_tokens past the context', p: '/v1/completions', b: { prompt: ids(CTX - 5, 7), max_tokens: 10 }, s: 400, param: 'prompt' },
  { n: 'text prompt past the context', p: '/v1/completions', b: { prompt: 'word '.repeat(12000) }, s: 400, param: 'prompt' },
  { n: 'thousands of messages', p: '/v1/chat/completions', b: { messages: Array.from({ length: 1500 }, () => ({ role: 'user', content: 'x' })) }, s: 400, param: 'messages' },
  { n: 'lone surrogate', p: '/v1/completions', b: '{"prompt": "a\\ud800b"}', s: 400 },
  { n: 'unknown field', p: '/v1/completions', b: { prompt: 'x', wibble: true }, s: 400, param: 'wibble' },
  { n: 'unknown chat field', p: '/v1/chat/completions', b: { messages: hello, functions: [] }, s: 400, param: 'functions' },
  { n: 'n = 2', p: '/v1/chat/completions', b: { messages: hello, n: 2 }, s: 400, param: 'n' },
  { n: 'n = 0', p: '/v1/completions', b: { prompt: 'a', n: 0 }, s: 400, param: 'n' },
  { n: 'best_of 3', p: '/v1/completions', b: { prompt: 'a', best_of: 3 }, s: 400, param: 'best_of' },
  { n: 'stop not strings', p: '/v1/completions', b: { prompt: 'a', stop: [1] }, s: 400, param: 'stop' },
  { n: 'too many stops', p: '/v1/completions', b: { prompt: 'a', stop: ['a', 'b', 'c', 'd', 'e'] }, s: 400, param: 'stop' },
  { n: 'logit_bias array', p: '/v1/completions', b: { prompt: 'a', logit_bias: [1] }, s: 400, param: 'logit_bias' },
  { n: 'logit_bias key', p: '/v1/completions', b: { prompt: 'a', logit_bias: { abc: 1 } }, s: 400, param: 'logit_bias' },
  { n: 'logit_bias value', p: '/v1/completions', b: { prompt: 'a', logit_bias: { 5: 1000 } }, s: 400, param: 'logit_bias' },
  { n: 'seed float', p: '/v1/completions', b: { prompt: 'a', seed: 1.5 }, s: 400, param: 'seed' },
  { n: 'logprobs bool on completions', p: '/v1/completions', b: { prompt: 'a', logprobs: true }, s: 400, param: 'logprobs' },
  { n: 'top_logprobs without logprobs', p: '/v1/chat/completions', b: { messages: hello, top_logprobs: 2 }, s: 400, param: 'top_logprobs' },
  { n: 'tool_choice required', p: '/v1/chat/completions', b: { messages: hello, tools, tool_choice: 'required' }, s: 400, param: 'tool_choice' },
  { n: 'tools not an array', p: '/v1/chat/completions', b: { messages: hello, tools: {} }, s: 400, param: 'tools' },
  { n: 'response_format json', p: '/v1/chat/completions', b: { messages: hello, response_format: { type: 'json_object' } }, s: 400, param: 'response_format' },
  { n: 'reasoning_effort', p: '/v1/chat/completions', b: { messages: hello, reasoning_effort: 'extreme' }, s: 400, param: 'reasoning_effort' },
  { n: 'model number', p: '/v1/completions', b: { prompt: 'a', model: 5 }, s: 400, param: 'model' },
  { n: 'suffix', p: '/v1/completions', b: { prompt: 'a', suffix: 'z' }, s: 400, param: 'suffix' },
  { n: 'no API key', p: '/v1/completions', b: { prompt: 'a' }, s: 401, key: null },
  { n: 'wrong API key', p: '/v1/chat/completions', b: { messages: hello }, s: 401, key: 'nope' },
  { n: 'unknown route', p: '/v1/nothing', b: {}, s: 404 },
  { n: 'GET on a POST route', p: '/v1/completions', method: 'GET', s: 405 },
  { n: 'DELETE on models', p: '/v1/models', method: 'DELETE', s: 405 },
  { n: 'unknown model', p: '/v1/models/gpt-4', method: 'GET', s: 404, param: 'model' },
];

async function opBad() {
  const kind = 'malformed';
  const c = pick(BAD);
  stat(kind).n++;
  const headers = { 'content-type': 'application/json' };
  const key = c.key === undefined ? KEY : c.key;
  if (key) headers.authorization = `Bearer ${key}`;
  const method = c.method ?? 'POST';
  const body = method === 'POST' ? (typeof c.b === 'string' || Buffer.isBuffer(c.b) ? c.b : JSON.stringify(c.b)) : undefined;
  let r, text;
  try {
    r = await fetch(`${URL_BASE}${c.p}`, { method, headers, body, signal: AbortSignal.timeout(OP_TIMEOUT_MS) });
    text = await r.text();
  } catch (e) { fail(kind, `${c.n}: ${e?.cause?.code ?? e?.message ?? e}`); return; }
  if (r.status !== c.s) { fail(kind, `${c.n}: status ${r.status}, expected ${c.s}: ${text.slice(0, 160)}`); return; }
  let j;
  try { j = JSON.parse(text); } catch { fail(kind, `${c.n}: error body is not JSON: ${text.slice(0, 100)}`); return; }
  const e = j.error;
  if (!e || typeof e.message !== 'string' || typeof e.type !== 'string' || !('param' in e) || !('code' in e)) { fail(kind, `${c.n}: not an OpenAI error object: ${text.slice(0, 160)}`); return; }
  if (c.param && e.param !== c.param) { fail(kind, `${c.n}: param ${e.param}, expected ${c.param}`); return; }
  stat(kind).ok++;
}

// Oversized bodies: a Content-Length past the limit, a chunked body past it.
async function opBig() {
  const kind = 'oversized';
  stat(kind).n++;
  const which = rnd(4);
  const size = MAX_BODY + 1 + rnd(4 * MAX_BODY);
  const filler = `{"prompt": "${'a'.repeat(size)}"}`;
  let res;
  if (which === 0) { // the claim alone, with Expect: 100-continue: answered before any body
    res = await raw([httpHead('POST', '/v1/completions', { length: 10 ** 12, extra: ['Expect: 100-continue'] })]);
  } else if (which === 1) { // the whole body with a Content-Length
    res = await raw([httpHead('POST', '/v1/completions', { length: Buffer.byteLength(filler) }), filler]);
  } else if (which === 2) { // chunked, no Content-Length: only the count says it is too big
    const steps = [httpHead('POST', '/v1/chat/completions', { chunked: true })];
    for (let at = 0; at < filler.length; at += 8192) {
      const part = filler.slice(at, at + 8192);
      steps.push(`${Buffer.byteLength(part).toString(16)}\r\n${part}\r\n`);
    }
    steps.push('0\r\n\r\n');
    res = await raw(steps);
  } else { // through fetch, as a client library sends it
    try {
      const r = await fetch(`${URL_BASE}/v1/completions`, { method: 'POST', headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' }, body: filler, signal: AbortSignal.timeout(OP_TIMEOUT_MS) });
      await r.text();
      if (r.status === 413) stat(kind).ok++;
      else fail(kind, `fetch: status ${r.status}`);
    } catch (e) {
      // the server may answer 413 and close before the body is sent: a reset is not a lost answer
      if (['ECONNRESET', 'EPIPE', 'UND_ERR_SOCKET'].includes(e?.cause?.code)) stat(kind).cut++;
      else fail(kind, `fetch: ${e?.cause?.code ?? e?.message}`);
    }
    return;
  }
  const rs = parseResponses(res.data);
  if (rs.length && rs[0].status === 413) stat(kind).ok++;
  else if (!rs.length && (res.err === 'ECONNRESET' || res.err === 'EPIPE')) stat(kind).cut++;
  else fail(kind, `variant ${which}: ${rs.length ? rs[0].status : 'no answer'} (${res.how}, ${res.err})`);
}

// Clients that misbehave at the socket level.
async function opRaw() {
  const which = rnd(8);
  const kind = ['raw-headers-then-close', 'raw-half-body-then-close', 'raw-stream-cut', 'raw-close-after-request',
    'raw-pipelined', 'raw-garbage', 'raw-header-flood', 'raw-slow-body'][which];
  stat(kind).n++;
  const spec = validSpec();
  if (which === 0) {
    await raw([httpHead('POST', pathOf(spec), { length: 100 }), { sleep: rnd(200) }, { close: true }]);
    stat(kind).cut++;
  } else if (which === 1) {
    const body = JSON.stringify(withModel(spec));
    await raw([httpHead('POST', pathOf(spec), { length: body.length }), body.slice(0, body.length >> 1), { sleep: rnd(200) }, { close: true }]);
    stat(kind).cut++;
  } else if (which === 2) {
    const res = await raw([request(spec, { stream: true })], { readBytes: 1 + rnd(3000) });
    if (res.closedByUs) stat(kind).cut++;
    else { // the whole stream came before our cut: it must be a whole, right one
      const rs = parseResponses(res.data);
      if (rs.length !== 1 || rs[0].partial) fail(kind, `${spec.name}: stream ended early (${res.how}, ${res.err}, ${res.data.length} bytes)`);
      else checkSse(kind, spec, rs[0]);
    }
  } else if (which === 3) {
    await raw([request(spec), { sleep: rnd(150) }, { close: true }]);
    stat(kind).cut++;
  } else if (which === 4) { // three requests in one write; answers in order
    const specs = [spec, validSpec(), validSpec()];
    const res = await raw([request(specs[0], { close: false }) + request(specs[1], { close: false }) + request(specs[2])], { timeoutMs: OP_TIMEOUT_MS });
    const rs = parseResponses(res.data);
    if (rs.length !== 3) { fail(kind, `${rs.length} of 3 pipelined answers (${res.how}, ${res.err})`); return; }
    for (let i = 0; i < 3; i++) checkRawAnswer(kind, specs[i], rs[i]);
    stat(kind).n += 2;
  } else if (which === 5) {
    const junk = pick([
      'GARBAGE\r\n\r\n', 'POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n', 'POST\r\n\r\n',
      `POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\nConnection: close\r\n\r\n`,
      `POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n`,
      `POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nfffffffffffffff\r\nabc`,
      Buffer.from(Array.from({ length: 300 }, () => rnd(256))),
    ]);
    const res = await raw([junk], { timeoutMs: 5000 });
    const rs = parseResponses(res.data);
    // an answer must be a 4xx (505 for a version it does not speak); silence that ends in a close is fine
    if (rs.length && (rs[0].status < 400 || rs[0].status > 499) && rs[0].status !== 505) fail(kind, `status ${rs[0].status} for ${JSON.stringify(junk.toString().slice(0, 40))}`);
    else stat(kind).ok++;
  } else if (which === 6) {
    const flood = Array.from({ length: 400 }, (_, i) => `X-Flood-${i}: ${'v'.repeat(200)}`);
    const res = await raw([httpHead('GET', '/health', { extra: flood })], { timeoutMs: 10000 });
    const rs = parseResponses(res.data);
    if (rs.length && (rs[0].status < 400 || rs[0].status > 499)) fail(kind, `status ${rs[0].status}`);
    else stat(kind).ok++;
  } else { // a slow but honest client
    const body = JSON.stringify(withModel(spec));
    const a = body.length / 3 | 0;
    const res = await raw([httpHead('POST', pathOf(spec), { length: Buffer.byteLength(body) }), body.slice(0, a), { sleep: 50 + rnd(200) },
      body.slice(a, 2 * a), { sleep: 50 + rnd(200) }, body.slice(2 * a)], { timeoutMs: OP_TIMEOUT_MS });
    const rs = parseResponses(res.data);
    if (rs.length !== 1) fail(kind, `${spec.name}: ${rs.length} answers (${res.how}, ${res.err})`);
    else checkRawAnswer(kind, spec, rs[0]);
  }
}

// A whole SSE body read from a raw socket: data lines, [DONE] last.
function checkSse(kind, spec, resp) {
  if (resp.status === 429) { stat(kind).s429++; return; }
  if (resp.status !== 200) { fail(kind, `${spec.name}: status ${resp.status}`); return; }
  const text = resp.body.toString('utf8');
  if (!text.endsWith('data: [DONE]\n\n')) { fail(kind, `${spec.name}: SSE without [DONE] at the end: ${JSON.stringify(text.slice(-80))}`); return; }
  const events = text.split('\n\n').filter((e) => e && e !== 'data: [DONE]');
  let chunks;
  try { chunks = events.map((e) => JSON.parse(e.replace(/^data: /, ''))); } catch { fail(kind, `${spec.name}: an SSE event is not JSON`); return; }
  const o = assembleStream(kind, spec, chunks, false);
  if (o && sameOutcome(kind, spec, o, { usage: false })) stat(kind).ok++;
}

async function opInfo() {
  const kind = 'info';
  stat(kind).n++;
  const which = rnd(3);
  const path = ['/health', '/metrics', '/v1/models'][which];
  try {
    const r = await fetch(`${URL_BASE}${path}`, { headers: { authorization: `Bearer ${KEY}` }, signal: AbortSignal.timeout(OP_TIMEOUT_MS) });
    const t = await r.text();
    if (r.status !== 200) fail(kind, `${path}: ${r.status}`);
    else if (which === 2 && !t.includes(NAME)) fail(kind, `${path}: ${t.slice(0, 80)}`);
    else stat(kind).ok++;
  } catch (e) { fail(kind, `${path}: ${e?.message}`); }
}

const OPS = [
  [opStream, 26], [opWhole, 16], [opStreamCut, 12], [opWholeCut, 5], [opBurst, 3],
  [opBad, 18], [opBig, 5], [opRaw, 12], [opInfo, 3],
];
const OP_TOTAL = OPS.reduce((a, [, w]) => a + w, 0);
function pickOp() {
  let x = Math.random() * OP_TOTAL;
  for (const [f, w] of OPS) { if ((x -= w) < 0) return f; }
  return OPS[0][0];
}

// ---- 6. sampling ---------------------------------------------------------------------

function sampleServer() {
  try {
    const st = readFileSync(`/proc/${PID}/status`, 'utf8');
    const rss = Number(/VmRSS:\s+(\d+)/.exec(st)[1]) / 1024;
    const threads = Number(/Threads:\s+(\d+)/.exec(st)[1]);
    const fds = readdirSync(`/proc/${PID}/fd`).length;
    return { rss, fds, threads };
  } catch { return null; }
}

// The server's descriptors by kind ("socket 3, file 5, ..."), for the report.
function fdKinds() {
  const k = {};
  try {
    for (const fd of readdirSync(`/proc/${PID}/fd`)) {
      let t;
      try { t = readlinkSync(`/proc/${PID}/fd/${fd}`); } catch { continue; }
      const kind = t.startsWith('socket:') ? 'socket' : t.startsWith('pipe:') ? 'pipe' : t.startsWith('anon_inode:') ? t.slice(11).replace(/[[\]]/g, '') : 'file';
      k[kind] = (k[kind] ?? 0) + 1;
    }
  } catch { return '-'; }
  return Object.entries(k).sort().map(([a, b]) => `${a} ${b}`).join(', ');
}

async function metricsText() {
  try { return await (await fetch(`${URL_BASE}/metrics`, { signal: AbortSignal.timeout(10000) })).text(); } catch { return ''; }
}
const metric = (text, re) => { const m = re.exec(text); return m ? Number(m[1]) : NaN; };

// Waits until the server's descriptors and threads are at most `want` (or,
// want null, unchanged) for `stable` half-second samples; the last sample.
async function settle(want, maxS, stable = 4) {
  let last = null, same = 0;
  for (let i = 0; i < maxS * 2; i++) {
    await sleep(500);
    const s = sampleServer();
    if (!s) return null;
    if (want ? s.fds <= want.fds && s.threads <= want.threads : last && s.fds === last.fds && s.threads === last.threads) {
      if (++same >= stable) return s;
    } else same = 0;
    last = s;
  }
  return last;
}

const median = (a) => { const b = [...a].sort((x, y) => x - y); return b.length ? (b.length % 2 ? b[b.length >> 1] : (b[b.length / 2 - 1] + b[b.length / 2]) / 2) : NaN; };

// ---- 7. the run and the verdict ------------------------------------------------------

async function main() {
  console.log(`# soak: ${SECONDS} s, ${CLIENTS} clients, server pid ${PID} at ${URL_BASE}, queue ${QUEUE}, body limit ${MAX_BODY}, ctx ${CTX}`);
  // the oracle: each valid request alone, whole; then alone, streamed, must agree
  for (const spec of SPECS) {
    const r = await endpoint(spec).create(withModel(spec));
    expected.set(spec.name, outcomeOfResponse(spec, r));
    checkResponse('oracle', spec, r);
    const s = await endpoint(spec).create(withModel(spec, { stream: true, stream_options: { include_usage: true } }));
    const chunks = [];
    for await (const ch of s) chunks.push(ch);
    const o = assembleStream('oracle', spec, chunks, true);
    if (o) sameOutcome('oracle', spec, o);
  }
  const exp = [...expected.entries()].map(([k, v]) => `${k}=${v.completion_tokens}t/${v.finish}`).join(' ');
  console.log(`# oracle: ${SPECS.length} requests, solo whole and streamed agree${nFail ? ' NOT' : ''}: ${exp}`);
  const base = await settle(null, 40, 14); // stable for 7 s: the clients' keep-alive sockets (4 s) are closed
  if (!base) { console.log('verdict: FAIL the server died before the load'); process.exit(1); }
  console.log(`# idle baseline: RSS ${base.rss.toFixed(1)} MB, ${base.fds} fds (${fdKinds()}), ${base.threads} threads`);
  console.log('     t_s   rss_mb   fds  threads   requests   ok   429   cut  fail');

  const t0 = Date.now(), end = t0 + SECONDS * 1000;
  const samples = [];
  let crashed = false;
  const total = () => { let n = 0, ok = 0, s429 = 0, cut = 0; for (const v of stats.values()) { n += v.n; ok += v.ok; s429 += v.s429; cut += v.cut; } return { n, ok, s429, cut }; };
  const tick = () => {
    const s = sampleServer();
    const t = (Date.now() - t0) / 1000;
    if (!s) { crashed = true; console.log(`${t.toFixed(0).padStart(8)}   server process gone`); return; }
    samples.push({ t, ...s });
    const c = total();
    console.log(`${t.toFixed(0).padStart(8)} ${s.rss.toFixed(1).padStart(8)} ${String(s.fds).padStart(5)} ${String(s.threads).padStart(8)} ${String(c.n).padStart(10)} ${String(c.ok).padStart(5)} ${String(c.s429).padStart(5)} ${String(c.cut).padStart(5)} ${String(nFail).padStart(5)}`);
  };
  const sampler = setInterval(tick, SAMPLE_S * 1000);
  let lost = 0;
  const worker = async () => {
    while (Date.now() < end && !crashed) {
      const op = pickOp();
      const busy0 = total().s429;
      let timer;
      const guard = new Promise((r) => { timer = setTimeout(() => r('lost'), OP_TIMEOUT_MS + 10000); });
      const v = await Promise.race([op().catch((e) => { fail(op.name, `threw ${e?.stack ?? e}`); }), guard]);
      clearTimeout(timer);
      if (v === 'lost') { lost++; fail(op.name, `no answer within ${OP_TIMEOUT_MS / 1000 + 10} s (lost)`); }
      if (total().s429 > busy0) await sleep(100 + rnd(300)); // told to come back later: a short pause
    }
  };
  await Promise.all(Array.from({ length: CLIENTS }, worker));
  clearInterval(sampler);
  tick();

  // idle again: every descriptor and thread of the load must be gone
  const idle = crashed ? null : await settle(base, 60);
  const idleKinds = idle ? fdKinds() : '';
  const mt = crashed ? '' : await metricsText();
  const srv429 = metric(mt, /^deltafin_requests_rejected_total (\d+)/m);
  const srvCancelled = metric(mt, /^deltafin_requests_cancelled_total (\d+)/m);
  const srvTokens = metric(mt, /^deltafin_generation_tokens_total (\d+)/m);

  console.log('\n# requests by kind');
  console.log('  kind                          sent      ok    429    cut   fail');
  const c = total();
  for (const [k, v] of [...stats.entries()].sort()) {
    if (k === 'oracle') continue;
    console.log(`  ${k.padEnd(28)} ${String(v.n).padStart(6)} ${String(v.ok).padStart(7)} ${String(v.s429).padStart(6)} ${String(v.cut).padStart(6)} ${String(v.bad).padStart(6)}`);
  }
  console.log(`  ${'all'.padEnd(28)} ${String(c.n).padStart(6)} ${String(c.ok).padStart(7)} ${String(c.s429).padStart(6)} ${String(c.cut).padStart(6)} ${String(nFail).padStart(6)}`);
  console.log(`# server metrics: ${srv429} rejected (429), ${srvCancelled} generations cancelled (client gone), ${srvTokens} tokens generated; distinct response ids ${idsSeen.size}`);
  const verdicts = [];
  let ok = nFail === 0 && !crashed && lost === 0;
  if (crashed) verdicts.push('server CRASHED');
  // nobody else talks to this server; a client that cut its request may not have read its 429
  if (!crashed && !(srv429 >= c.s429 && srv429 <= c.s429 + c.cut)) {
    verdicts.push(`429 count differs: server ${srv429}, clients ${c.s429} (+ up to ${c.cut} cut)`);
    ok = false;
  }
  // flat: the last quarter's median against the second quarter's
  const q = (k, from, to) => samples.filter((s) => s.t >= SECONDS * from && s.t < SECONDS * to + 1).map((s) => s[k]);
  if (samples.length >= 4) {
    const r2 = median(q('rss', 0.25, 0.5)), r4 = median(q('rss', 0.75, 1.0));
    const f2 = median(q('fds', 0.25, 0.5)), f4 = median(q('fds', 0.75, 1.0));
    const rssMax = Math.max(...samples.map((s) => s.rss)), fdMax = Math.max(...samples.map((s) => s.fds));
    const rssFlat = r4 <= r2 * (1 + RSS_TOL_PCT / 100) + RSS_TOL_MB;
    const fdFlat = f4 <= f2 + CLIENTS + QUEUE + 8;
    console.log(`# RSS MB: baseline ${base.rss.toFixed(1)}, 2nd-quarter median ${r2.toFixed(1)}, last-quarter median ${r4.toFixed(1)}, max ${rssMax.toFixed(1)}, idle at end ${idle ? idle.rss.toFixed(1) : '-'}` +
      ` -> ${rssFlat ? 'flat' : 'GROWS'} (tolerance ${RSS_TOL_PCT}% + ${RSS_TOL_MB} MB)${RSS_JUDGE ? '' : ' [not judged]'}`);
    console.log(`# fds: baseline ${base.fds}, 2nd-quarter median ${f2}, last-quarter median ${f4}, max ${fdMax}, idle at end ${idle ? idle.fds : '-'}` +
      `${idle ? ` (${idleKinds})` : ''}; threads: baseline ${base.threads}, idle at end ${idle ? idle.threads : '-'}`);
    if (!rssFlat && RSS_JUDGE) { ok = false; verdicts.push('RSS grows'); }
    if (!fdFlat) { ok = false; verdicts.push('fds grow under load'); }
  } else verdicts.push('too few samples to judge flatness');
  if (idle && (idle.fds > base.fds || idle.threads > base.threads)) {
    ok = false;
    verdicts.push(`not back to baseline when idle: ${idle.fds} fds (baseline ${base.fds}), ${idle.threads} threads (baseline ${base.threads})`);
  }
  if (lost) verdicts.push(`${lost} lost`);
  if (failures.length) {
    console.log(`\n# failures (${nFail}; the first ${failures.length}):`);
    for (const f of failures) console.log(`  ${f}`);
  }
  console.log(`\nverdict: ${ok ? 'PASS' : 'FAIL'} — ${c.n} requests in ${SECONDS} s, ${c.ok} answered and right, ${c.s429} 429s, ${c.cut} cut by the client, ` +
    `${nFail} wrong/lost${verdicts.length ? '; ' + verdicts.join('; ') : ''}`);
  process.exit(ok ? 0 : 1);
}

main().catch((e) => { console.log(`verdict: FAIL — the soak itself failed: ${e?.stack ?? e}`); process.exit(1); });
