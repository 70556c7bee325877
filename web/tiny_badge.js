// A loader set to the embedded tiny H3 says so on the node, not only in its (cut) file widget: a red badge above the
// title bar's left end (the pack's source badge takes the right end). The tiny H3 has random weights, so a graph run on it makes noise; the shipped templates select the
// published files, and a user who picks the tiny model on purpose still sees what it is.
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

app.registerExtension({
  name: "MiniMaxH3.TinyBadge",
  beforeRegisterNodeDef(nodeType, nodeData) {
    const input = LOADERS[nodeData.name];
    if (!input) return;
    // What the badge says for the loader's current choice (null: a real file). The frontend test reads it too.
    nodeType.prototype.h3TinyBadge = function () {
      const value = this.widgets?.find((w) => w.name === input)?.value;
      return typeof value === "string" && value.startsWith(TINY) ? TOOLTIP : null;
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const drawn = onDrawForeground?.apply(this, arguments);
      if (this.flags?.collapsed || !this.h3TinyBadge()) return drawn;
      const titleHeight = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
      ctx.save();
      ctx.font = "bold 11px sans-serif";
      const width = ctx.measureText(BADGE).width + 12;
      const height = 18, x = 0, y = -titleHeight - height - 3;
      ctx.fillStyle = "#b3261e";
      ctx.beginPath();
      if (ctx.roundRect) ctx.roundRect(x, y, width, height, 4);
      else ctx.rect(x, y, width, height);
      ctx.fill();
      ctx.fillStyle = "#fff";
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillText(BADGE, x + 6, y + height / 2 + 1);
      ctx.restore();
      return drawn;
    };
  },
});
