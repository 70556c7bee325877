// H3 Save / Load Conditioning on the canvas: the saved file's name on the Save node (a read-only multiline box, so the
// whole message shows), an upload button on the Load node, and Load nodes that list a file the moment Save wrote it
// (the node definition's list is what the page fetched at start: each Save and each new Load node asks the server for
// the current list, `/object_info/H3SplitLoadConditioning`, instead of waiting for Refresh Node Definitions).
// ComfyUI's frontend renders V3's `upload=UploadType.model` ("file_upload") only in releases that know it; where the
// frontend already made an upload widget, the Load node keeps that one.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAVE = "H3SplitSaveConditioning";
const LOAD = "H3SplitLoadConditioning";
const PLACEHOLDER = "(no conditioning file yet";

// The Load node's choices as the server lists them now (input/ and output/h3/, bounded and cached there).
async function currentChoices() {
  const answer = await api.fetchApi(`/object_info/${LOAD}`);
  if (answer.status !== 200) return null;
  const spec = (await answer.json())?.[LOAD]?.input?.required?.conditioning_file;
  const values = Array.isArray(spec?.[0]) ? spec[0] : spec?.[1]?.options;
  return Array.isArray(values) ? values : null;
}

async function refreshLoadNodes(nodes) {
  const values = await currentChoices();
  if (!values) return;
  for (const node of nodes) {
    const combo = node.widgets?.find((w) => w.name === "conditioning_file");
    if (!combo) continue;
    combo.options.values = [...values];
    if (String(combo.value ?? "").startsWith(PLACEHOLDER) && values.length && !values[0].startsWith(PLACEHOLDER)) {
      combo.value = values[0];
      combo.callback?.(values[0]);
    }
    node.setDirtyCanvas?.(true, true);
  }
}

function loadNodes() {
  const nodes = app.graph?._nodes ?? app.graph?.nodes ?? [];
  return nodes.filter((node) => (node.comfyClass ?? node.type) === LOAD);
}

// A widget the canvas shows but neither the workflow nor the prompt carries.
function displayOnly(widget) {
  widget.serialize = false;
  widget.options = { ...(widget.options || {}), serialize: false };
  return widget;
}

// A read-only multiline box for the Save node's message (one-line text widgets cut it at the node's width): a DOM
// widget where the frontend offers them (addDOMWidget, public on ComfyUI's nodes), else a text widget.
function messageWidget(node) {
  const existing = node.widgets?.find((w) => w.name === "saved");
  if (existing) return existing;
  if (typeof node.addDOMWidget !== "function") return displayOnly(node.addWidget("text", "saved", "", () => {}, {}));
  const box = document.createElement("textarea");
  box.readOnly = true;
  box.rows = 3;
  box.style.cssText = "width:100%;resize:none;font-size:11px;opacity:0.85;background:transparent;color:inherit;";
  const widget = node.addDOMWidget("saved", "h3_saved_message", box, {
    getValue: () => box.value,
    setValue: (value) => { box.value = value ?? ""; },
    serialize: false,
  });
  return displayOnly(widget);
}

async function upload(node, file) {
  const combo = node.widgets?.find((w) => w.name === "conditioning_file");
  const body = new FormData();
  body.append("image", file, file.name); // core's upload route: it stores any file under input/
  body.append("type", "input");
  const answer = await api.fetchApi("/upload/image", { method: "POST", body });
  if (answer.status !== 200) {
    alert(`MiniMax H3 Load Conditioning: the upload failed (${answer.status} ${answer.statusText})`);
    return;
  }
  const saved = await answer.json();
  const name = saved.subfolder ? `${saved.subfolder}/${saved.name}` : saved.name;
  if (combo) {
    const listed = typeof combo.options.values === "function" ? combo.options.values() : combo.options.values;
    const values = (listed || []).filter((v) => !String(v).startsWith("(no conditioning file yet"));
    if (!values.includes(name)) values.unshift(name);
    combo.options.values = values;
    combo.value = name;
    combo.callback?.(name);
  }
  node.setDirtyCanvas(true, true);
}

app.registerExtension({
  name: "MiniMaxH3.ConditioningFiles",
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === SAVE) {
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        onExecuted?.apply(this, arguments);
        const text = message?.text?.[0];
        if (typeof text !== "string") return;
        messageWidget(this).value = text;
        this.setDirtyCanvas(true, true);
        refreshLoadNodes(loadNodes());
      };
    }
    if (nodeData.name === LOAD) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const made = onNodeCreated?.apply(this, arguments);
        refreshLoadNodes([this]); // files saved since the page loaded its node definitions
        if (this.widgets?.some((w) => w.name === "upload")) return made;
        const picker = document.createElement("input");
        picker.type = "file";
        picker.accept = ".safetensors";
        picker.style.display = "none";
        picker.onchange = async () => {
          if (picker.files?.length) await upload(this, picker.files[0]);
          picker.value = "";
        };
        document.body.append(picker);
        displayOnly(this.addWidget("button", "upload", null, () => picker.click(), {}));
        const label = this.widgets[this.widgets.length - 1];
        label.label = "choose conditioning file to upload";
        const onRemoved = this.onRemoved;
        this.onRemoved = function () {
          picker.remove();
          return onRemoved?.apply(this, arguments);
        };
        return made;
      };
    }
  },
});
