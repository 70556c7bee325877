// Load several workflows, one after another, into ONE session of the real ComfyUI frontend (headless chromium) and
// report on each: templates the way the template browser loads them, files the way a dropped file is loaded.
//
//   COMFY_URL=http://127.0.0.1:PORT CHROMIUM_PATH=/usr/bin/chromium \
//     node tests/ui/load_templates.mjs [--template PACK/NAME]... [WORKFLOW.json]... [--timeout S]
//
// Prints one JSON line on stdout:
//   { frontend_version, templates_listed, boot_console_errors, boot_failed_requests,
//     loads: { "PACK/NAME" | file name: { node_count, expected_node_count, missing_types, dangling_links,
//              error_nodes, combos: {node id: {widget name: [values offered]}}, boxes, overlaps, tiny_badges, dialogs, problems } },
//     timings: { frontend_ready_s, total_s }, error? }
// Each load's problems are the alerts, toasts, page errors, unexpected console errors and failed requests between its
// start and the next load's (see graph_checks.mjs). Dialogs a load opens (missing models) are closed before the next.
// Exit status: 0 every load clean; 1 a load had missing node types, dangling links or problems; 3 the script failed.
// Every request that is not for COMFY_URL is aborted (the page stays on loopback).
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { fileLinkProblems, graphLayout, inspectGraph, problemsOf, recordToastsAndDialogs, runAndReport, launchChromium } from "./graph_checks.mjs";

const args = process.argv.slice(2);
const templates = [], files = [];
let timeout = 240;
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--template") templates.push(args[++i]);
  else if (args[i] === "--timeout") timeout = Number(args[++i]);
  else files.push(args[i]);
}
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
if (!BASE || !(templates.length || files.length)) {
  console.error("usage: COMFY_URL=... CHROMIUM_PATH=... node load_templates.mjs [--template PACK/NAME]... [WORKFLOW.json]...");
  process.exit(3);
}
const t0 = Date.now();
const since = () => (Date.now() - t0) / 1000;
const report = { loads: {}, timings: {}, boot_console_errors: [], boot_failed_requests: [] };

async function main() {
  const browser = await launchChromium();
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
    page.setDefaultTimeout(timeout * 1000);
    // What the current load made (reset per load); before the frontend is ready, the boot's own noise.
    let seen = null;
    page.on("console", (m) => {
      if (m.type() === "error") (seen ? seen.console_errors : report.boot_console_errors).push(m.text().slice(0, 300));
    });
    page.on("response", (r) => {
      if (r.status() >= 400) (seen ? seen.failed_requests : report.boot_failed_requests).push(`${r.status()} ${r.url()}`);
    });
    page.on("pageerror", (e) => seen?.page_errors.push(String(e.message).slice(0, 300)));
    page.on("dialog", async (d) => { seen?.alerts.push(`${d.type()}: ${d.message().slice(0, 300)}`); await d.dismiss(); });
    await page.addInitScript(recordToastsAndDialogs);
    await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => {
      const reg = window.LiteGraph?.registered_node_types;
      return window.app?.graph && reg && Object.keys(reg).length > 0;
    }, null, { polling: 100 });
    report.timings.frontend_ready_s = since();
    report.frontend_version = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);
    report.templates_listed = await page.evaluate(() => window.app.api.getWorkflowTemplates());

    const loads = [...templates.map((t) => ({ key: t, template: t })),
      ...files.map((f) => ({ key: basename(f), workflow: JSON.parse(readFileSync(f, "utf8")) }))];
    for (const load of loads) {
      seen = { alerts: [], page_errors: [], console_errors: [], failed_requests: [] };
      await page.evaluate(() => { window.__h3Seen.toasts = []; window.__h3Seen.dialogs = []; });
      const workflow = await page.evaluate(async ({ template, wf, key }) => {
        const app = window.app;
        if (template) {
          // What the template browser does: fetch the pack's template, load it as a template.
          const [module, name] = template.split("/");
          const answer = await fetch(app.api.apiURL(`/workflow_templates/${module}/${name}.json`));
          if (answer.status !== 200) throw new Error(`template ${template}: HTTP ${answer.status}`);
          wf = await answer.json();
          await app.loadGraphData(wf, true, true, name, { openSource: "template" });
        } else {
          // The path a file dropped onto the canvas takes (schema validation, missing-model check, workflow tab).
          await app.handleFile(new File([JSON.stringify(wf)], key, { type: "application/json" }), "file_drop");
        }
        return wf;
      }, { template: load.template ?? null, wf: load.workflow ?? null, key: load.key });
      const graph = await page.evaluate(inspectGraph);
      await page.waitForTimeout(1500); // toasts, dialogs and media previews (which resize their nodes) render later
      const layout = await page.evaluate(graphLayout);
      const shown = await page.evaluate(() => window.__h3Seen);
      const entry = {
        node_count: graph.node_count,
        expected_node_count: (workflow.nodes || []).length,
        missing_types: [...new Set(graph.missing.map((n) => n.type))],
        dangling_links: [...fileLinkProblems(workflow), ...graph.dangling],
        error_nodes: graph.errors,
        combos: graph.combos,
        boxes: layout.boxes,
        overlaps: layout.overlaps,
        tiny_badges: layout.tinyBadges,
        dialogs: shown.dialogs,
      };
      entry.problems = problemsOf({ ...seen, toasts: shown.toasts });
      report.loads[load.key] = entry;
      // Close what this load opened (the missing-models dialog) so the next load starts on a bare canvas.
      for (let i = 0; i < 3 && await page.locator(".p-dialog").count(); i++) {
        await page.keyboard.press("Escape");
        await page.waitForTimeout(200);
      }
    }
    report.timings.total_s = since();
    const bad = Object.values(report.loads).some((l) => l.missing_types.length || l.dangling_links.length
      || l.problems.length);
    return bad ? 1 : 0;
  } finally {
    await browser.close();
  }
}

await runAndReport(main, report);
