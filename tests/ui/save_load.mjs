// MiniMax H3 Save -> Load Conditioning in the real frontend: load an API graph with a Save Conditioning node, add a
// Load Conditioning node, run the graph as the Run button does, and report what the user sees afterwards: the Save
// node's message (all of it, in its box), the choices of the Load node that was already there, and those of a Load
// node added after the run, without Refresh Node Definitions.
//
//     COMFY_URL=http://127.0.0.1:8188 CHROMIUM_PATH=... node tests/ui/save_load.mjs API_GRAPH.json [--shot PNG]
//
// Prints one JSON line: {saved_text, saved_widget, before: [choices], existing: [choices], added: [choices],
//   status, exit_code}.
import { readFileSync } from "node:fs";
import { launchChromium, runAndReport } from "./graph_checks.mjs";

const args = process.argv.slice(2);
const file = args.find((a, i) => !a.startsWith("--") && args[i - 1] !== "--shot");
const shot = args.includes("--shot") ? args[args.indexOf("--shot") + 1] : null;
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
const report = {};

await runAndReport(async () => {
  if (!BASE || !file) throw new Error("usage: COMFY_URL=... node save_load.mjs API_GRAPH.json [--shot PNG]");
  const graph = JSON.parse(readFileSync(file, "utf8"));
  const browser = await launchChromium();
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
    page.setDefaultTimeout(300000);
    await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => window.app?.graph && window.LiteGraph?.registered_node_types?.H3SplitLoadConditioning);
    Object.assign(report, await page.evaluate(async ({ graph }) => {
      const app = window.app, LG = window.LiteGraph;
      const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
      const choices = (node) => {
        const combo = node.widgets.find((w) => w.name === "conditioning_file");
        const values = combo.options.values;
        return [...(typeof values === "function" ? values() : values)];
      };
      let status = null;
      app.api.addEventListener("execution_success", () => { status = "success"; });
      app.api.addEventListener("execution_error", () => { status = "error"; });
      await app.loadApiJson(graph, "save_load.json");
      const existing = LG.createNode("H3SplitLoadConditioning");
      app.graph.add(existing);
      await sleep(1000); // its own refresh of the list (new nodes ask the server once)
      const before = choices(existing);
      await app.queuePrompt(0, 1);
      for (let i = 0; i < 2400 && !status; i++) await sleep(250);
      await sleep(1500); // the executed message, then the Load nodes' refresh
      const save = (app.graph.nodes || app.graph._nodes).find((n) => n.comfyClass === "H3SplitSaveConditioning");
      const widget = save?.widgets?.find((w) => w.name === "saved");
      const added = LG.createNode("H3SplitLoadConditioning");
      app.graph.add(added);
      await sleep(1500);
      return {
        status, before, existing: choices(existing), added: choices(added),
        saved_text: widget ? String(widget.value) : null,
        saved_widget: widget ? (widget.element?.tagName ?? widget.inputEl?.tagName ?? widget.type) : null,
      };
    }, { graph }));
    if (shot) await page.screenshot({ path: shot });
    return report.status === "success" ? 0 : 1;
  } finally {
    await browser.close();
  }
}, report);
