// The chat and completion playground: streams from this server's own OpenAI API. The API key (if the server
// wants one) is kept in this tab's sessionStorage only. Model text is always written with textContent.
"use strict";

const KEY_STORAGE = "tinypaged.apiKey";
const $ = (id) => document.getElementById(id);

const state = {
  mode: "chat",
  messages: [], // the chat so far: {role, content}
  model: null,
  controller: null, // aborts the request in flight (the server then aborts it and frees its blocks)
  requestId: null, // the id of this tab's request in flight; the engine's request ids start with it
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text) {
  $("status").textContent = text;
}

// ---- the API key and calls ---------------------------------------------------------------------------

function askForKey(note) {
  $("key-form").hidden = false;
  $("key-note").textContent = note;
  $("key-input").focus();
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const resp = await fetch(path, { ...options, headers });
  // Ask only if the key is still the one this call sent (not one typed while it was on its way).
  if (resp.status === 401 && sessionStorage.getItem(KEY_STORAGE) === key) {
    askForKey(key ? "That key was refused; try again." : "This server needs its API key.");
  }
  return resp;
}

async function connect() {
  let resp;
  try {
    resp = await api("/v1/models");
  } catch (e) {
    setStatus("server unreachable");
    return;
  }
  if (!resp.ok) {
    setStatus(resp.status === 401 ? "API key needed" : `error ${resp.status}`);
    return;
  }
  const models = await resp.json();
  state.model = models.data[0].id;
  $("model").textContent = state.model;
  setStatus("ready");
  kvView.start();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value);
  $("key-input").value = "";
  $("key-form").hidden = true;
  connect();
});

// ---- settings ----------------------------------------------------------------------------------------

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function parseStop(text) {
  const value = text.trim();
  if (value === "") return undefined;
  if (value.startsWith("[")) return JSON.parse(value);
  return value.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
}

function requestBody() {
  const body = {
    max_tokens: numberField("max_tokens"),
    n: numberField("n"),
    best_of: numberField("best_of"),
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    stop: parseStop($("stop").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("beam").checked) {
    body.use_beam_search = true;
    body.temperature = 0;
  }
  if (state.model) body.model = state.model;
  return body;
}

// ---- one reply: its n choices side by side, TTFT and tokens per second ------------------------------------

class Reply {
  constructor(n) {
    this.node = el("div", "reply");
    this.grid = el("div", "choices");
    this.grid.style.setProperty("--n", String(Math.min(Math.max(n, 1), 4)));
    this.stats = el("div", "stats", "waiting for the first token…");
    this.node.append(this.grid, this.stats);
    this.choices = [];
    this.n = n;
    for (let i = 0; i < n; i++) this.choice(i);
  }

  choice(index) {
    while (this.choices.length <= index) {
      const box = el("div", "choice");
      const label = el("div", "label", this.n > 1 ? `choice ${this.choices.length}` : "");
      const text = el("pre", "text");
      const finish = el("div", "finish");
      box.append(label, text, finish);
      this.grid.append(box);
      this.choices.push({ text, finish, content: "" });
    }
    return this.choices[index];
  }

  append(index, delta) {
    const c = this.choice(index);
    c.content += delta;
    c.text.textContent = c.content; // text, never HTML
  }

  finish(index, reason) {
    this.choice(index).finish.textContent = `finish: ${reason}`;
  }
}

function showError(message) {
  $("transcript").append(el("div", "error", message));
}

function scrollDown() {
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}

async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function run(path, body, reply) {
  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  let stopped = false;
  state.controller = new AbortController();
  setBusy(true);
  try {
    const resp = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!resp.ok) {
      let message = `HTTP ${resp.status}`;
      try {
        message = (await resp.json()).error.message;
      } catch (e) {
        // not JSON: keep the status
      }
      reply.node.remove();
      showError(message);
      return false;
    }
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showError(chunk.error.message);
        break;
      }
      state.requestId = chunk.id;
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        const delta = c.delta ? c.delta.content : c.text;
        if (delta) {
          if (tFirst === null) {
            tFirst = performance.now();
            reply.stats.textContent = `TTFT ${(tFirst - t0).toFixed(0)} ms · streaming…`;
          }
          reply.append(c.index, delta);
        }
        if (c.finish_reason) reply.finish(c.index, c.finish_reason);
      }
      scrollDown();
    }
  } catch (e) {
    if (e.name !== "AbortError") showError(String(e));
    stopped = true;
  } finally {
    state.controller = null;
    state.requestId = null;
    setBusy(false);
  }
  const tEnd = performance.now();
  const parts = [];
  if (tFirst !== null) parts.push(`TTFT ${(tFirst - t0).toFixed(0)} ms`);
  if (usage && tFirst !== null) {
    const tokens = usage.completion_tokens;
    parts.push(`${tokens} tokens`);
    // Beam search and best_of > n send each choice whole at the end: then the rate is over the whole request.
    const streamed = tokens > 1 && tEnd - tFirst > 0.05 * (tEnd - t0);
    const rate = streamed ? (tokens - 1) / ((tEnd - tFirst) / 1000) : tokens / ((tEnd - t0) / 1000);
    parts.push(`${rate.toFixed(1)} tok/s${streamed ? "" : " (sent whole)"}`);
  }
  if (stopped) parts.push("stopped");
  reply.stats.textContent = parts.join(" · ");
  return tFirst !== null && !stopped;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
  setStatus(busy ? "generating…" : "ready");
}

// ---- chat and completion -------------------------------------------------------------------------------

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError(`stop: ${e.message}`);
    return;
  }
  const reply = new Reply(body.n || 1);
  if (state.mode === "chat") {
    state.messages.push({ role: "user", content: text });
    $("transcript").append(el("div", "user", text));
    body.messages = state.messages.slice();
  } else {
    $("transcript").append(el("div", "prompt-echo", text));
    body.prompt = text;
  }
  $("prompt").value = "";
  $("transcript").append(reply.node);
  scrollDown();
  const path = state.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const ok = await run(path, body, reply);
  if (state.mode === "chat") {
    if (ok) state.messages.push({ role: "assistant", content: reply.choice(0).content });
    else state.messages.pop();
  }
}

function setMode(mode) {
  state.mode = mode;
  for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("active", b.dataset.mode === mode);
  $("prompt").placeholder =
    mode === "chat" ? "Message (Enter sends, Shift+Enter for a new line)" : "Prompt to complete (Enter sends)";
  $("send").textContent = mode === "chat" ? "Send" : "Complete";
  clearTranscript();
}

function clearTranscript() {
  state.messages = [];
  $("transcript").replaceChildren();
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
$("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", clearTranscript);
for (const b of document.querySelectorAll(".tabs button")) b.addEventListener("click", () => setMode(b.dataset.mode));

const kvView = new KVView(api, () => state.requestId);
connect();
