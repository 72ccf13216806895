// End-to-end test of the mlxgate web console in a real browser (Chromium
// through playwright-core), driving the UI the way a person does: clicks
// and typing, against a running gateway.
//
//   NODE_PATH=/work/main/.deps/console/node_modules node tests/console/e2e.cjs
//
// Environment:
//   CONSOLE_URL         the console, e.g. http://127.0.0.1:18080/console/
//   ADMIN_KEY           key with infer + jobs + admin
//   INFER_KEY           key with infer only
//   SCREENSHOT_DIR      where signin.png, chat.png, jobs.png, job-finetune.png,
//                       policies.png, resources.png, metrics.png are written
//   MODEL_ID            the served chat model's id
//   ROUTER_WASM         a valid router component (local path)
//   ROUTER_QUERY        extra upload query for it (e.g. config=...), may be empty
//   BAD_WASM            a file that is not a valid component
//   TRANSFORM_WASM      alpaca_to_chat.wasm (dataset-transform)
//   DATASET_INPUT       server-side path of a small alpaca JSONL (under [jobs] allowed_paths)
//   DATASET_OUTPUT_DIR  server-side folder for the dataset job's output (a fresh subfolder is used)
//   FINETUNE_MODEL      server-side path of the model to fine-tune
//   FINETUNE_DATA       server-side folder with train.jsonl (and valid.jsonl)
// Optional: CHROMIUM (default /usr/bin/chromium), JOB_TIMEOUT_MS (default
// 90000), FINETUNE_TIMEOUT_MS (default 300000), FINETUNE_MAX_SEQ_LEN.
//
// Prints one line per check; exits 1 at the first failure with the browser's
// console errors and page errors; prints `all console checks passed` at the end.

'use strict';

const fs = require('fs');
const path = require('path');
const { chromium } = require('playwright-core');

const REQUIRED = [
  'CONSOLE_URL', 'ADMIN_KEY', 'INFER_KEY', 'SCREENSHOT_DIR', 'MODEL_ID', 'ROUTER_WASM', 'BAD_WASM',
  'TRANSFORM_WASM', 'DATASET_INPUT', 'DATASET_OUTPUT_DIR', 'FINETUNE_MODEL', 'FINETUNE_DATA',
];
const env = process.env;
const missing = REQUIRED.filter((k) => !env[k]);
if (missing.length) {
  console.error(`FAIL: missing environment: ${missing.join(', ')}`);
  process.exit(2);
}
for (const k of ['ROUTER_WASM', 'BAD_WASM', 'TRANSFORM_WASM']) {
  if (!fs.existsSync(env[k])) {
    console.error(`FAIL: ${k}=${env[k]} does not exist`);
    process.exit(2);
  }
}
const URL_ = env.CONSOLE_URL.endsWith('/') ? env.CONSOLE_URL : `${env.CONSOLE_URL}/`;
const ORIGIN = new URL(URL_).origin;
const SHOTS = env.SCREENSHOT_DIR;
const JOB_TIMEOUT = Number(env.JOB_TIMEOUT_MS || 90000);
const FT_TIMEOUT = Number(env.FINETUNE_TIMEOUT_MS || 300000);
const RUN = Date.now().toString(36);
fs.mkdirSync(SHOTS, { recursive: true });

const consoleErrors = [];
const pageErrors = [];
let browser;
let page;

function tid(id) {
  return `[data-testid="${id}"]`;
}

class CheckFailed extends Error {}

function assert(cond, msg) {
  if (!cond) throw new CheckFailed(msg);
}

async function finish(code, why) {
  if (why) {
    console.error(`\nFAIL: ${why}`);
    console.error(`\nbrowser console errors (${consoleErrors.length}):`);
    for (const e of consoleErrors.slice(-30)) console.error(`  ${e}`);
    console.error(`page errors (${pageErrors.length}):`);
    for (const e of pageErrors.slice(-30)) console.error(`  ${e}`);
    if (page) {
      const shot = path.join(SHOTS, 'failure.png');
      await page.screenshot({ path: shot, fullPage: true }).catch(() => {});
      console.error(`screenshot of the failure: ${shot}`);
    }
  }
  if (browser) await browser.close().catch(() => {});
  process.exit(code);
}

