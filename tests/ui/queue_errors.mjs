// Queue a workflow from the real frontend (what the Run button does) and report what the user is shown when
// POST /prompt refuses it: the frontend's per-node errors (the inputs it rings) and the error dialog's text; or,
// with --run-error, when the queued prompt fails at run time: the execution-error dialog.
//
//     COMFY_URL=http://127.0.0.1:8188 CHROMIUM_PATH=... node tests/ui/queue_errors.mjs WORKFLOW.json
//         [--run-error SECONDS] [--show-report]
//     --run-error S: wait up to S seconds for the run's `execution_error` message
//     --show-report: then press the error dialog's "Show Report" and read the report it shows
//
// Prints one JSON line: {node_errors: {id: {class_type, inputs: [input_name...], details: [...]}}, dialogs: [...],
//   dialog_titles: [...], prompt_id, execution_error: <the message as the page's listeners got it> | null,
//   history_error: <that error as the page's api.getHistory() reads it> | null,
//   report: <the report's text> | null}.
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { launchChromium } from "./graph_checks.mjs";

const args = process.argv.slice(2);
const runErrorS = args.includes("--run-error") ? Number(args[args.indexOf("--run-error") + 1]) : 0;
const showReport = args.includes("--show-report");
const file = args.find((a, i) => !a.startsWith("--") && args[i - 1] !== "--run-error");
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
if (!BASE || !file) {
  console.error("usage: COMFY_URL=... CHROMIUM_PATH=... node queue_errors.mjs WORKFLOW.json");
  process.exit(3);
}
const workflow = JSON.parse(readFileSync(file, "utf8"));
const browser = await launchChromium();
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
  page.setDefaultTimeout(180000);
  await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && Object.keys(window.LiteGraph?.registered_node_types || {}).length);
  const report = await page.evaluate(async ({ wf, name, runErrorS }) => {
    const app = window.app;
    let executionError = null, promptId = null;
    app.api.addEventListener("execution_error", ({ detail }) => { executionError = detail; });
    app.api.addEventListener("execution_start", ({ detail }) => { promptId = detail?.prompt_id ?? promptId; });
    await app.handleFile(new File([JSON.stringify(wf)], name, { type: "application/json" }), "file_drop");
    await app.queuePrompt(0, 1);
    for (let i = 0; i < 100 && !app.lastNodeErrors; i++) await new Promise((r) => setTimeout(r, 100));
    for (let i = 0; i < runErrorS * 10 && !executionError; i++) await new Promise((r) => setTimeout(r, 100));
    const errors = app.lastNodeErrors || {};
    const nodeErrors = Object.fromEntries(Object.entries(errors).map(([id, e]) => [id, {
      class_type: e.class_type,
      inputs: e.errors.map((x) => x.extra_info?.input_name ?? null),
      details: e.errors.map((x) => x.details),
    }]));
    await new Promise((r) => setTimeout(r, 500)); // the dialog renders on the next frames
    const dialogs = [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText.slice(0, 2000));
    // The error dialogs' titles (1.32.9's ErrorDialogContent: a placeholder heading above "Show Report").
    const titles = [...document.querySelectorAll(".p-dialog")].filter((d) => d.innerText.includes("Show Report"))
      .map((d) => d.querySelector(".no-results-placeholder h3")?.innerText.trim() ?? null);
    // The run's error as the page's history reads it (what the queue panel's "Report error" opens).
    const history = promptId && typeof app.api.getHistory === "function" ? await app.api.getHistory(20) : null;
    const task = history?.History?.find((t) => t.prompt_id === promptId || t.prompt?.[1] === promptId);
    const historyError = task?.status?.messages?.find((m) => m[0] === "execution_error")?.[1] ?? null;
    return { node_errors: nodeErrors, dialogs, dialog_titles: titles, prompt_id: promptId,
      execution_error: executionError, history_error: historyError, report: null };
  }, { wf: workflow, name: basename(file), runErrorS });
  if (showReport && report.execution_error) {
    await page.locator(".p-dialog button", { hasText: "Show Report" }).first().click();
    const pre = page.locator(".p-dialog pre").first();
    await pre.waitFor();
    await page.waitForFunction(() => document.querySelector(".p-dialog pre")?.innerText.includes("Error Details"));
    report.report = (await pre.innerText()).slice(0, 6000);
  }
  console.log(JSON.stringify(report));
} finally {
  await browser.close();
}
