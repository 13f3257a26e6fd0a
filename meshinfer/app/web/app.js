"use strict";
// meshinfer's page: a chat over POST /v1/chat/completions (streamed) and a live view of the
// mesh from GET /v1/mesh, polled every 2 s. No framework, no build step.
// Everything shown that comes from the model, the mesh or the server is set as text
// (textContent, or text nodes through el()): never as HTML. Peer addresses and replies are
// attacker-controlled.

const KEY_STORAGE = "meshinfer-api-key";  // sessionStorage only: gone when the tab closes
const POLL_MS = 2000;
const STATES = ["ready", "joining", "draining", "unreachable", "gone"];
const PROBLEMS = {
  no_route: ["No complete route",
    "Start a peer for the missing layers (meshinfer join --layers auto), or wait for one to come back."],
  unauthenticated: ["Private mesh: this server has no key",
    "Restart meshinfer serve with --mesh-key-file pointing at the mesh's key."],
  peer_unavailable: ["Every peer is gone",
    "Check that the peers are running and that serve --peers names one of them. This page keeps trying."],
  server: ["The meshinfer server does not answer",
    "Is meshinfer serve still running? This page keeps trying."],
};
const state = { messages: [], controller: null };

function $(id) { return document.getElementById(id); }

/** A new element; props "class" and "text" are special, others are attributes; children are nodes or strings. */
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  node.append(...children.map((c) => (c instanceof Node ? c : String(c))));
  return node;
}

function fmt(x, digits) { return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "—"; }

// ------------------------------------------------------------------ the key
function authHeaders(extra) {
  const headers = Object.assign({}, extra);
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function askForKey() {
  const form = $("key-form");
  $("key-error").textContent = sessionStorage.getItem(KEY_STORAGE) ? "The server refused that key." : "";
  if (form.hidden) { form.hidden = false; $("key-input").focus(); }
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-input").value = "";
  $("key-form").hidden = true;
  pollMesh();
}

/** {status, message, code} of a failed response (OpenAI's error shape when the server sent one). */
async function errorOf(resp) {
  const out = { status: resp.status, message: resp.status + " " + resp.statusText, code: null };
  try {
    const body = await resp.json();
    if (body && body.error) { out.message = String(body.error.message); out.code = body.error.code; }
  } catch (e) { /* not JSON */ }
  return out;
}

// ------------------------------------------------------------------ chat
/** Render text into container: ``` fences become <pre><code>, `spans` become <code>, the rest
 * stays plain text (newlines around a fence are dropped: the block already breaks the line). */
function renderText(container, text) {
  container.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 0) {
      if (i > 0) part = part.replace(/^\n+/, "");
      if (i < parts.length - 1) part = part.replace(/\n+$/, "");
      if (part) container.append(el("div", { class: "text" }, ...inlineCode(part)));
      return;
    }
    const nl = part.indexOf("\n");
    const lang = nl < 0 ? "" : part.slice(0, nl).trim();
    const code = el("code", {}, (nl < 0 ? part : part.slice(nl + 1)).replace(/\n$/, ""));
    if (/^[A-Za-z0-9_+-]{1,20}$/.test(lang)) code.className = "language-" + lang;
    container.append(el("pre", {}, code));
  });
}

/** Text and <code> nodes for `inline code` (an unpaired backtick stays text). */
function inlineCode(text) {
  const pieces = text.split("`");
  if (pieces.length % 2 === 0) return [text];
  return pieces.map((p, i) => (i % 2 === 1 ? el("code", {}, p) : p)).filter((p) => p !== "");
}

function addMessage(role, text) {
  const node = el("div", { class: "msg " + role }, el("div", { class: "role", text: role }),
    el("div", { class: "content" }), el("div", { class: "stats" }));
  renderText(node.querySelector(".content"), text);
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || state.messages.length === 0;
}

/** The data: payloads of a server-sent event stream, as they arrive. */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function requestBody() {
  const body = { model: $("model").value, messages: state.messages.slice(), stream: true };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat($("temperature").value);
  if (temperature > 0) body.temperature = temperature;
  return body;
}

