// kvserve web console: a chat playground (streamed through /v1/chat/completions) and a live
// engine view fed by /v1/console/status and the /v1/console/events SSE stream. No framework.
"use strict";

const KEY_STORE = "kvserve.apiKey";
const $ = (id) => document.getElementById(id);
const conversation = [];          // the conversation sent with each request

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

// ---------------------------------------------------------------- SSE parsing
// Calls onData(payload) for each "data:" event in a fetch() body stream.
async function readSSE(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data && onData(data) === false) return;
    }
  }
}

// ---------------------------------------------------------------- chat
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function requestBody() {
  const body = { model: $("model").textContent || undefined, messages: conversation.slice(), stream: true,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const stops = $("stop").value.split(",").map((s) => s.replace(/\\n/g, "\n")).filter((s) => s.length);
  if (stops.length) body.stop = stops;
  if ($("json-mode").checked) body.response_format = { type: "json_object" };
  return body;
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("chat-error").textContent = "";
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  $("send").disabled = true;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(requestBody()) });
    if (!r.ok) throw new Error(r.status + ": " + ((await r.json()).error || {}).message);
    await readSSE(r, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = (chunk.choices[0] || {}).delta || {};
      if (delta.content) out.textContent += delta.content;
      return true;
    });
    conversation.push({ role: "assistant", content: out.textContent });
    out.dataset.done = "1";
  } catch (err) {
    conversation.pop();
    $("chat-error").textContent = String(err.message || err);
    out.remove();
  } finally {
    $("send").disabled = false;
  }
}

// ---------------------------------------------------------------- engine view
function drawGrid(kv) {
  const canvas = $("kv-grid"), g = canvas.getContext("2d");
  const total = kv.blocks_total || 0;
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (!total) return;
  const cols = Math.ceil(Math.sqrt(total * canvas.width / canvas.height));
  const size = Math.max(1, Math.floor(Math.min(canvas.width / cols, canvas.height / Math.ceil(total / cols))));
  for (let i = 0; i < total; i++) {
    g.fillStyle = i < kv.blocks_used ? "#d9534f" : i < kv.blocks_used + kv.blocks_cached ? "#f0ad4e" : "#cfe8cf";
    g.fillRect((i % cols) * size, Math.floor(i / cols) * size, Math.max(1, size - 1), Math.max(1, size - 1));
  }
}

// lines: [{key, color, label, scale}] over series points (null values leave a gap)
function drawSeries(canvasId, series, lines, unit) {
  const canvas = $(canvasId), g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const values = lines.flatMap((l) => series.map((p) => p[l.key]).filter((v) => v != null).map((v) => v * l.scale));
  const max = Math.max(1e-9, ...values);
  lines.forEach((l) => {
    g.strokeStyle = l.color;
    g.beginPath();
    let drawing = false;
    series.forEach((p, i) => {
      if (p[l.key] == null) { drawing = false; return; }
      const x = (i / Math.max(1, series.length - 1)) * canvas.width;
      const y = canvas.height - ((p[l.key] * l.scale) / max) * (canvas.height - 12);
      if (drawing) g.lineTo(x, y); else g.moveTo(x, y);
      drawing = true;
    });
    g.stroke();
  });
  g.fillStyle = "#555";
  const names = lines.map((l) => l.label).join(", ");
  g.fillText(names + " (max " + max.toFixed(1) + " " + unit + ", last " + series.length + " s)", 4, 10);
}

function drawRates(series) {
  drawSeries("rate-chart", series, [{ key: "tokens_per_s", color: "#2a6", label: "tokens/s", scale: 1 }], "tok/s");
  drawSeries("latency-chart", series, [
    { key: "ttft_mean_s", color: "#36c", label: "TTFT (blue)", scale: 1000 },
    { key: "tpot_mean_s", color: "#c63", label: "TPOT (orange)", scale: 1000 }], "ms");
}

function renderSubtrees(subtrees) {
  const body = $("subtrees").tBodies[0];
  body.textContent = "";
  for (const t of subtrees || []) {
    const row = body.insertRow();
    for (const v of [t.namespace ?? "–", t.adapter ?? "base", t.blocks, t.leaves, t.locked_blocks]) {
      row.insertCell().textContent = String(v);
    }
  }
}

const ms = (s) => (s == null ? "–" : (s * 1000).toFixed(1) + " ms");

function render(status) {
  $("model").textContent = status.model;
  const e = status.engine, kv = status.kv, pc = status.prefix_cache, sp = status.speculation;
  $("running").textContent = e.running; $("waiting").textContent = e.waiting;
  $("steps").textContent = e.steps; $("preemptions").textContent = e.preemptions;
  const slots = status.decode_slots;
  $("slots").textContent = slots.used + " / " + (slots.total ?? "?");
  const rows = Object.entries(status.classes).map(([c, v]) =>
    "<tr><td>" + c + "</td><td>" + v.running + "</td><td>" + v.waiting + "</td></tr>");
  $("classes").tBodies[0].innerHTML = rows.join("");
  $("kv-used").textContent = kv.blocks_used; $("kv-cached").textContent = kv.blocks_cached;
  $("kv-free").textContent = kv.blocks_free; $("kv-total").textContent = kv.blocks_total;
  $("kv-dtype").textContent = kv.dtype; $("kv-block-size").textContent = kv.block_size ?? "?";
  $("kv-explanation").textContent = kv.explanation || "–";
  $("hit-rate").textContent = pc.enabled ? (pc.hit_rate * 100).toFixed(1) + " %" : "off";
  $("prefix-blocks").textContent = pc.blocks;
  renderSubtrees(pc.largest_subtrees);
  $("spec").textContent = sp.enabled ? sp.accepted + "/" + sp.proposed + " accepted" : "off";
  $("gen-total").textContent = status.tokens.generated_total;
  $("ttft").textContent = ms(status.latency.ttft.mean_s); $("itl").textContent = ms(status.latency.itl.mean_s);
  $("step-model").textContent = ms(e.step_time_fixed_s) + " + " + ms(e.step_time_per_token_s) + " × tokens";
  drawGrid(kv);
  drawRates(status.history);
  document.body.dataset.statusTime = String(status.time);
}

let feedAbort = null;
async function followEvents() {
  if (feedAbort) feedAbort.abort();
  feedAbort = new AbortController();
  const signal = feedAbort.signal;
  try {
    const r = await fetch("/v1/console/events", { headers: authHeaders(), signal });
    if (!r.ok) {
      $("feed-state").textContent = "status feed: HTTP " + r.status + " (set an API key)";
      return;
    }
    $("feed-state").textContent = "live";
    await readSSE(r, (data) => { render(JSON.parse(data)); return true; });
  } catch (err) {
    if (signal.aborted) return;
  }
  $("feed-state").textContent = "reconnecting…";
  setTimeout(followEvents, 2000);
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    followEvents();
  });
  $("chat-form").addEventListener("submit", sendChat);
  $("clear").addEventListener("click", () => { conversation.length = 0; $("messages").textContent = ""; });
  followEvents();
}

init();
