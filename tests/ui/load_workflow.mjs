// Load a UI-format workflow into the real ComfyUI frontend in headless Debian chromium and report.
//
//   COMFY_URL=http://127.0.0.1:PORT CHROMIUM_PATH=/usr/bin/chromium \
//     node tests/ui/load_workflow.mjs WORKFLOW.json [--run] [--timeout S] [--screenshot PNG] [--wait-type T]...
//     node tests/ui/load_workflow.mjs --template PACK/NAME [...]   (as the template browser does; the report
//                                                                   adds templates_listed and thumbnail)
//     node tests/ui/load_workflow.mjs --serve   (one browser, many loads: a JSON list of the arguments above per
//                                                stdin line, a report per stdout line; see serve() below; a
//                                                load's --same-page reuses the previous --same-page load's page)
//     --screenshot PNG: the whole graph fitted into a 1600x1000 window, dialogs closed
//
// Prints one JSON line on stdout:
//   { ok, node_count, expected_node_count, missing_types: [type], missing_nodes: [{id, type}],
//     dangling_links: [{id, why}], error_nodes: [{id, type}], prompt: <graphToPrompt().output>,
//     widgets: {node id: [{name, type}]}, boxes: [{id, type, title, x, y, w, h}] (title bar included),
//     overlaps: [[id, id]] (boxes that overlap), tiny_badges: {node id: text} (loaders on the tiny H3),
//     prompt_node_count, run: null | {prompt_id, status_str, completed, outputs, messages, error},
//     console_errors: [..], alerts, toasts, dialogs, page_errors, failed_requests, problems: [..],
//     boot_console_errors, boot_failed_requests,
//     timings: {...} }
// The workflow is loaded the way a file dropped onto the canvas is (app.handleFile).
// Exit status: 0 ok; 1 missing node types or dangling links; 2 the run failed (--run);
// 3 anything else went wrong (the report then has `error`); 4 the load raised an alert, a toast,
// a page error, an unexpected console error or a failed request (listed in `problems`).
// Every request that is not for COMFY_URL is aborted (the page stays on loopback).
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { randomUUID } from "node:crypto";
import { fileLinkProblems, graphLayout, inspectGraph, problemsOf, recordToastsAndDialogs, runAndReport, launchChromium } from "./graph_checks.mjs";

function parseArgs(args) {
  const o = { run: false, timeout: 240, screenshot: null, waitTypes: [], workflow: null, template: null,
    searchTemplates: [], searchNodes: [], serve: false, samePage: false };
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--run") o.run = true;
    else if (a === "--serve") o.serve = true;
    else if (a === "--same-page") o.samePage = true;
    else if (a === "--timeout") o.timeout = Number(args[++i]);
    else if (a === "--screenshot") o.screenshot = args[++i];
    else if (a === "--wait-type") o.waitTypes.push(args[++i]);
    else if (a === "--template") o.template = args[++i];
    else if (a === "--search-templates") o.searchTemplates.push(args[++i]);
    else if (a === "--search-nodes") o.searchNodes.push(args[++i]);
    else if (!o.workflow) o.workflow = a;
    else throw new Error(`unexpected argument ${a}`);
  }
  return o;
}
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
// One load's state: the options, the workflow, its report and its clock (a --serve session resets them per load).
let opt = parseArgs(process.argv.slice(2));
if (!BASE || !(opt.serve || opt.workflow || opt.template || opt.searchTemplates.length || opt.searchNodes.length)) {
  console.error("usage: COMFY_URL=... CHROMIUM_PATH=... node load_workflow.mjs WORKFLOW.json [--run] [--timeout S] [--screenshot PNG] [--wait-type T]");
  process.exit(3);
}
let workflow = null;
let t0 = Date.now();
const since = () => (Date.now() - t0) / 1000;
let report = { ok: false, workflow: opt.workflow, timings: {}, console_errors: [], run: null };
let shared = null; // --serve: the one browser every load opens its own context in
let kept = null; // --serve: { context, page } a --same-page load left open for the next