/** Runs one check; the first failure ends the run. */
async function check(name, fn) {
  const t0 = Date.now();
  try {
    const note = await fn();
    console.log(`ok   ${name} (${((Date.now() - t0) / 1000).toFixed(1)} s)${note ? ` — ${note}` : ''}`);
  } catch (e) {
    await finish(1, `${name}: ${e && e.message ? e.message : e}`);
  }
}

// Every page is screenshotted once it is done; none may show the app's
// "unexpected error" banner (an uncaught error the page itself caught).
async function shot(name) {
  await page.screenshot({ path: path.join(SHOTS, name), fullPage: true });
  const banner = page.locator(tid('global-error'));
  if (await banner.count()) {
    throw new Error(`${name}: the page shows an unexpected error: ${await banner.first().innerText()}`);
  }
}

async function go(pageId) {
  await page.click(tid(`nav-${pageId}`));
  await page.locator(tid(`page-${pageId}`)).waitFor({ timeout: 10000 });
}

async function signIn(key) {
  await page.locator(tid('signin-key')).fill(key);
  await page.click(tid('signin-submit'));
  await page.locator(tid('nav')).waitFor({ timeout: 10000 });
}

/** A number from a data attribute, 0 when absent. */
async function dataNum(selector, attr) {
  const v = await page.locator(selector).first().getAttribute(attr);
  return Number(v || 0);
}

/** Waits until the last assistant message has finished streaming; returns it. */
async function waitAnswer(timeout = 60000) {
  const last = page.locator(`${tid('chat-msg-assistant')}[data-last="true"]`);
  await page.locator(`${tid('chat-msg-assistant')}[data-last="true"][data-streaming="false"]`).waitFor({ timeout });
  return last;
}

/** Waits until a select offers `value` (by the option's value property: Preact may not write the attribute). */
async function waitOption(testid, value, timeout = 15000) {
  await page.waitForFunction(
    ([sel, v]) => {
      const el = document.querySelector(sel);
      return !!el && [...el.options].some((o) => o.value === v);
    },
    [tid(testid), value],
    { timeout },
  );
}

async function sendChat(text, maxTokens) {
  await page.locator(tid('chat-max-tokens')).fill(String(maxTokens));
  await page.locator(tid('chat-input')).fill(text);
  await page.click(tid('chat-send'));
}

/** Fills a job form field by name (text inputs, selects, checkboxes). */
async function jobField(name, value) {
  const el = page.locator(tid(`job-field-${name}`));
  const tag = await el.evaluate((n) => n.tagName.toLowerCase() + (n.type === 'checkbox' ? ':checkbox' : ''));
  if (tag === 'select') await el.selectOption(String(value));
  else if (tag === 'input:checkbox') await el.setChecked(!!value);
  else await el.fill(String(value));
}

async function submitJob(kind, fields) {
  await go('jobs');
  await page.click(tid(`job-kind-${kind}`));
  for (const [k, v] of Object.entries(fields)) await jobField(k, v);
  await page.click(tid('job-submit'));
}

