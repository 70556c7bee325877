// H3 Save / Load Conditioning on the canvas: the saved file's name on the Save node, and an upload button on the
// Load node. ComfyUI's frontend renders V3's `upload=UploadType.model` ("file_upload") only in releases that know
// it; where the frontend already made an upload widget, the Load node keeps that one.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAVE = "H3SplitSaveConditioning";
const LOAD = "H3SplitLoadConditioning";

// A widget the canvas shows but neither the workflow nor the prompt carries.
function displayOnly(widget) {
  widget.serialize = false;
  widget.options = { ...(widget.options || {}), serialize: false };
  return widget;
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
        const widget = this.widgets?.find((w) => w.name === "saved") ??
          displayOnly(this.addWidget("text", "saved", "", () => {}, {}));
        widget.value = text;
        this.setDirtyCanvas(true, true);
      };
    }
    if (nodeData.name === LOAD) {
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const made = onNodeCreated?.apply(this, arguments);
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
