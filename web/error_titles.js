// A run-time error in one of the pack's nodes is titled with the node's display name ("MiniMax H3 References"), not
// its class id ("H3SplitReferences"). ComfyUI's frontend titles its execution-error dialog with the websocket
// message's `node_type` (1.32.9: ErrorDialogContent; 1.58.1 falls back to it when the node is not on the canvas).
// The server keeps sending class ids (API clients and /history key on them); only the copy this page's listeners
// receive is renamed, and only for the pack's nodes. Where the frontend has no `api.dispatchCustomEvent` (the one
// point every websocket message passes through, in 1.32.9 and 1.58.1), this extension does nothing.
// 1.32.9's queue panel opens the same dialog from a finished job's history ("Report error"); `api.getHistory`'s
// answer is renamed the same way where the frontend has that method.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PACK_PREFIX = "H3Split";
const displayNames = new Map(); // class id -> display name, filled as the frontend registers the pack's nodes

function renamed(detail) {
  const name = displayNames.get(detail?.node_type);
  return name ? { ...detail, node_type: name } : detail;
}

if (typeof api?.dispatchCustomEvent === "function" && !api.dispatchCustomEvent.h3ErrorTitles) {
  const dispatch = api.dispatchCustomEvent;
  const wrapped = function (type, detail) {
    return dispatch.call(this, type, type === "execution_error" ? renamed(detail) : detail);
  };
  wrapped.h3ErrorTitles = true; // a second load of this module (extension reload) wraps once
  api.dispatchCustomEvent = wrapped;
}

// A history task's messages are [type, detail] pairs (ComfyUI's /history status.messages).
function renamedTask(task) {
  const messages = task?.status?.messages;
  if (!Array.isArray(messages)) return task;
  const renamedMessages = messages.map((m) => (m?.[0] === "execution_error" ? [m[0], renamed(m[1])] : m));
  return { ...task, status: { ...task.status, messages: renamedMessages } };
}

if (typeof api?.getHistory === "function" && !api.getHistory.h3ErrorTitles) {
  const getHistory = api.getHistory;
  const wrapped = async function (...args) {
    const answer = await getHistory.apply(this, args);
    return Array.isArray(answer?.History) ? { ...answer, History: answer.History.map(renamedTask) } : answer;
  };
  wrapped.h3ErrorTitles = true;
  api.getHistory = wrapped;
}

app.registerExtension({
  name: "MiniMaxH3.ErrorTitles",
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name?.startsWith(PACK_PREFIX) && nodeData.display_name) {
      displayNames.set(nodeData.name, nodeData.display_name);
    }
  },
});