async function main() {
  if (opt.workflow) workflow = JSON.parse(readFileSync(opt.workflow, "utf8"));
  // What a user would see or what broke: window.alert/confirm, toasts (the frontend's alerts),
  // dialogs (missing nodes / missing models), uncaught page errors, console errors.
  report.alerts = []; report.toasts = []; report.dialogs = []; report.page_errors = [];
  report.failed_requests = [];
  // Until the frontend is ready nothing of the workflow has run: what the frontend's own boot logs
  // (frontend 1.32.9 sets LiteGraph.Canvas.MinFontSizeForLOD before defining it, a TypeError; a fresh
  // user's settings files are 404s) is reported apart and judged by nobody here.
  report.boot_console_errors = []; report.boot_failed_requests = [];
  const viewport = opt.screenshot ? { width: 1600, height: 1000 } : { width: 1400, height: 900 };
  // --same-page (a --serve session only): this load goes into the page the session's previous --same-page load
  // left open, its frontend already booted (a boot is ~4.5 CPU-s of chromium), as a user loads one template after
  // another. Its report covers what happened from this load's start; dialogs left open are closed first.
  const reuse = Boolean(shared && kept && opt.samePage);
  if (kept && !reuse) { await kept.context.close().catch(() => {}); kept = null; }
  const browser = shared || await launchChromium();
  // a load of a session that does not reuse a page starts as a fresh browser does: a context of its own
  const context = reuse ? kept.context : shared ? await browser.newContext() : null;
  let page = reuse ? kept.page : null, keep = false;
  try {
    if (reuse) {
      report.timings.frontend_ready_s = 0; // booted by an earlier load: everything from here is this load's
      page.setDefaultTimeout(opt.timeout * 1000);
      await page.setViewportSize(viewport);
      for (let i = 0; i < 2; i++) await page.keyboard.press("Escape");
      await page.waitForTimeout(300);
      await page.evaluate(() => { window.__h3Seen = { toasts: [], dialogs: [] }; });
    } else {
      page = await (context || browser).newPage({ viewport });
      await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
      // The handlers write into `report`, the current load's (a --same-page load has a report of its own).
      const booting = () => report.timings.frontend_ready_s === undefined;
      page.on("console", (m) => {
        if (m.type() !== "error") return;
        (booting() ? report.boot_console_errors : report.console_errors).push(m.text().slice(0, 300));
      });
      page.on("response", (r) => {
        if (r.status() >= 400) (booting() ? report.boot_failed_requests : report.failed_requests).push(`${r.status()} ${r.url()}`);
      });
      page.on("pageerror", (e) => report.page_errors.push(String(e.message).slice(0, 300)));
      page.on("dialog", async (d) => { report.alerts.push(`${d.type()}: ${d.message().slice(0, 300)}`); await d.dismiss(); });
      await page.addInitScript(recordToastsAndDialogs);
      page.setDefaultTimeout(opt.timeout * 1000);

      await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
    }
    await page.waitForFunction(
      (types) => {
        const reg = window.LiteGraph?.registered_node_types;
        return window.app?.graph && reg && Object.keys(reg).length > 0 && types.every((t) => reg[t]);
      },
      opt.waitTypes,
      { polling: 100 },
    );
    if (!reuse) report.timings.frontend_ready_s = since();
    keep = Boolean(shared && opt.samePage);

    if (opt.searchTemplates.length || opt.searchNodes.length) {
      // What a user finds by typing into the template browser's search and the canvas's node search (double-click).
      report.node_search = {}; report.node_search_tries = {};
      if (opt.searchNodes.length) await page.evaluate(() => window.app.graph.clear()); // an empty canvas to click on
      for (const query of opt.searchNodes) {
        const canvas = page.locator("#graph-canvas");
        // Frontend 1.32.9's search box, or 1.49's dialog ("Add a node...", each result a `result-item` whose first
        // line is the display name).
        const box = page.locator(".comfy-vue-node-search-container input, "
          + ".p-dialog input[placeholder^='Add a node']").first();
        // A double-click whose two clicks the canvas sees too far apart (a busy machine: the page's main thread
        // stalls between them) is two clicks and opens nothing; a user double-clicks again, and so does this. The
        // box opens within a second when the double-click counted, so a try waits 8 s, not the whole timeout.
        for (let attempt = 1; ; attempt++) {
          await canvas.dblclick({ position: { x: 700, y: 500 } });
          try {
            await box.waitFor({ timeout: Math.min(8000, opt.timeout * 1000) });
            report.node_search_tries[query] = attempt;
            break;
          } catch (e) {
            if (attempt >= 8) throw e;
            await page.keyboard.press("Escape");
          }
        }
        await box.fill(query);
        await page.waitForTimeout(1200);
        report.node_search[query] = await page.locator(".comfy-vue-node-search-container .option-display-name, "
          + ".p-autocomplete-overlay .option-display-name, .p-dialog [data-testid='result-item']").evaluateAll(
          (items) => items.map((i) => i.innerText.trim().split("\n")[0]));
        await page.keyboard.press("Escape");
        await page.waitForTimeout(300);
        report.timings[`node_search ${query}`] = since();
      }
      report.template_search = {};
      if (opt.searchTemplates.length) {
        await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
        await page.locator('[data-testid="template-workflows-content"]').waitFor();
        await page.waitForTimeout(1500); // the template list loads after the dialog opens
        // 1.32.9's browser is a PrimeVue dialog; 1.49's a page of its own with the search in its header.
        const box = page.locator(".p-dialog, header").getByPlaceholder(/search/i).filter({ visible: true }).first();
        const cards = () => page.locator('[data-testid^="template-workflow-"]').evaluateAll(
          (found) => found.map((c) => c.getAttribute("data-testid").replace("template-workflow-", "")));
        await page.locator('[data-testid^="template-workflow-"]').first().waitFor(); // the full list, before a search
        await page.waitForTimeout(1000);
        // Each query starts from an empty grid (a search that matches nothing), so its own result always shows as a
        // change: compared with the previous query's cards instead, a query that shows the same cards (all of them,
        // or "MiniMax" after "H3") could only be told apart from a search not yet applied by a 15 s wait.
        const typed = async (text) => {
          await box.click(); // typed as a user types: a programmatic fill does not reach the debounced search
          await page.keyboard.press("Control+A");
          await page.keyboard.press("Backspace");
          await page.keyboard.type(text, { delay: 60 });
        };
        for (const query of opt.searchTemplates) {
          await typed("zqxjkvzqxjkv"); // letters no template title holds
          await page.waitForFunction(() => !document.querySelector('[data-testid^="template-workflow-"]'), null,
            { timeout: 15000, polling: 100 });
          await typed(query);
          // The search is debounced and the grid re-renders later: wait until cards show, then hold still.
          const deadline = Date.now() + 15000;
          let last = "[]", stableSince = Date.now();
          while (Date.now() < deadline) {
            await page.waitForTimeout(300);
            const now = JSON.stringify(await cards());
            if (now !== last) { last = now; stableSince = Date.now(); }
            if (last !== "[]" && Date.now() - stableSince > 3000) break;
          }
          report.template_search[query] = JSON.parse(last);
          report.timings[`template_search ${query}`] = since();
        }
      }
      if (!opt.workflow && !opt.template) { report.ok = true; return 0; }
    }
    if (opt.template) {
      // What the template browser does: list the custom nodes' templates, fetch one, show its thumbnail.
      const [module, name] = opt.template.split("/");
      const t = await page.evaluate(async ({ module, name }) => {
        const api = window.app.api;
        const listed = await api.getWorkflowTemplates();
        const thumb = await fetch(api.apiURL(`/workflow_templates/${module}/${name}.jpg`));
        const wf = await fetch(api.apiURL(`/workflow_templates/${module}/${name}.json`));
        return {
          listed, thumbnail: { status: thumb.status, type: thumb.headers.get("content-type"), bytes: (await thumb.arrayBuffer()).byteLength },
          workflow: wf.status === 200 ? await wf.json() : null, workflow_status: wf.status,
        };
      }, { module, name });
      report.templates_listed = t.listed;
      report.thumbnail = t.thumbnail;
      if (!t.workflow) throw new Error(`template ${opt.template}: HTTP ${t.workflow_status}`);
      workflow = t.workflow;
    }
    await page.evaluate(async ({ wf, name, template }) => {
      const app = window.app;
      if (template) await app.loadGraphData(wf, true, true, name, { openSource: "template" });
      // The path a file dropped onto the canvas takes (schema validation, missing-model check, workflow tab).
      else await app.handleFile(new File([JSON.stringify(wf)], name, { type: "application/json" }), "file_drop");
    }, { wf: workflow, name: opt.template ? opt.template.split("/")[1] : basename(opt.workflow), template: !!opt.template });
    const loaded = await page.evaluate(inspectGraph); // before graphToPrompt, as the graph was loaded
    Object.assign(loaded, await page.evaluate(async () => {
      try {
        return { prompt: (await window.app.graphToPrompt()).output, promptError: null };
      } catch (e) {
        return { prompt: null, promptError: String(e?.stack || e) };
      }
    }));
    report.timings.loaded_s = since();
    await page.waitForTimeout(1500); // toasts, dialogs and media previews (which resize their nodes) render on later frames
    const seen = await page.evaluate(() => window.__h3Seen);
    const layout = await page.evaluate(graphLayout); // boxes (title bar included), overlaps, tiny badges
    report.boxes = layout.boxes;
    report.overlaps = layout.overlaps;
    report.tiny_badges = layout.tinyBadges;
    report.toasts = seen.toasts;
    report.dialogs = seen.dialogs;

    report.node_count = loaded.node_count;
    report.expected_node_count = (workflow.nodes || []).length;
    report.missing_nodes = loaded.missing;
    report.missing_types = [...new Set(loaded.missing.map((n) => n.type))];
    report.dangling_links = [...fileLinkProblems(workflow), ...loaded.dangling];
    report.error_nodes = loaded.errors;
    report.prompt = loaded.prompt;
    report.widgets = loaded.widgets;
    report.prompt_node_count = loaded.prompt ? Object.keys(loaded.prompt).length : 0;
    if (loaded.promptError) report.prompt_error = loaded.promptError;

    report.problems = problemsOf(report);
    if (opt.screenshot) {
      // The whole graph in view, as a user sees it after closing the dialogs.
      await page.keyboard.press("Escape");
      await page.evaluate(async () => {
        const canvas = window.app.canvas;
        canvas.min_font_size_for_lod = 0; // draw text at any zoom (a small screenshot stays readable)
        await window.app.extensionManager.command.execute("Comfy.Canvas.FitView");
        canvas.setDirty(true, true);
      });
      await page.waitForTimeout(700);
      await page.screenshot({ path: opt.screenshot });
    }

    const structural = report.missing_types.length || report.dangling_links.length;
    if (opt.run && !structural && loaded.prompt) report.run = await runPrompt(loaded.prompt);
    report.timings.total_s = since();
    if (structural) return 1;
    if (loaded.promptError) { report.error = "graphToPrompt failed"; return 3; }
    if (report.problems.length) return 4;
    if (opt.run && report.run?.status_str !== "success") return 2;
    report.ok = true;
    return 0;
  } catch (e) {
    keep = false; // a page a load failed in is not handed to the next
    throw e;
  } finally {
    if (keep) kept = { context, page };
    else if (context) { kept = null; await context.close(); }
    else await browser.close();
  }
}

