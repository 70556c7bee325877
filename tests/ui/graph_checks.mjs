// What the frontend scripts (load_workflow.mjs, load_templates.mjs) check on a loaded graph, and which console lines
// and failed requests of an offline machine they do not count as problems.
//
// inspectGraph and graphLayout run in the page (page.evaluate): they use nothing but their arguments and window.

// Console noise of an offline machine, excepted by name; anything else a load prints as an error is a problem.
import { chromium } from "playwright-core";

export const OFFLINE_NOISE = [
  /^Connecting to 'https:\/\/api\.comfy\.org\/[^']*' violates the following Content Security Policy/, // registry look-ups
  /^Connecting to 'https:\/\/huggingface\.co\/[^']*' violates the following Content Security Policy/, // the
  /^Fetch API cannot load https:\/\/huggingface\.co\/\S* Refused to connect/, // missing-models dialog asks
  /^Error fetching file size: TypeError: Failed to fetch/, // for each download's size
  /^Failed to load resource: net::ERR_FAILED/, // off-loopback requests the scripts abort
  /^Failed to load resource: the server responded with a status of/, // judged by URL in failed_requests
];
// A fresh user's missing settings files: the frontend probes them at boot.
export const EXPECTED_404 = [/\/user\.css$/, /\/api\/userdata(\/|\?)/];

// Links in the file itself: [id, origin, oslot, target, tslot, type] (v0.4) or objects (v1).
export function fileLinkProblems(wf) {
  const problems = [];
  const nodes = new Map((wf.nodes || []).map((n) => [String(n.id), n]));
  for (const l of wf.links || []) {
    const [id, o, os, t, ts] = Array.isArray(l) ? l : [l.id, l.origin_id, l.origin_slot, l.target_id, l.target_slot];
    const on = nodes.get(String(o)), tn = nodes.get(String(t));
    if (!on) problems.push({ id, why: `file: origin node ${o} does not exist` });
    else if (on.outputs && !on.outputs[os]) problems.push({ id, why: `file: node ${o} has no output slot ${os}` });
    if (!tn) problems.push({ id, why: `file: target node ${t} does not exist` });
    else if (tn.inputs && !tn.inputs[ts]) problems.push({ id, why: `file: node ${t} has no input slot ${ts}` });
  }
  return problems;
}

// In the page: the loaded graph's nodes of unknown types, links that do not join two slots, nodes the frontend marks,
// each node's widgets and the values each combo offers.
export function inspectGraph() {
  const app = window.app, LG = window.LiteGraph;
  const graph = app.graph;
  const nodes = graph.nodes || graph._nodes || [];
  const reg = LG.registered_node_types;
  const missing = nodes.filter((n) => !reg[n.type]).map((n) => ({ id: n.id, type: n.type }));
  const links = graph.links instanceof Map ? [...graph.links.values()] : Object.values(graph.links || {});
  const dangling = [];
  const linkIds = new Set();
  for (const l of links) {
    if (!l) continue;
    linkIds.add(l.id);
    const o = graph.getNodeById(l.origin_id), t = graph.getNodeById(l.target_id);
    if (!o) dangling.push({ id: l.id, why: `origin node ${l.origin_id} does not exist` });
    else if (!o.outputs?.[l.origin_slot]) dangling.push({ id: l.id, why: `node ${l.origin_id} has no output slot ${l.origin_slot}` });
    if (!t) dangling.push({ id: l.id, why: `target node ${l.target_id} does not exist` });
    else if (!t.inputs?.[l.target_slot]) dangling.push({ id: l.id, why: `node ${l.target_id} has no input slot ${l.target_slot}` });
    else if (t.inputs[l.target_slot].link !== l.id) dangling.push({ id: l.id, why: `input ${l.target_id}.${l.target_slot} does not point back at it` });
  }
  for (const n of nodes) {
    for (const [slot, inp] of (n.inputs || []).entries()) {
      if (inp.link != null && !linkIds.has(inp.link)) dangling.push({ id: inp.link, why: `input ${n.id}.${slot} (${inp.name}) refers to a missing link` });
    }
  }
  const errors = nodes.filter((n) => n.has_errors).map((n) => ({ id: n.id, type: n.type }));
  const widgets = Object.fromEntries(nodes.map((n) => [n.id, (n.widgets || []).map((w) => ({ name: w.name, type: w.type }))]));
  // What each combo widget offers the user: {node id: {widget name: [values]}}.
  const offered = (node, w) => {
    const values = typeof w.options?.values === "function" ? w.options.values(w, node) : w.options?.values;
    return Array.isArray(values) ? values.map(String) : [];
  };
  const combos = {};
  for (const node of nodes) {
    const lists = (node.widgets || []).filter((w) => w.type === "combo").map((w) => [w.name, offered(node, w)]);
    if (lists.length) combos[node.id] = Object.fromEntries(lists);
  }
  return { node_count: nodes.length, missing, dangling, errors, widgets, combos };
}

