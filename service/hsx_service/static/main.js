// hsx dashboard: the job list (#/) and a live job page (#/jobs/<id>).
// Plain browser JavaScript in ES modules, no framework and no build step. The REST
// contract is client/hsx/wire.py; live updates come from GET /v1/jobs/<id>/events (SSE).
// This module routes between the two views.

import { api } from "./api.js";
import { drawLossChart, drawRateChart } from "./charts.js";
import { $, clearBanner } from "./dom.js";
import { closeJob, openJob } from "./job.js";
import { startList, stopList } from "./list.js";
import { view } from "./view.js";

window.addEventListener("resize", () => {
  drawRateChart(view);
  drawLossChart(view && view.train);
});

// ---------------------------------------------------------------- routing
function route() {
  const match = /^#\/jobs\/(.+)$/.exec(window.location.hash);
  stopList();
  closeJob();
  clearBanner();
  $("#view-list").hidden = Boolean(match);
  $("#view-job").hidden = !match;
  window.scrollTo(0, 0);
  if (match) openJob(decodedId(match[1]));
  else startList();
}

// A link with a malformed escape (`#/jobs/%E0%A4`) opens the id as written, rather
// than throwing in the router and leaving a blank page.
function decodedId(text) {
  try {
    return decodeURIComponent(text);
  } catch (err) {
    return text;
  }
}

// Who this dashboard calls as (a user sees their own jobs), and whether the server lets
// anyone in (a non-loopback coordinator started with HSX_ALLOW_OPEN).
async function showCaller() {
  try {
    const me = await api("v1/whoami");
    $("#whoami").textContent = me.admin ? `${me.user} (admin)` : me.user;
    $("#open-server").hidden = !me.open;
  } catch (err) {
    $("#whoami").textContent = "";
  }
}

window.addEventListener("hashchange", route);
route();
showCaller();