/** After a submit: the job page's id (the app navigates to #/jobs/<id>). */
async function jobPageId() {
  await page.waitForURL(/#\/jobs\/[^/]+$/, { timeout: 15000 });
  await page.locator(tid('job-page')).waitFor({ timeout: 10000 });
  return page.locator(tid('job-page')).getAttribute('data-id');
}

async function waitJobFinal(timeout) {
  await page.waitForFunction(
    (sel) => {
      const s = document.querySelector(sel);
      return s && ['done', 'failed', 'cancelled', 'zombie'].includes(s.dataset.status);
    },
    tid('job-status'),
    { timeout, polling: 250 },
  );
  return page.locator(tid('job-status')).getAttribute('data-status');
}

async function uploadPolicy({ file, name, kind, query = '', config = '' }) {
  await go('policies');
  await page.locator(tid('policy-file')).setInputFiles(file);
  await page.locator(tid('policy-name')).fill(name);
  await page.locator(tid('policy-kind')).selectOption(kind);
  await page.locator(tid('policy-config')).fill(config);
  await page.locator(tid('policy-query')).fill(query);
  const resp = page.waitForResponse((r) => r.request().method() === 'PUT' && r.url().includes('/admin/policies/'), { timeout: 30000 });
  await page.click(tid('policy-upload-submit'));
  return resp;
}

(async () => {
  browser = await chromium.launch({
    executablePath: env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const context = await browser.newContext({ viewport: { width: 1400, height: 900 } });
  page = await context.newPage();
  page.setDefaultTimeout(15000);
  page.on('console', (m) => {
    if (m.type() === 'error') consoleErrors.push(m.text());
  });
  page.on('pageerror', (e) => pageErrors.push(e.message));
  const apiRequests = [];
  page.on('request', (r) => {
    const u = new URL(r.url());
    if (u.origin !== ORIGIN) return;
    // Static files of the console are not data; /console/session is the one API call allowed signed out.
    if (u.pathname.startsWith('/console/') && u.pathname !== '/console/session') return;
    apiRequests.push(`${r.method()} ${u.pathname}${u.search}`);
  });

  // (a) No key: the sign-in only, and no data fetched.
  await check('signed out: only the sign-in shows and only /console/session is asked', async () => {
    await page.goto(URL_);
    await page.locator(tid('signin')).waitFor({ timeout: 15000 });
    await page.waitForTimeout(1500);
    assert((await page.locator(tid('nav')).count()) === 0, 'the nav is shown without a key');
    const others = apiRequests.filter((r) => !r.endsWith(' /console/session'));
    assert(others.length === 0, `requests other than /console/session were made: ${others.join(', ')}`);
    assert(apiRequests.length >= 1, 'the session was never checked');
    await shot('signin.png');
    return `requests: ${apiRequests.join(', ')}`;
  });

  // (b) A wrong key: the server's own message.
  await check('a wrong key shows the server\'s error', async () => {
    await page.locator(tid('signin-key')).fill(`wrong-${RUN}`);
    const resp = page.waitForResponse((r) => r.url().endsWith('/console/session'));
    await page.click(tid('signin-submit'));
    const r = await resp;
    assert(r.status() === 401, `/console/session answered ${r.status()} to a wrong key`);
    const body = await r.json();
    const msg = body.error && body.error.message;
    assert(msg, 'the 401 has no error.message');
    const banner = page.locator(tid('signin-error-message'));
    await banner.waitFor();
    const shown = await banner.textContent();
    assert(shown.includes(msg), `banner says "${shown}", server said "${msg}"`);
    assert((await page.locator(tid('nav')).count()) === 0, 'signed in with a wrong key');
    return `"${msg}"`;
  });

  // (c) Sign in as admin.
  await check('sign in with ADMIN_KEY', async () => {
    await signIn(env.ADMIN_KEY);
    for (const p of ['chat', 'jobs', 'policies', 'resources', 'metrics']) {
      assert(await page.locator(tid(`nav-${p}`)).isVisible(), `nav-${p} missing for the admin key`);
    }
    const scopes = await page.locator(tid('session-info')).textContent();
    assert(scopes.includes('admin'), `session shows no admin scope: ${scopes}`);
  });

  // (d) Chat: a streamed answer with usage, then Stop on a long one.
  await check('chat: streamed answer with token counts and tok/s', async () => {
    await go('chat');
    await waitOption('chat-model', env.MODEL_ID);
    await page.locator(tid('chat-model')).selectOption(env.MODEL_ID);
    await page.locator(tid('chat-temperature')).fill('0');
    // Watch the answer's text length at every DOM change while it streams.
    await page.evaluate(() => {
      window.__lens = [];
      const obs = new MutationObserver(() => {
        const el = document.querySelector('[data-testid="chat-msg-assistant"][data-last="true"] .text');
        if (!el) return;
        const n = el.textContent.length;
        if (window.__lens[window.__lens.length - 1] !== n) window.__lens.push(n);
      });
      obs.observe(document.body, { subtree: true, childList: true, characterData: true, attributes: true });
      window.__lensObs = obs;
    });
    await sendChat('Write three sentences about the sea.', 64);
    const last = await waitAnswer();
    const lens = await page.evaluate(() => {
      window.__lensObs.disconnect();
      return window.__lens.filter((n) => n > 0);
    });
    const chunks = Number(await last.getAttribute('data-chunks'));
    const text = (await last.locator(tid('chat-answer-text')).textContent()) || '';
    const err = await last.locator(tid('chat-error')).count();
    if (err) assert(false, `the answer failed: ${await last.locator(tid('chat-error')).textContent()}`);
    assert(text.trim().length > 0, 'the answer is empty');
    assert(lens.length >= 2 || chunks >= 3, `no streaming seen: ${chunks} chunks, text lengths ${JSON.stringify(lens)}`);
    const usage = await last.locator(tid('chat-usage')).textContent();
    const m = /completion (\d+) tokens/.exec(usage);
    assert(m && Number(m[1]) > 0, `no completion token count in "${usage}"`);
    assert(/prompt \d+ tokens/.test(usage), `no prompt token count in "${usage}"`);
    assert(/[\d.,]+ tok\/s/.test(usage), `no tok/s in "${usage}"`);
    return `${chunks} chunks, ${lens.length} growing observations, "${usage}"`;
  });

  await check('chat: a second turn keeps the conversation', async () => {
    await sendChat('And one more sentence.', 24);
    await waitAnswer();
    const users = await page.locator(tid('chat-msg-user')).count();
    const answers = await page.locator(tid('chat-msg-assistant')).count();
    assert(users === 2 && answers === 2, `expected 2 turns, see ${users} user and ${answers} assistant messages`);
  });

  await check('chat: Stop ends a long answer', async () => {
    await page.locator(tid('chat-ignore-eos')).setChecked(true);
    await sendChat('Tell a very long story about a lighthouse keeper.', 4000);
    const last = page.locator(`${tid('chat-msg-assistant')}[data-last="true"]`);
    await page.waitForFunction(
      (sel) => {
        const el = document.querySelector(sel);
        return el && el.dataset.streaming === 'true' && Number(el.dataset.chunks) >= 3;
      },
      `${tid('chat-msg-assistant')}[data-last="true"]`,
      { timeout: 30000 },
    );
    await page.click(tid('chat-stop'));
    await page.locator(`${tid('chat-msg-assistant')}[data-last="true"][data-stopped="true"]`).waitFor({ timeout: 5000 });
    const n1 = Number(await last.getAttribute('data-chunks'));
    await page.waitForTimeout(1500);
    const n2 = Number(await last.getAttribute('data-chunks'));
    assert(n1 === n2, `chunks kept arriving after Stop (${n1} -> ${n2})`);
    assert(n1 < 4000, 'the answer ran to its end');
    await page.locator(tid('chat-send')).waitFor({ timeout: 5000 });
    await page.locator(tid('chat-ignore-eos')).setChecked(false);
    return `stopped after ${n1} chunks`;
  });

  await check('chat: copy as curl and as Python', async () => {
    await page.locator(tid('chat-input')).fill('Hello');
    await page.click(tid('copy-curl'));
    let snip = await page.locator(tid('chat-snippet')).textContent();
    assert(snip.includes('curl') && snip.includes('/v1/chat/completions') && snip.includes(env.MODEL_ID), `bad curl snippet: ${snip}`);
    await page.click(tid('copy-python'));
    await page.locator(`${tid('chat-snippet')}[data-kind="python"]`).waitFor();
    snip = await page.locator(tid('chat-snippet')).textContent();
    assert(snip.includes('from openai import OpenAI') && snip.includes(env.MODEL_ID), `bad Python snippet: ${snip}`);
    await page.locator(tid('chat-input')).fill('');
    await shot('chat.png');
  });

  // (e) Jobs: a noop job followed live; client- and server-side form errors.
  await check('jobs: an invalid value is refused in the form', async () => {
    await go('jobs');
    await page.click(tid('job-kind-noop'));
    const before = apiRequests.filter((r) => r.startsWith('POST /api/jobs')).length;
    await jobField('steps', '100001');
    await page.click(tid('job-submit'));
    const err = page.locator(tid('job-field-error-steps'));
    await err.waitFor({ timeout: 5000 });
    const text = await err.textContent();
    assert(/0\.\.=100000/.test(text), `unexpected field error: ${text}`);
    const after = apiRequests.filter((r) => r.startsWith('POST /api/jobs')).length;
    assert(after === before, 'the invalid form was sent to the server');
    return `"${text}"`;
  });

  await check('jobs: a noop job reaches done with its events shown live', async () => {
    await jobField('steps', '8');
    await jobField('delay_ms', '400');
    await page.click(tid('job-submit'));
    const id = await jobPageId();
    // Events must show up while the job still runs, not only at the end.
    await page.waitForFunction(
      ([ev, st]) => document.querySelectorAll(ev).length >= 3 && document.querySelector(st).dataset.status === 'running',
      [`${tid('job-event')}[data-type="stage"]`, tid('job-status')],
      { timeout: JOB_TIMEOUT, polling: 100 },
    );
    const status = await waitJobFinal(JOB_TIMEOUT);
    assert(status === 'done', `the noop job ended ${status}`);
    const stages = await page.locator(`${tid('job-event')}[data-type="stage"]`).count();
    const done = await page.locator(`${tid('job-event')}[data-type="done"]`).count();
    assert(stages >= 9 && done === 1, `expected 9 stage events and done, see ${stages} stages, ${done} done`);
    const progress = await dataNum(tid('job-progress'), 'data-progress');
    assert(progress === 100, `progress bar at ${progress}%`);
    return `${id}: ${stages} stage events, seen live`;
  });

  await check('jobs: a server refusal shows the API message and param', async () => {
    const resp = page.waitForResponse((r) => r.request().method() === 'POST' && r.url().endsWith('/api/jobs'), { timeout: 15000 });
    await submitJob('dataset', {
      input: env.DATASET_INPUT,
      output_dir: env.DATASET_OUTPUT_DIR,
      policy: `no-such-policy-${RUN}`,
    });
    const r = await resp;
    assert(r.status() >= 400 && r.status() < 500, `the server answered ${r.status()} to a missing policy`);
    const e = (await r.json()).error;
    const banner = page.locator(tid('job-form-error'));
    await banner.waitFor();
    const text = await banner.textContent();
    assert(text.includes(e.message), `banner "${text}" lacks the API message "${e.message}"`);
    if (e.param) assert(text.includes(e.param), `banner "${text}" lacks param ${e.param}`);
    await go('jobs');
    await page.locator(`${tid('job-row')}[data-kind="noop"][data-status="done"]`).first().waitFor({ timeout: 10000 });
    await shot('jobs.png');
    return `${r.status()} "${e.message}" (param ${e.param})`;
  });

  // (f) Policies: upload, dry run, dataset job, router bind + calls, bad upload.
  const transform = `console-transform-${RUN}`;
  const router = `console-router-${RUN}`;
  await check('policies: upload the dataset transform', async () => {
    const r = await uploadPolicy({ file: env.TRANSFORM_WASM, name: transform, kind: 'dataset-transform' });
    assert(r.status() === 201 || r.status() === 200, `upload answered ${r.status()}: ${await r.text()}`);
    await page.locator(tid('policy-upload-result')).waitFor();
    await page.locator(`${tid('policy-row')}[data-name="${transform}"]`).waitFor({ timeout: 10000 });
  });

  await check('policies: dry run of 3 JSONL records shows each outcome', async () => {
    await waitOption('dryrun-policy', transform);
    await page.locator(tid('dryrun-policy')).selectOption(transform);
    const records = [
      { instruction: 'Say hello.', input: '', output: 'Hello!' },
      { instruction: 'Add the numbers.', input: '2 and 3', output: '5' },
      { instruction: 'This one has no output.' },
    ];
    await page.locator(tid('dryrun-input')).fill(records.map((r) => JSON.stringify(r)).join('\n'));
    await page.click(tid('dryrun-run'));
    await page.locator(tid('dryrun-results')).waitFor({ timeout: 15000 });
    const outcomes = await page.locator(tid('dryrun-row')).evaluateAll((rows) => rows.map((r) => r.dataset.outcome));
    assert(outcomes.length === 3, `expected 3 result rows, see ${outcomes.length}`);
    assert(outcomes.every((o) => ['keep', 'drop', 'error'].includes(o)), `odd outcomes ${outcomes}`);
    assert(outcomes[0] === 'keep' && outcomes[1] === 'keep' && outcomes[2] === 'error', `expected keep, keep, error; got ${outcomes}`);
    const counts = await page.locator(tid('dryrun-counts')).textContent();
    assert(/keep 2/.test(counts) && /error 1/.test(counts), `counts read "${counts}"`);
    return outcomes.join(', ');
  });

  await check('policies: the dataset form asks for policy or steps, then a pipeline job reaches done', async () => {
    await submitJob('dataset', { input: env.DATASET_INPUT, output_dir: env.DATASET_OUTPUT_DIR });
    const missing = await page.locator(tid('job-field-error-policy')).textContent({ timeout: 5000 });
    assert(missing.includes('`policy` or `steps`'), `the form's error reads "${missing}"`);
    await jobField('steps', JSON.stringify([{ policy: transform }, { dedupe: ['messages'] }]));
    await jobField('valid_ratio', '0.2');
    await jobField('test_ratio', '0.1');
    await jobField('shuffle', true);
    await jobField('output_format', 'jsonl');
    await page.click(tid('job-submit'));
    const id = await jobPageId();
    const status = await waitJobFinal(JOB_TIMEOUT);
    if (status !== 'done') {
      const err = await page.locator(tid('job-events')).textContent();
      assert(false, `dataset job ${id} ended ${status}: ${err.slice(-500)}`);
    }
    // The job's row can say done before its event stream has been drawn (a
    // small pipeline ends in tens of milliseconds): the stream must still
    // bring its events, up to the done one.
    await page.locator(`${tid('job-event')}[data-type="done"]`).waitFor({ timeout: 10000 })
      .catch(() => {});
    const events = await page.locator(tid('job-event')).count();
    assert(events >= 2, `only ${events} events shown`);
    return `${id}, ${events} events`;
  });

  await check('policies: upload and bind a router; a chat request counts as a call', async () => {
    const r = await uploadPolicy({ file: env.ROUTER_WASM, name: router, kind: 'router', query: env.ROUTER_QUERY || '' });
    assert(r.status() === 201 || r.status() === 200, `router upload answered ${r.status()}: ${await r.text()}`);
    await page.locator(`${tid('policy-row')}[data-name="${router}"]`).waitFor({ timeout: 10000 });
    await page.click(tid(`policy-bind-${router}`));
    await page.locator(tid('binding-router')).filter({ hasText: router }).waitFor({ timeout: 10000 });
    await go('chat');
    await waitOption('chat-model', env.MODEL_ID);
    await page.locator(tid('chat-model')).selectOption(env.MODEL_ID);
    await sendChat('Hi there, router!', 16);
    const last = await waitAnswer();
    // The router may refuse the request (tenant_router rejects unknown
    // tenants unless ROUTER_QUERY configures it): still a call, and the
    // refusal must be shown as the API's message.
    const refused = (await last.locator(tid('chat-error')).count())
      ? (await last.locator(tid('chat-error')).textContent()).trim()
      : null;
    if (!refused) {
      const text = (await last.locator(tid('chat-answer-text')).textContent()) || '';
      assert(text.trim().length > 0, 'the routed chat has neither an answer nor an error');
    }
    await go('policies');
    const calls = page.locator(tid(`policy-calls-${router}`));
    await page.waitForFunction((sel) => Number(document.querySelector(sel)?.dataset.value || 0) > 0, tid(`policy-calls-${router}`), { timeout: 20000 });
    const n = await calls.getAttribute('data-value');
    return `${router} bound, calls = ${n}; the chat ${refused ? `was refused: "${refused.slice(0, 100)}"` : 'was answered'}`;
  });

  await check('policies: an invalid component shows the validation message', async () => {
    const r = await uploadPolicy({ file: env.BAD_WASM, name: `console-bad-${RUN}`, kind: 'router' });
    assert(r.status() >= 400 && r.status() < 500, `bad upload answered ${r.status()}`);
    const e = (await r.json()).error;
    const banner = page.locator(tid('policy-upload-error-message'));
    await banner.waitFor();
    const text = await banner.textContent();
    assert(text.includes(e.message), `banner "${text}" lacks "${e.message}"`);
    assert((await page.locator(`${tid('policy-row')}[data-name="console-bad-${RUN}"]`).count()) === 0, 'the bad component was listed');
    await shot('policies.png');
    return `${r.status()} "${e.message.slice(0, 120)}"`;
  });

  await check('policies: unbind and delete what this run uploaded', async () => {
    await page.click(tid(`policy-unbind-${router}`));
    await page.locator(tid('binding-router')).filter({ hasText: 'none' }).waitFor({ timeout: 10000 });
    for (const name of [router, transform]) {
      await page.click(tid(`policy-delete-${name}`));
      await page.click(tid(`policy-delete-confirm-${name}`));
      await page.locator(`${tid('policy-row')}[data-name="${name}"]`).waitFor({ state: 'detached', timeout: 10000 });
    }
  });

  // (g) Fine-tune: the loss chart draws points as metrics arrive.
  await check('finetune: the job page draws the loss chart live', async () => {
    const fields = {
      model: env.FINETUNE_MODEL,
      data: env.FINETUNE_DATA,
      rank: '4',
      num_layers: '2',
      batch_size: '2',
      iterations: '60',
      report_interval: '5',
      val_interval: '20',
      learning_rate: '0.0001',
    };
    if (env.FINETUNE_MAX_SEQ_LEN) fields.max_seq_len = env.FINETUNE_MAX_SEQ_LEN;
    await submitJob('finetune', fields);
    const id = await jobPageId();
    const chart = tid('job-loss-chart');
    await page.locator(chart).waitFor({ timeout: 10000 });
    // uPlot's own draw hook writes how many points it drew: > 0 only once
    // metric events have reached the chart.
    await page.waitForFunction(
      ([sel, st]) => Number(document.querySelector(sel)?.dataset.drawnPoints || 0) > 0
        || ['failed', 'cancelled', 'zombie'].includes(document.querySelector(st)?.dataset.status),
      [chart, tid('job-status')],
      { timeout: FT_TIMEOUT, polling: 250 },
    );
    const liveStatus = await page.locator(tid('job-status')).getAttribute('data-status');
    const livePoints = await dataNum(chart, 'data-drawn-points');
    const status = await waitJobFinal(FT_TIMEOUT);
    if (status !== 'done') {
      const text = await page.locator(tid('job-events')).textContent();
      assert(false, `finetune ${id} ended ${status}: ${text.slice(-600)}`);
    }
    await page.waitForTimeout(500);
    const drawn = await dataNum(chart, 'data-drawn-points');
    const metrics = await page.locator(`${tid('job-event')}[data-type="metric"]`).count();
    assert(drawn > 0, 'the loss chart drew no points');
    assert(drawn >= Math.min(metrics, 2), `the chart drew ${drawn} points for ${metrics} metric events`);
    const uplot = await page.locator(`${chart} canvas`).count();
    assert(uplot >= 1, 'no uPlot canvas in the loss chart');
    await shot('job-finetune.png');
    return `${id}: ${livePoints} points drawn while ${liveStatus}, ${drawn} at the end (${metrics} metric events)`;
  });

  // (h) Resources and metrics with real data.
  await check('resources: the model row and the lists render', async () => {
    await go('resources');
    await page.locator(`${tid('model-row')}[data-id="${env.MODEL_ID}"]`).waitFor({ timeout: 15000 });
    for (const card of ['adapters', 'caches', 'upstreams']) {
      assert(await page.locator(tid(card)).isVisible(), `the ${card} card is missing`);
    }
    await shot('resources.png');
  });

  await check('metrics: charts have points after a few polls', async () => {
    await go('metrics');
    await page.waitForFunction((sel) => Number(document.querySelector(sel)?.dataset.drawnPoints || 0) > 0,
      tid('metrics-chart-requests'), { timeout: 20000, polling: 250 });
    await page.waitForFunction((sel) => Number(document.querySelector(sel)?.dataset.count || 0) >= 3,
      tid('metrics-samples'), { timeout: 20000 });
    // A chat between polls must show as a token rate above zero.
    await go('chat');
    await waitOption('chat-model', env.MODEL_ID);
    await page.locator(tid('chat-model')).selectOption(env.MODEL_ID);
    await sendChat('Count from one to ten.', 32);
    await waitAnswer();
    await go('metrics');
    await page.waitForFunction((sel) => Number(document.querySelector(sel)?.dataset.max || 0) > 0,
      tid('metrics-chart-tokens'), { timeout: 20000, polling: 250 });
    const drawn = await dataNum(tid('metrics-chart-requests'), 'data-drawn-points');
    const tokens = await dataNum(tid('metrics-chart-tokens'), 'data-points');
    // The chats above were counted: real inference data, not just the console's own polls.
    const inference = await dataNum(tid('metrics-total-inference'), 'data-value');
    const completion = await dataNum(tid('metrics-total-completion-tokens'), 'data-value');
    assert(inference > 0 && completion > 0, `no inference counted (${inference} requests, ${completion} tokens)`);
    assert(tokens > 0, 'the tokens/s chart has no points');
    const latency = await dataNum(tid('metrics-chart-latency'), 'data-points');
    assert(latency > 0, 'the latency chart has no point for the chat between polls');
    await shot('metrics.png');
    return `${drawn} request-rate points, ${tokens} token-rate points, ${latency} latency points, ${inference} inference requests counted`;
  });

  // (i) An infer-only key sees only what it may use.
  await check('infer-only key: no admin pages, a not-allowed message, 403 from /admin', async () => {
    await page.click(tid('signout'));
    await page.locator(tid('signin')).waitFor();
    await signIn(env.INFER_KEY);
    assert(await page.locator(tid('nav-chat')).isVisible(), 'no chat for the infer key');
    for (const p of ['policies', 'metrics', 'jobs']) {
      assert((await page.locator(tid(`nav-${p}`)).count()) === 0, `nav-${p} is shown to the infer key`);
    }
    await page.evaluate(() => { location.hash = '#/policies'; });
    const na = page.locator(tid('not-allowed'));
    await na.waitFor({ timeout: 10000 });
    const text = await na.textContent();
    assert(/not allowed for this key/i.test(text), `unexpected text: ${text}`);
    const status = await page.evaluate(async () => {
      const key = sessionStorage.getItem('mlxgate.console.key');
      const r = await fetch('/admin/policies', { headers: { authorization: `Bearer ${key}` } });
      return r.status;
    });
    assert(status === 403, `/admin/policies answered ${status} to the infer key`);
    return '/admin/policies -> 403';
  });

  await check('no uncaught errors in the page', async () => {
    assert(pageErrors.length === 0, `page errors: ${pageErrors.join(' | ')}`);
  });

  console.log('all console checks passed');
  await finish(0);
})().catch((e) => finish(1, `unexpected: ${e && e.stack ? e.stack : e}`));