// In the page: each node's box on the canvas (title bar included) as drawn now, every pair that overlaps, and the
// pack's tiny-model badge (web/tiny_badge.js) of each loader that shows one.
export function graphLayout() {
  const app = window.app, LG = window.LiteGraph;
  const nodes = app.graph.nodes || app.graph._nodes || [];
  const titleH = LG.NODE_TITLE_HEIGHT || 30;
  const boxes = nodes.map((n) => ({ id: n.id, type: n.type, title: n.title, x: n.pos[0], y: n.pos[1] - titleH,
    w: n.size[0], h: n.size[1] + titleH }));
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    if (a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h) overlaps.push([a.id, b.id]);
  }
  const tinyBadges = Object.fromEntries(nodes.filter((n) => n.h3TinyBadge?.()).map((n) => [n.id, n.h3TinyBadge()]));
  return { boxes, overlaps, tinyBadges };
}

// The lines a load made that count as problems: alerts, toasts, page errors, console errors and failed requests that
// are not an offline machine's noise.
export function problemsOf({ alerts, toasts, page_errors, console_errors, failed_requests }) {
  return [
    ...alerts.map((a) => `alert: ${a}`),
    ...toasts.map((t) => `toast: ${t}`),
    ...page_errors.map((e) => `page error: ${e}`),
    ...console_errors.filter((e) => !OFFLINE_NOISE.some((re) => re.test(e))).map((e) => `console: ${e}`),
    ...failed_requests.filter((r) => !EXPECTED_404.some((re) => re.test(r))).map((r) => `request: ${r}`),
  ];
}


// A page init script (runs before the frontend): keeps the text of every toast and dialog that appears in
// window.__h3Seen, since both vanish before a test could read them.
export function recordToastsAndDialogs() {
  window.__h3Seen = { toasts: [], dialogs: [] };
  const record = (el) => {
    if (!(el instanceof Element)) return;
    for (const t of [el, ...el.querySelectorAll(".p-toast-message")]) {
      if (t.classList?.contains("p-toast-message")) window.__h3Seen.toasts.push(t.innerText.slice(0, 400));
    }
    for (const d of [el, ...el.querySelectorAll(".p-dialog")]) {
      if (d.classList?.contains("p-dialog")) window.__h3Seen.dialogs.push(d.innerText.slice(0, 600));
    }
  };
  new MutationObserver((muts) => muts.forEach((m) => m.addedNodes.forEach(record)))
    .observe(document, { childList: true, subtree: true });
}


// Run a script's main() and print its JSON report (exit 3 and the stack on a crash). The process exits once the
// whole report is written: a pipe takes it in chunks, and an immediate process.exit would cut a long report.
export async function runAndReport(main, report) {
  let code = 3;
  try {
    code = await main();
  } catch (e) {
    report.error = String(e?.stack || e).slice(0, 4000);
    code = 3;
  }
  report.exit_code = code;
  process.stdout.write(JSON.stringify(report) + "\n", () => process.exit(code));
}


// Headless Chromium as every frontend script here runs it: Debian's binary (CHROMIUM_PATH overrides), no sandbox
// (tests run as root in containers), nothing that reaches the network.
export function launchChromium() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM_PATH || "chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"],
  });
}
