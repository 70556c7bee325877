// Queue a workflow from the real frontend (what the Run button does) and report what the user is shown when
// POST /prompt refuses it: the frontend's per-node errors (the inputs it rings) and the error dialog's text.
//
//     COMFY_URL=http://127.0.0.1:8188 CHROMIUM_PATH=... node tests/ui/queue_errors.mjs WORKFLOW.json
//
// Prints one JSON line: {node_errors: {id: {class_type, inputs: [input_name...], details: [...]}}, dialogs: [...]}.
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { chromium } from "playwright-core";

const file = process.argv[2];
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
if (!BASE || !file) {
  console.error("usage: COMFY_URL=... CHROMIUM_PATH=... node queue_errors.mjs WORKFLOW.json");
  process.exit(3);
}
const workflow = JSON.parse(readFileSync(file, "utf8"));
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM_PATH || "chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
  page.setDefaultTimeout(180000);
  await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && Object.keys(window.LiteGraph?.registered_node_types || {}).length);
  const report = await page.evaluate(async ({ wf, name }) => {
    const app = window.app;
    await app.handleFile(new File([JSON.stringify(wf)], name, { type: "application/json" }), "file_drop");
    await app.queuePrompt(0, 1);
    for (let i = 0; i < 100 && !app.lastNodeErrors; i++) await new Promise((r) => setTimeout(r, 100));
    const errors = app.lastNodeErrors || {};
    const nodeErrors = Object.fromEntries(Object.entries(errors).map(([id, e]) => [id, {
      class_type: e.class_type,
      inputs: e.errors.map((x) => x.extra_info?.input_name ?? null),
      details: e.errors.map((x) => x.details),
    }]));
    await new Promise((r) => setTimeout(r, 500)); // the dialog renders on the next frames
    const dialogs = [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText.slice(0, 2000));
    return { node_errors: nodeErrors, dialogs };
  }, { wf: workflow, name: basename(file) });
  console.log(JSON.stringify(report));
} finally {
  await browser.close();
}