/** Stream one assistant reply to the conversation so far into a new message. */
async function runReply() {
  const node = addMessage("assistant", "");
  const content = node.querySelector(".content");
  const reply = { text: "", finish: null, info: null, error: null, ttftMs: null };
  if (!$("model").value) {
    reply.error = "No model to ask: the mesh has no peers yet (see the Mesh view).";
  } else {
    state.controller = new AbortController();
    setBusy(true);
    try {
      await streamInto(reply, content, state.controller.signal);
    } catch (e) {
      if (e.name === "AbortError") reply.finish = "stopped";
      else reply.error = e.message;
    } finally {
      state.controller = null;
    }
  }
  if (reply.text) state.messages.push({ role: "assistant", content: reply.text });
  node.dataset.finish = reply.finish || "error";
  node.querySelector(".stats").textContent = statsLine(reply);
  if (reply.error) node.append(el("div", { class: "error-text", text: reply.error }));
  setBusy(false);
  pollMesh();
}

async function streamInto(reply, content, signal) {
  const t0 = performance.now();
  const resp = await fetch("/v1/chat/completions", { method: "POST", signal, body: JSON.stringify(requestBody()),
    headers: authHeaders({ "Content-Type": "application/json" }) });
  if (!resp.ok) {
    const e = await errorOf(resp);
    if (e.status === 401) askForKey();
    throw new Error(e.message);
  }
  for await (const data of sseData(resp.body)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) { reply.error = String(chunk.error.message); continue; }
    for (const choice of chunk.choices || []) {
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (reply.ttftMs === null) reply.ttftMs = performance.now() - t0;
        reply.text += piece;
        renderText(content, reply.text);
      }
      if (choice.finish_reason) reply.finish = String(choice.finish_reason);
    }
    if (chunk.meshinfer) reply.info = chunk.meshinfer;
  }
}

function statsLine(reply) {
  const parts = [reply.finish ? "finish: " + reply.finish : "failed"];
  const info = reply.info;
  if (info) {
    parts.push(fmt(info.tokens_per_s, 1) + " tok/s", "TTFT " + fmt(info.ttft_ms, 0) + " ms",
      (info.route || []).length + " hop(s)");
    if ((info.failovers || []).length) parts.push(info.failovers.length + " failover(s)");
    if ((info.detections || []).length) parts.push(info.detections.length + " lying peer(s) caught");
    if ((info.unverified || []).length) parts.push("UNVERIFIED: " + info.unverified.length + " hop(s) nobody checked");
  } else if (reply.ttftMs !== null) {
    parts.push("first text after " + fmt(reply.ttftMs, 0) + " ms");
  }
  return parts.join(" · ");
}

function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (state.controller || !prompt.trim()) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  runReply();
}

function regenerate() {
  if (state.controller || state.messages.length === 0) return;
  const last = $("messages").lastElementChild;
  if (last && last.classList.contains("assistant")) {
    if (state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
    last.remove();
  }
  runReply();
}

function newConversation() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  setBusy(false);
  $("prompt").focus();
}

// ------------------------------------------------------------------ mesh
function showProblem(code, message) {
  const box = $("problem");
  if (!code) { box.hidden = true; box.replaceChildren(); return; }
  const [title, hint] = PROBLEMS[code] || ["The mesh cannot answer", ""];
  box.dataset.code = code;
  box.replaceChildren(el("strong", { text: title }), el("div", { text: message }), el("div", { text: hint }));
  box.hidden = false;
}

async function pollMesh() {
  let resp;
  try {
    resp = await fetch("/v1/mesh", { headers: authHeaders() });
  } catch (e) {
    showProblem("server", "GET /v1/mesh failed: " + e.message);
    return;
  }
  if (resp.status === 401) { askForKey(); return; }
  if (!resp.ok) { showProblem("server", (await errorOf(resp)).message); return; }
  $("key-form").hidden = true;
  const mesh = await resp.json();
  showProblem(mesh.problem && mesh.problem.code, mesh.problem && mesh.problem.message);
  renderMesh(mesh);
}

async function pollLoop() {
  try { await pollMesh(); } finally { setTimeout(pollLoop, POLL_MS); }
}

function renderMesh(mesh) {
  const peers = mesh.peers || [];
  const ready = peers.filter((p) => p.state === "ready").length;
  $("mesh-summary").textContent = peers.length + " peer(s), " + ready + " ready";
  renderModels(mesh.groups || []);
  $("peers").tBodies[0].replaceChildren(...peers.map(peerRow));
  $("groups").replaceChildren(...(mesh.groups || []).map(groupBlock));
  renderLastReply(mesh.last_reply);
  renderEvents(mesh.events || []);
}

