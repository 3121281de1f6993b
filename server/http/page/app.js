// tierlm's page: a chat that streams through the OpenAI API, and the KV tiers live from GET /tiers.
// Plain browser JavaScript, no build step and nothing from another origin (the server sends a strict CSP).
"use strict";

const KEY = "tierlm-api-key"; // sessionStorage: typed once, kept for this tab only
const POLL_MS = 1500;
const BUCKET_S = 5; // the hit chart: one bar per 5 seconds of the history window
const TIER_NAMES = { device: "L1 device", host: "L2 host", storage: "L3 storage" };
const SOURCES = ["device", "host", "storage", "computed"];
const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, useChat: true, model: "default", polling: null };

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

function authHeaders(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: authHeaders(Boolean(options.body)) });
  if (response.status === 401) {
    askForKey();
    throw new ApiError("this server needs an API key", 401);
  }
  if (!response.ok) throw new ApiError(await errorMessage(response), response.status);
  return response;
}

function setStatus(text) { $("status").textContent = text || ""; }

function askForKey() {
  const form = $("key-form");
  if (form.hidden) {
    form.hidden = false;
    $("key-input").focus();
  }
  setStatus("This server needs an API key: type it above.");
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return (i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

// ------------------------------------------------------------------ the tiers, polled
function segment(cls, part, whole, label) {
  const pct = whole > 0 ? (100 * part) / whole : 0;
  const span = el("span", { class: cls, title: label });
  span.style.width = pct.toFixed(2) + "%";
  if (part > 0) span.style.minWidth = "3px"; // a few pages of a large pool still show
  return span;
}

function tierBlock(name, tier) {
  const block = el("div", { class: "tier", id: "tier-" + name });
  block.append(el("div", { class: "name", text: TIER_NAMES[name] }));
  if (!tier.enabled) {
    block.classList.add("off");
    const how = name === "host" ? "--enable-hierarchical-cache" : "--hicache-storage-backend file";
    block.append(el("div", { class: "bar", role: "img", "aria-label": TIER_NAMES[name] + ": off" }));
    block.append(el("div", { class: "numbers", text: "off (start the server with " + how + ")" }));
    return block;
  }
  let used, cached, free, text;
  if (name === "storage") {
    used = 0;
    cached = tier.used_bytes || 0;
    free = tier.free_bytes || 0;
    text = `${tier.files} files, ${fmtBytes(cached)}` + (tier.max_bytes ? ` of ${fmtBytes(tier.max_bytes)}` : "") +
      ` (${tier.backend}, ${tier.state})`;
  } else {
    used = tier.used_pages; cached = tier.cached_pages; free = tier.free_pages;
    text = `${used} held, ${cached} cached, ${free} free of ${tier.total_pages} pages ` +
      `(${fmtBytes(tier.used_bytes + tier.cached_bytes)} of ${fmtBytes(tier.total_bytes)})`;
  }
  const whole = used + cached + free;
  const bar = el("div", { class: "bar", role: "img", "aria-label": TIER_NAMES[name] + ": " + text });
  bar.append(segment("used", used, whole, "held by requests"), segment("cached", cached, whole, "cached"));
  block.dataset.used = used; block.dataset.cached = cached; block.dataset.free = free;
  block.append(bar, el("div", { class: "numbers", text }));
  return block;
}

const SVG = "http://www.w3.org/2000/svg";

function buckets(history, now) {
  const n = Math.max(Math.round(history.window_s / BUCKET_S), 1);
  const rows = Array.from({ length: n }, () => ({ device: 0, host: 0, storage: 0, computed: 0 }));
  for (const row of history.intervals) {
    const i = n - 1 - Math.floor((now - row.t) / BUCKET_S);
    if (i >= 0 && i < n) for (const k of SOURCES) rows[i][k] += row[k];
  }
  return rows;
}

function hitChart(rows) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${rows.length} 100`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  rows.forEach((row, i) => {
    const total = SOURCES.reduce((s, k) => s + row[k], 0);
    if (total <= 0) return;
    let y = 100;
    for (const k of SOURCES) {
      const h = (100 * row[k]) / total;
      if (h <= 0) continue;
      y -= h;
      const rect = document.createElementNS(SVG, "rect");
      rect.setAttribute("x", i + 0.1);
      rect.setAttribute("y", y);
      rect.setAttribute("width", 0.8);
      rect.setAttribute("height", h);
      rect.setAttribute("class", k);
      rect.style.fill = `var(--${k})`;
      svg.append(rect);
    }
  });
  return svg;
}

function sumIntervals(intervals) {
  const sums = { device: 0, host: 0, storage: 0, computed: 0 };
  for (const row of intervals) for (const k of SOURCES) sums[k] += row[k];
  return sums;
}

function renderFacts(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    dl.append(el("dt", { text: k }), el("dd", { text: typeof v === "object" ? JSON.stringify(v) : String(v) }));
  }
}

function renderTiers(data) {
  state.model = data.model;
  $("model-name").textContent = data.model;
  state.useChat = Boolean(data.machine && data.machine.chat_template);
  const bars = $("tier-bars");
  bars.replaceChildren(...["device", "host", "storage"].map((n) => tierBlock(n, data.tiers[n])));
  const intervals = data.history.intervals;
  const sums = sumIntervals(intervals);
  const total = SOURCES.reduce((s, k) => s + sums[k], 0);
  const summary = total === 0 ? "No prompts in the last minutes." :
    `${total} prompt tokens in the last ${Math.round(data.history.window_s / 60)} minutes: ` +
    SOURCES.map((k) => `${k} ${Math.round((100 * sums[k]) / total)}%`).join(", ") + ".";
  const chart = hitChart(buckets(data.history, data.time));
  chart.setAttribute("aria-label", "Share of prompt tokens per source over time. " + summary);
  $("hit-chart").replaceChildren(chart);
  $("hit-summary").textContent = summary;
  const q = data.queues, r = data.requests;
  renderFacts($("queues"), [
    ["running requests", r.running], ["waiting requests", r.waiting], ["finished requests", r.finished],
    ["mean time to first token", r.mean_ttft_s === null ? null : (1000 * r.mean_ttft_s).toFixed(0) + " ms"],
    ["prefetch (L3 to L2)", `${q.prefetches_in_flight} in flight, ${q.prefetch_pages} pages reserved`],
    ["write-back (L2 to L3)", `${q.write_back_pending} pending (${fmtBytes(q.write_back_pending_bytes)}), ` +
      `${q.write_backs_done} done, ${q.write_backs_failed} failed`],
    ["pinned prefixes", pinSummary(data.pins)],
  ]);
  renderMachine(data.machine || {});
}

// cache_control breakpoints (Anthropic's prompt caching) pin a prefix's pages in the tiers for a TTL
function pinSummary(pins) {
  if (!pins) return "none (no radix cache)";
  if (pins.fraction === 0) return "off (--cache-pin-fraction 0)";
  const tiers = Object.entries(pins.tiers).map(([t, v]) => `${t} ${v.pinned_pages} of ${v.limit_pages} pages`);
  return `${pins.prefixes} pinned (${tiers.join(", ")})`;
}

function renderMachine(m) {
  const decision = m.backend_decision || {};
  const cpu = m.cpu || {};
  renderFacts($("machine"), [
    ["tierlm", m.version], ["backend", m.backend], ["device", m.device],
    ["dtype", m.dtype && `${m.dtype} (${m.dtype_chosen_by})`], ["KV cache dtype", m.kv_dtype],
    ["attention", m.attention_backend && `${m.attention_backend.name} (${m.attention_backend.chosen_by})`],
    ["kernels", m.kernels && Object.entries(m.kernels).map(([k, v]) => `${k}: ${v}`).join("; ")],
    ["CPU", cpu.model_name && `${cpu.model_name} (${cpu.arch}, ${cpu.level}, ${cpu.physical_cores} cores)`],
    ["model", m.model_path], ["architecture", m.architecture], ["context length", m.context_length],
    ["chat template", m.chat_template],
  ]);
  $("reasons").replaceChildren(...(decision.reasons || []).map((t) => el("li", { text: t })));
  const warnings = m.warnings && m.warnings.length ? m.warnings : ["none"];
  $("warnings").replaceChildren(...warnings.map((t) => el("li", { text: t })));
}

async function poll() {
  clearTimeout(state.polling);
  if (!document.hidden) {
    try {
      const data = await (await api("/tiers")).json();
      renderTiers(data);
      if ($("key-form").hidden) setStatus("");
    } catch (e) {
      if (e.status !== 401) setStatus("Cannot read /tiers: " + e.message);
    }
  }
  state.polling = setTimeout(poll, POLL_MS);
}

// ------------------------------------------------------------------ the chat
function addMessage(role, text) {
  const li = el("li", { class: "msg " + role });
  li.append(el("span", { class: "role", text: role === "user" ? "You" : state.model }));
  const body = el("span", { class: "text", text });
  li.append(body);
  $("messages").append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

function kvReport(usage, ttftMs) {
  const prompt = usage.prompt_tokens;
  const details = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens_details) || {};
  const parts = { device: details.device || 0, host: details.host || 0, storage: details.storage || 0 };
  parts.computed = Math.max(prompt - parts.device - parts.host - parts.storage, 0);
  const box = el("div", { class: "kv" });
  for (const k of SOURCES) box.dataset[k] = parts[k];
  box.dataset.ttftMs = ttftMs === null ? "" : Math.round(ttftMs);
  const text = `Prompt ${prompt} tokens: ` + SOURCES.map((k) => `${k} ${parts[k]}`).join(", ") +
    (ttftMs === null ? "" : `; first token after ${Math.round(ttftMs)} ms`);
  const bar = el("div", { class: "kvbar", role: "img", "aria-label": text });
  for (const k of SOURCES) bar.append(segment(k, parts[k], prompt, `${k}: ${parts[k]} tokens`));
  box.append(bar, el("span", { text }));
  return box;
}

function requestBody(userText) {
  const common = {
    model: state.model, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  const history = [...state.messages, { role: "user", content: userText }];
  if (state.useChat) return ["/v1/chat/completions", { ...common, messages: history }];
  // a model without a chat template: the conversation so far is the prompt
  return ["/v1/completions", { ...common, prompt: history.map((m) => m.content).join("") }];
}

async function streamAnswer(response, li, started) {
  const body = li.querySelector(".text");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "", usage = null, ttft = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (!line.startsWith("data:")) continue;
      const payload = line.slice(5).trim();
      if (payload === "[DONE]") continue;
      const event = JSON.parse(payload);
      if (event.error) throw new ApiError(event.error.message, 500);
      const choice = event.choices && event.choices[0];
      const piece = choice && (state.useChat ? choice.delta && choice.delta.content : choice.text);
      if (piece) {
        if (ttft === null) ttft = performance.now() - started;
        text += piece;
        body.textContent = text;
      }
      if (event.usage) usage = event.usage;
    }
  }
  return { text, usage, ttft };
}

async function send(event) {
  event.preventDefault();
  const input = $("prompt");
  const userText = input.value;
  if (!userText.trim() || state.controller) return;
  addMessage("user", userText);
  input.value = "";
  const li = addMessage("assistant", "");
  li.dataset.state = "streaming";
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  let text = "";
  try {
    const [path, body] = requestBody(userText);
    const started = performance.now();
    const response = await api(path, { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    const answer = await streamAnswer(response, li, started);
    text = answer.text;
    if (answer.usage) li.append(kvReport(answer.usage, answer.ttft));
    li.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      li.dataset.state = "stopped";
      text = li.querySelector(".text").textContent;
      li.append(el("div", { class: "kv", text: "Stopped." }));
    } else {
      li.dataset.state = "error";
      li.classList.add("error");
      li.querySelector(".text").textContent = "Error: " + e.message;
    }
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    if (li.dataset.state !== "error") {
      state.messages.push({ role: "user", content: userText }, { role: "assistant", content: text });
    }
    li.scrollIntoView({ block: "end" });
    poll();
  }
}

// ------------------------------------------------------------------ tabs, keys, wiring
function selectTab(tab) {
  for (const t of document.querySelectorAll('[role="tab"]')) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  tab.focus();
}

function wire() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  for (const tab of tabs) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (e) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (step) selectTab(tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length]);
    });
  }
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("messages").replaceChildren();
    $("prompt").focus();
  });
  $("key-button").addEventListener("click", askForKey);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-input").value = "";
    $("key-form").hidden = true;
    setStatus("");
    poll();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  poll();
}

document.addEventListener("DOMContentLoaded", wire);
