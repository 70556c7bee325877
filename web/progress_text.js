// The pack's nodes start each run without the last run's progress text. Frontend 1.32.9 keeps a node's text line (its
// "$$node-text-preview" widget) after the run, so the next run showed the old line ("DiT forward 49/49") until that
// node ran again, as if finished or stuck; 1.58 clears it by itself. When a prompt starts, this removes that widget
// from the pack's nodes the way the frontend's own removeTextPreview does (onRemove, then out of the list); the
// frontend adds it again with the node's first new line. The server ends each node's work with a one-line summary
// (nodes/progress_text.py), which stays until then.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PACK_PREFIX = "H3Split";
const TEXT_WIDGET = "$$node-text-preview"; // the frontend's TEXT_PREVIEW_WIDGET_NAME (1.32.9 and 1.58.1)

// Every node of the pack in the graph and its subgraphs.
function packNodes(graph, seen = new Set()) {
  const found = [];
  if (!graph || seen.has(graph)) return found;
  seen.add(graph);
  for (const node of graph._nodes ?? graph.nodes ?? []) {
    const type = node.comfyClass ?? node.type;
    if (typeof type === "string" && type.startsWith(PACK_PREFIX)) found.push(node);
    if (node.subgraph) found.push(...packNodes(node.subgraph, seen));
  }
  return found;
}

// Removes the pack's old progress lines; returns how many it removed (the frontend test reads it).
export function clearPackProgressText(graph = app.graph) {
  let removed = 0;
  for (const node of packNodes(graph)) {
    const index = node.widgets?.findIndex((w) => w.name === TEXT_WIDGET) ?? -1;
    if (index < 0) continue;
    try {
      node.widgets[index].onRemove?.();
    } finally {
      node.widgets.splice(index, 1);
    }
    removed += 1;
    node.setDirtyCanvas?.(true, true);
  }
  return removed;
}

app.registerExtension({
  name: "MiniMaxH3.ProgressText",
  setup() {
    api.addEventListener("execution_start", () => {
      try {
        clearPackProgressText();
      } catch (error) {
        console.warn("MiniMax H3: could not clear the last run's progress text", error);
      }
    });
  },
});