// Queue graphToPrompt()'s output from node (not the page) and poll /history until it is done.
async function runPrompt(prompt) {
  const clientId = randomUUID();
  const r = await fetch(`${BASE}/prompt`, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt, client_id: clientId }),
  });
  const body = await r.json();
  if (r.status !== 200) return { status_str: "rejected", http_status: r.status, error: body };
  const id = body.prompt_id;
  const deadline = Date.now() + opt.timeout * 1000;
  while (Date.now() < deadline) {
    const h = await (await fetch(`${BASE}/history/${id}`)).json();
    const entry = h[id];
    if (entry?.status?.completed || entry?.status?.status_str === "error") {
      const messages = entry.status.messages || [];
      const err = messages.find((m) => m[0] === "execution_error");
      return {
        prompt_id: id, status_str: entry.status.status_str, completed: entry.status.completed,
        outputs: entry.outputs, messages: messages.map((m) => m[0]), error: err ? err[1] : null,
      };
    }
    await new Promise((res) => setTimeout(res, 200));
  }
  await fetch(`${BASE}/interrupt`, { method: "POST", body: JSON.stringify({ prompt_id: id }) });
  return { prompt_id: id, status_str: "timeout" };
}

// --serve: one browser for many loads. Each stdin line is one load's arguments as a JSON list (as on the command
// line); each answer is one JSON report line on stdout, its exit status in `exit_code`, in a browser context of its
// own (no storage, cache or page shared with the load before). EOF closes the browser.
async function serve() {
  const { createInterface } = await import("node:readline");
  shared = await launchChromium();
  for await (const line of createInterface({ input: process.stdin })) {
    if (!line.trim()) continue;
    try {
      opt = parseArgs(JSON.parse(line));
    } catch (e) {
      process.stdout.write(JSON.stringify({ ok: false, error: `bad request: ${e}`, exit_code: 3 }) + "\n");
      continue;
    }
    workflow = null;
    t0 = Date.now();
    report = { ok: false, workflow: opt.workflow, timings: {}, console_errors: [], run: null };
    let code = 3;
    try {
      code = await main();
    } catch (e) {
      report.error = String(e?.stack || e).slice(0, 4000);
    }
    report.exit_code = code;
    await new Promise((done) => process.stdout.write(JSON.stringify(report) + "\n", done));
  }
  if (kept) await kept.context.close().catch(() => {});
  await shared.close();
}

if (opt.serve) await serve();
else await runAndReport(main, report);
