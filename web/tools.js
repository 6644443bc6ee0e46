// voxpipe browser demo, tool calls: each `tool.call` of a reply as a small line under the
// reply's text ("⚙ set_timer(minutes=5) → {"status": "set", …}"), completed by its
// `tool.output` (the result, or what went wrong, marked as an error). docs/PROTOCOL.md
// "Tool calls"; docs/TOOLS.md.

const MAX_SHOWN = 160; // characters of a result or an argument shown; the whole is the line's title

function clip(text, max = MAX_SHOWN) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

// A call as it reads in code: `name(key=value, …)`, each value as JSON.
export function callText(name, args) {
  const parts = Object.entries(args || {}).map(([k, v]) => `${k}=${clip(JSON.stringify(v) ?? "null", 60)}`);
  return `${name}(${parts.join(", ")})`;
}

// The part after the arrow: the result as the model got it, or the error.
export function outputText(ev) {
  if (ev.error) return `error: ${ev.error}`;
  return ev.output;
}

// The list of a reply's tool lines (made on its first call), between its text and its meta.
function list(el) {
  let box = el.querySelector(".tools");
  if (!box) {
    box = document.createElement("ul");
    box.className = "tools";
    el.querySelector(".meta").before(box);
  }
  return box;
}

// Show `tool.call` `ev` in reply bubble `el`: the call, its result still to come.
export function showToolCall(el, ev) {
  const li = document.createElement("li");
  li.className = "tool pending";
  li.dataset.callId = ev.call_id;
  li.dataset.runsOn = ev.runs_on;
  const call = document.createElement("span");
  call.className = "tool-call";
  call.textContent = `⚙ ${callText(ev.name, ev.arguments)}`;
  const result = document.createElement("span");
  result.className = "tool-result";
  result.textContent = ev.runs_on === "client" ? " → (waiting for this page)" : " → …";
  li.title = `${ev.name} ${JSON.stringify(ev.arguments || {})}`;
  li.append(call, result);
  list(el).append(li);
  return li;
}

// Complete the line of `tool.output` `ev`'s call in `el` (a line of its own if its call was
// not shown): the result, or the error (class `error`), and how long the call took.
export function showToolOutput(el, ev) {
  let li = [...el.querySelectorAll(".tools .tool")].find((x) => x.dataset.callId === ev.call_id);
  if (!li) li = showToolCall(el, { call_id: ev.call_id, name: ev.name, arguments: {}, runs_on: "server" });
  li.classList.remove("pending");
  li.classList.toggle("error", !!ev.error);
  const text = outputText(ev);
  li.querySelector(".tool-result").textContent = ` → ${clip(text)}`;
  li.title = `${li.title}\n→ ${text}${Number.isFinite(ev.ms) ? ` (${Math.round(ev.ms)} ms)` : ""}`;
  return li;
}

// The event log's line for a tool event.
export function logLine(ev) {
  if (ev.type === "tool.call") {
    return `← tool.call #${ev.response_id} ${callText(ev.name, ev.arguments)} (runs on the ${ev.runs_on})`;
  }
  return `← tool.output #${ev.response_id} ${ev.name}: ${clip(outputText(ev))} (${Math.round(ev.ms || 0)} ms)`;
}
