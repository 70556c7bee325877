// The pack's progress text in the real frontend: one line fits a node, and web/progress_text.js clears the pack's
// lines when the next run starts (frontend 1.32.9 keeps them; UX review 4).
//
//   COMFY_URL=http://127.0.0.1:PORT CHROMIUM_PATH=/usr/bin/chromium node tests/ui/progress_text.mjs WORKFLOW.json \
//     LINE_JSON
//
// WORKFLOW.json: a UI-format graph with the pack's loaders stacked as in the templates and one core node.
// LINE_JSON: {"fitted": [lines as nodes/progress_text.py sends them], "old": a line as it used to be}.
// The lines are shown the way the server's progress_text message shows them (the frontend's own handler), on the
// DiT loader (the column's last, the narrowest node) and on the core node; each line's rendered height is measured
// against a one-word line on the same node. Prints one JSON line:
//   { frontend_version, node: {id, type, width}, heights: {text: rendered height / one line's}, before_start: {pack,
//     core}, after_start: {pack, core} (whether each node still has its text widget), error? }
import { readFileSync } from "node:fs";
import { launchChromium } from "./graph_checks.mjs";

const [workflowPath, linesJson] = process.argv.slice(2);
const BASE = (process.env.COMFY_URL || "").replace(/\/$/, "");
const report = {};

async function main() {
  const workflow = JSON.parse(readFileSync(workflowPath, "utf8"));
  const lines = JSON.parse(linesJson);
  const browser = await launchChromium();
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    await page.route((u) => !u.href.startsWith(BASE), (r) => r.abort());
    page.setDefaultTimeout(120000);
    await page.goto(BASE + "/", { waitUntil: "domcontentloaded" });
    await page.waitForFunction(() => {
      const reg = window.LiteGraph?.registered_node_types;
      return window.app?.graph && reg && Object.keys(reg).length > 0;
    }, null, { polling: 100 });
    report.frontend_version = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);
    await page.evaluate(async (wf) => { await window.app.loadGraphData(wf, true, true, "progress text"); }, workflow);
    for (let i = 0; i < 3 && await page.locator(".p-dialog").count(); i++) {
      await page.keyboard.press("Escape");
      await page.waitForTimeout(200);
    }
    // The DiT loader in view at zoom 1 (DOM widgets hide when zoomed out or off screen).
    const node = await page.evaluate(() => {
      const app = window.app;
      const nodes = app.graph._nodes ?? app.graph.nodes;
      const dit = nodes.find((n) => n.type === "H3SplitDiTLoader");
      const core = nodes.find((n) => !String(n.type).startsWith("H3Split") && n.type !== "Note" && n.type !== "MarkdownNote");
      window.__h3Nodes = { dit: dit.id, core: core.id };
      app.canvas.ds.scale = 1;
      app.canvas.ds.offset = [-dit.pos[0] + 200, -dit.pos[1] + 150];
      app.canvas.setDirty(true, true);
      return { id: dit.id, type: dit.type, width: dit.size[0], core: core.type };
    });
    report.node = node;
    const show = (nodeId, text) => page.evaluate(async ({ nodeId, text }) => {
      const { api } = await import("/scripts/api.js");
      api.dispatchCustomEvent("progress_text", { nodeId: String(nodeId), text });
    }, { nodeId, text });
    const height = async (text) => {
      await show(node.id, text);
      await page.waitForTimeout(400);
      return page.evaluate((text) => {
        const spans = [...document.querySelectorAll("span")].filter((s) => s.textContent === text);
        const visible = spans.map((s) => s.getBoundingClientRect()).filter((r) => r.height > 0);
        return visible.length ? visible[0].height : null;
      }, text);
    };
    const one = await height("x");
    report.heights = {};
    for (const text of [...lines.fitted, lines.old]) {
      const h = await height(text);
      report.heights[text] = h && one ? Math.round((h / one) * 100) / 100 : null;
    }
    await show(node.id, lines.fitted[0]);
    await page.evaluate(async () => {
      const { api } = await import("/scripts/api.js");
      api.dispatchCustomEvent("progress_text", { nodeId: String(window.__h3Nodes.core), text: "core's line" });
    });
    const has = () => page.evaluate(() => {
      const graph = window.app.graph;
      const text = (id) => graph.getNodeById(id)?.widgets?.some((w) => w.name === "$$node-text-preview") ?? false;
      return { pack: text(window.__h3Nodes.dit), core: text(window.__h3Nodes.core) };
    });
    report.before_start = await has();
    await page.evaluate(async () => {
      const { api } = await import("/scripts/api.js");
      api.dispatchCustomEvent("execution_start", { prompt_id: "h3-progress-text-test", timestamp: Date.now() });
    });
    await page.waitForTimeout(300);
    report.after_start = await has();
    return 0;
  } finally {
    await browser.close();
  }
}

main().then((code) => {
  console.log(JSON.stringify(report));
  process.exit(code);
}, (error) => {
  report.error = String(error?.stack ?? error).slice(0, 2000);
  console.log(JSON.stringify(report));
  process.exit(3);
});
