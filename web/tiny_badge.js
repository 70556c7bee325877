// A loader set to the embedded tiny H3 says so on the node, not only in its (cut) file widget: a red badge above the
// title bar's left end (the pack's source badge takes the right end). The tiny H3 has random weights, so a graph run on it makes noise; the shipped templates select the
// published files, and a user who picks the tiny model on purpose still sees what it is.
// A loader set to a "⚠ NAME — reason" entry (a file in its folder that cannot be loaded: nodes/model_files.py) gets an
// amber badge in the same place, so the reason cut off in the widget is not the only sign; queueing it is refused.
import { app } from "../../scripts/app.js";

const LOADERS = {
  H3SplitTextEncoderLoader: "text_encoder",
  H3SplitVideoVAELoader: "vae",
  H3SplitAudioVAELoader: "audio_vae",
  H3SplitDiTLoader: "dit",
};
const TINY = "[embedded] tiny H3"; // every embedded choice starts so (nodes/comfy_bridge.py), old labels included
const BADGE = "TINY H3 · NOISE";
const TOOLTIP = "embedded tiny H3: random weights, outputs are noise";
const NOTE = "⚠ "; // nodes/model_files.py NOTE_PREFIX
const NOTE_BADGE = "⚠ FILE CANNOT LOAD";

app.registerExtension({
  name: "MiniMaxH3.TinyBadge",
  beforeRegisterNodeDef(nodeType, nodeData) {
    const input = LOADERS[nodeData.name];
    if (!input) return;
    const value = (node) => node.widgets?.find((w) => w.name === input)?.value;
    // What the badge says for the loader's current choice (null: a real file). The frontend test reads it too.
    nodeType.prototype.h3TinyBadge = function () {
      const v = value(this);
      return typeof v === "string" && v.startsWith(TINY) ? TOOLTIP : null;
    };
    // The reason a "⚠" entry gives (null for any other choice).
    nodeType.prototype.h3FileProblem = function () {
      const v = value(this);
      return typeof v === "string" && v.startsWith(NOTE) ? v.slice(NOTE.length) : null;
    };
    // A saved workflow naming an embedded choice the list no longer shows (a tiny twin, listed only with
    // H3_SHOW_TINY_TWINS=1, or 0.2-0.4's old label) keeps it: the server still takes it, and a frontend that holds
    // combo values to their lists (1.58) would otherwise mark the loader as missing its model.
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const configured = onConfigure?.apply(this, arguments);
      const widget = this.widgets?.find((w) => w.name === input);
      const v = widget?.value, values = widget?.options?.values;
      if (typeof v === "string" && v.startsWith(TINY) && Array.isArray(values) && !values.includes(v)) {
        widget.options.values = [...values, v];
      }
      return configured;
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const drawn = onDrawForeground?.apply(this, arguments);
      if (this.flags?.collapsed) return drawn;
      const tiny = this.h3TinyBadge(), problem = !tiny && this.h3FileProblem();
      if (!tiny && !problem) return drawn;
      const text = tiny ? BADGE : NOTE_BADGE;
      const titleHeight = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
      ctx.save();
      ctx.font = "bold 11px sans-serif";
      const width = ctx.measureText(text).width + 12;
      const height = 18, x = 0, y = -titleHeight - height - 3;
      ctx.fillStyle = tiny ? "#b3261e" : "#b26a00";
      ctx.beginPath();
      if (ctx.roundRect) ctx.roundRect(x, y, width, height, 4);
      else ctx.rect(x, y, width, height);
      ctx.fill();
      ctx.fillStyle = "#fff";
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillText(text, x + 6, y + height / 2 + 1);
      ctx.restore();
      return drawn;
    };
  },
});