function renderModels(groups) {
  const select = $("model");
  const ids = [...new Set([...groups.filter((g) => g.route), ...groups].map((g) => String(g.model)))];
  const current = select.value;
  if (ids.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  select.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
  if (ids.includes(current)) select.value = current;
}

function peerRow(p) {
  const st = STATES.includes(p.state) ? p.state : "other";
  const cells = [
    el("td", { title: String(p.peer_id), text: String(p.peer_id).slice(0, 12) }),
    el("td", { class: "address", text: p.address || "—" }),
    el("td", { text: p.model }), el("td", { text: p.layers }), el("td", { text: p.device }),
    el("td", { text: p.precision }),
    el("td", { title: String(p.weights_hash), text: String(p.weights_hash).slice(0, 12) }),
    el("td", { class: "state state-" + st, text: p.state }),
    el("td", { class: "num", text: fmt(p.rtt_ms, 1) }),
    el("td", { class: "num", text: p.free_kv_tokens }),
  ];
  return el("tr", { "data-peer-id": String(p.peer_id), "data-state": st }, ...cells);
}

function groupBlock(g) {
  const counts = g.coverage || [];
  const strip = el("div", { class: "strip" }, ...counts.map((n, i) => el("div", {
    class: "cell" + (n === 0 ? " gap" : n > 1 ? " many" : ""), title: "layer " + i + ": " + n + " peer(s)",
    text: n === 0 ? "" : n })));
  const route = g.route
    ? "route: " + g.route.map((h) => String(h.peer_id).slice(0, 12) + " [" + h.layers + "]").join(" → ")
      + " (~" + fmt(g.estimated_ms_per_token, 1) + " ms/token estimated)"
    : "no complete route: layers " + (g.missing_layers || []).join(", ") + " have no reachable peer";
  return el("div", { class: "group", "data-model": String(g.model) },
    el("div", {}, el("strong", { text: g.model }), " · " + g.precision + (g.backend && g.backend !== "any" ? " on " + g.backend : "")
      + " · " + g.num_layers + " layers · "
      + g.usable + " usable peer(s)"),
    strip, el("div", { class: "axis" }, el("span", { text: "layer 0" }), el("span", { text: "layer " + (counts.length - 1) })),
    el("div", { class: g.route ? "route" : "route error-text", text: route }));
}

function renderLastReply(r) {
  const box = $("last-route");
  if (!r) { box.replaceChildren(el("p", { class: "muted", text: "No reply yet." })); return; }
  const head = el("tr", {}, ...["hop", "peer", "address", "layers", "device", "compute ms/token", "network ms/token"]
    .map((h) => el("th", { text: h })));
  const rows = (r.route || []).map((h, i) => el("tr", { class: "hop" }, el("td", { text: i + 1 }),
    el("td", { title: String(h.peer_id), text: String(h.peer_id).slice(0, 12) }), el("td", { text: h.address || "—" }),
    el("td", { text: h.layers }), el("td", { text: h.device }),
    el("td", { class: "num compute", text: fmt(h.compute_ms_per_token, 2) }),
    el("td", { class: "num network", text: fmt(h.network_ms_per_token, 2) })));
  const when = new Date(r.time * 1000).toLocaleTimeString();
  box.replaceChildren(el("p", { text: r.model + " at " + when + " · finish: " + r.finish_reason + " · "
    + r.completion_tokens + " tokens · " + fmt(r.tokens_per_s, 1) + " tok/s · TTFT " + fmt(r.ttft_ms, 0) + " ms" }),
    el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function renderEvents(events) {
  const items = events.slice().reverse().map((e) => {
    const when = new Date(e.time * 1000).toLocaleTimeString();
    const what = e.kind === "detection"
      ? "lying peer " + String(e.peer).slice(0, 12) + (e.layers ? " [" + e.layers + "]" : "") + " excluded: " + e.reason
      : "failover from " + (e.failed || []).map((p) => String(p).slice(0, 12)).join(", ") + ": " + e.reason;
    return el("li", { class: "event " + (e.kind === "detection" ? "detection" : "failover"), text: when + " " + what });
  });
  $("events").replaceChildren(...(items.length ? items : [el("li", { class: "muted", text: "None so far." })]));
}

// ------------------------------------------------------------------ start
function showView(name) {
  for (const v of ["chat", "mesh"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).classList.toggle("active", v === name);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("tab-mesh").addEventListener("click", () => showView("mesh"));
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newConversation);
  $("key-form").addEventListener("submit", useKey);
  pollLoop();
});
