// A job's page (#/jobs/<id>): its status, followed live through
// GET /v1/jobs/<id>/events (SSE), its workers, skipped samples, tokens/s curve and the
// cancel button. The draft training's card is training.js.

import { ApiError, FINISHED, api, eventsUrl, jobPath } from "./api.js";
import { drawRateChart, followHover } from "./charts.js";
import {
  $, clearBanner, clearStats, el, renderWaiting, reportError, setBadge, setConn,
  setProgress,
} from "./dom.js";
import {
  fmtAlreadyComplete, fmtBytes, fmtCompact, fmtDuration, fmtInt, fmtPercent, fmtWhen, percent,
} from "./format.js";
import { pollTraining, resetTraining } from "./training.js";
import { setView, view } from "./view.js";

const TICK_MS = 1000;
const ERRORS_PAGE = 50;
const ERRORS_REFRESH_MS = 2000;
const RECONNECT_MS = 2000;
// The tokens/s curve is the server's (GET <job>/throughput, kept after the job ends),
// fetched again this often while the job runs.
const CURVE_REFRESH_MS = 5000;
const CANCELLABLE = new Set(["queued", "running"]);

export function openJob(id) {
  setView({
    id,
    status: null,
    es: null,
    points: [],
    reconnectTimer: null,
    tick: setInterval(() => onTick(), TICK_MS),
    errorsLoaded: 0,
    errorsFailedSeen: -1,
    errorsFetchedAt: 0,
    errorsQueue: Promise.resolve(),
    errorsTimer: null,
    cancelArmed: null,
    train: null,
    trainTimer: null,
    curveTimer: null,
    curveLoaded: false,
  });
  resetJobPage(id);
  const current = view;
  refreshJob(current).then(({ status, error }) => {
    if (current !== view) return;
    if (error instanceof ApiError && error.status === 404) {
      $("#progress-text").textContent = "No such job.";
    }
    if (!status) return;
    loadErrors(current, true);
    loadCurve(current);
    pollTraining(current);
    if (!FINISHED.has(status.state)) connectEvents(current);
  });
}

export function closeJob() {
  if (!view) return;
  if (view.es) view.es.close();
  clearTimeout(view.reconnectTimer);
  clearTimeout(view.errorsTimer);
  clearTimeout(view.cancelArmed);
  clearTimeout(view.trainTimer);
  clearTimeout(view.curveTimer);
  clearInterval(view.tick);
  setView(null);
  setConn("idle", "");
}

function resetJobPage(id) {
  $("#job-title").textContent = id;
  $("#job-id").textContent = "";
  setBadge($("#state"), null);
  $("#progress-text").textContent = "Loading…";
  $("#eta").textContent = "";
  setProgress($("#progress-bar"), { state: "queued", samples_done: 0, samples_total: 0 });
  $("#workers").replaceChildren();
  $("#workers-summary").textContent = "";
  $("#nodes").replaceChildren();
  $("#nodes").hidden = true;
  clearStats("#stats");
  $("#errors-table").hidden = false;
  $("#errors-table tbody").replaceChildren();
  $("#errors-summary").textContent = "";
  $("#errors-empty").hidden = true;
  $("#errors-more").hidden = true;
  $("#last-error-card").hidden = true;
  renderWaiting($("#waiting"), null);
  $("#job-plan").hidden = true;
  const cancel = $("#cancel-btn");
  cancel.hidden = true;
  cancel.disabled = false;
  cancel.textContent = "Cancel job";
  cancel.classList.remove("armed");
  $("#details").replaceChildren();
  drawRateChart(view);
  resetTraining();
}

async function refreshJob(current) {
  try {
    const status = await api(jobPath(current.id));
    if (current === view) {
      clearBanner();
      renderJob(current, status);
    }
    return { status, error: null };
  } catch (err) {
    if (current === view) reportError(err);
    return { status: null, error: err };
  }
}

function connectEvents(current) {
  const es = new EventSource(eventsUrl(current.id));
  current.es = es;
  setConn("connecting", "connecting…");
  es.onopen = () => {
    if (current === view) setConn("live", "live");
  };
  es.addEventListener("status", (ev) => {
    if (current !== view) return;
    let status;
    try {
      status = JSON.parse(ev.data);
    } catch (_) {
      return;
    }
    setConn("live", "live");
    renderJob(current, status);
    if (FINISHED.has(status.state)) {
      // The last event: the stream ends here. Re-read the final status (the error
      // table and counters may have settled after the event was sent).
      es.close();
      current.es = null;
      setConn("idle", "");
      refreshJob(current).then(() => {
        if (current !== view) return;
        loadErrors(current, true);
        loadCurve(current);
      });
    }
  });
  es.onerror = () => {
    // The server ends the stream when the job finishes; a dropped connection looks
    // the same from here. The job's status tells which: reconnect only if it runs.
    es.close();
    if (current !== view) return;
    current.es = null;
    setConn("idle", "");
    refreshJob(current).then(({ status, error }) => {
      if (current !== view) return;
      const fatal = error instanceof ApiError && [401, 403, 404].includes(error.status);
      if (fatal || (status && FINISHED.has(status.state))) return;
      setConn("connecting", "reconnecting…");
      current.reconnectTimer = setTimeout(() => {
        if (current === view) connectEvents(current);
      }, RECONNECT_MS);
    });
  };
}

function onTick() {
  if (!view || !view.status) return;
  renderElapsed(view.status);
  if (view.status.state === "running") drawRateChart(view);
}

function renderJob(current, status) {
  current.status = status;
  const p = percent(status);

  $("#job-title").textContent = status.name || status.id;
  $("#job-id").textContent = status.name ? status.id : "";
  setBadge($("#state"), status.state);
  document.title = `hsx · ${status.name || status.id} · ${status.state} ${fmtPercent(p)}`;

  setProgress($("#progress-bar"), status);
  const totalText = status.samples_total ? fmtInt(status.samples_total) : "?";
  // Units run while the rest of the dataset is tokenized: both are shown.
  const extracted = status.units_done
    ? ` · ${fmtInt(status.samples_done)} samples extracted (${fmtInt(status.units_done)}`
      + ` of ${fmtInt(status.units_total)} units planned so far)` : "";
  $("#progress-text").textContent = status.ingesting
    ? `tokenizing the dataset: ${ingestionText(status)} rows${extracted}`
    : `${fmtInt(status.samples_done)} / ${totalText} samples · ${fmtPercent(p)}`;
  $("#eta").textContent = etaText(status);

  // Running: the current rate. Ended: the average over the time it ran.
  const running = status.state === "running";
  const average = !running && status.tokens_per_s_avg > 0;
  $("#stat-rate").textContent = running ? fmtInt(status.tokens_per_s)
    : (average ? fmtInt(status.tokens_per_s_avg) : "–");
  $("#stat-rate-label").textContent = average ? "Tokens/s (average)" : "Tokens/s";
  $("#stat-tokens").textContent =
    `${fmtCompact(status.tokens_done)} / ${fmtCompact(status.tokens_total)}`;
  $("#stat-shards").textContent = fmtInt(status.shards);
  $("#stat-bytes").textContent = fmtBytes(status.bytes);
  $("#stat-bytes").title = `${fmtInt(status.bytes)} bytes`;
  $("#stat-rows").textContent = ingestionText(status);
  $("#stat-rows").title = status.ingesting
    ? "the total is estimated from the share of the dataset read so far" : "";
  $("#stat-units").textContent = `${fmtInt(status.units_done)} / ${fmtInt(status.units_total)}`
    + (status.units_failed ? ` (${fmtInt(status.units_failed)} failed)` : "");
  const regenerates = Boolean(status.spec && status.spec.regenerate);
  $("#stat-generated-box").hidden = !regenerates;
  $("#stat-generated").textContent = regenerates
    ? `${fmtInt(status.samples_generated)} samples, ${fmtCompact(status.tokens_generated)} tokens`
    : "–";
  $("#stat-failed").textContent = fmtInt(status.samples_failed);
  $("#stat-failed").classList.toggle("warn", status.samples_failed > 0);
  renderChecks(status);
  $("#stat-restarts").textContent = fmtInt(status.restarts);
  $("#stat-restarts").classList.toggle("warn", status.restarts > 0);
  renderElapsed(status);

  renderWaiting($("#waiting"), status.waiting_for);
  $("#job-plan").hidden = !status.plan;
  $("#job-plan").textContent = status.plan ? `Plan: ${status.plan.summary}` : "";

  renderWorkers(status);
  renderNodes(status);
  $("#last-error-card").hidden = !status.last_error;
  $("#last-error").textContent = status.last_error || "";

  renderCancel(current, status);
  renderDetails(status);
  drawRateChart(current);
  maybeRefreshErrors(current, status);
}

// Ingestion beside extraction: rows tokenized (or recorded as bad) of the dataset's rows,
// an estimate (~) while it is being read.
function ingestionText(status) {
  const done = status.rows_tokenized || 0;
  const total = status.rows_total || 0;
  if (!done && !total) return "–";
  if (!status.ingesting) return fmtInt(done);
  return total ? `${fmtInt(done)} / ~${fmtInt(total)}` : fmtInt(done);
}

// The self-check of the captured states (spec `checks`): samples checked in committed
// units, and the problems `checks: warn` recorded (under `on` a problem fails the job and
// its message is the job's last error).
function renderChecks(status) {
  const mode = (status.spec || {}).checks || "on";
  const problems = status.check_problems || 0;
  const rows = status.head_rows_checked || 0;
  const agreed = status.head_rows_agreed || 0;
  const node = $("#stat-checks");
  node.textContent = mode === "off" ? "off"
    : `${fmtInt(status.samples_checked || 0)} checked`
      + (problems ? ` · ${fmtInt(problems)} problem${problems === 1 ? "" : "s"}` : "")
      + (rows ? ` · head agrees ${(100 * agreed / rows).toFixed(1)}% of ${fmtInt(rows)} rows`
        : "")
      + (mode === "warn" ? " (warn)" : "");
  node.classList.toggle("warn", problems > 0);
  node.title = mode === "off" ? "checks: off: the captured states are not checked"
    : "NaN/inf, all-zero rows, identical layers and a wild scale, per sample and layer; "
      + "on a sample of rows, lm_head(norm(last state)) against the engine's own next token";
}

function etaText(status) {
  if (status.state === "running") {
    return status.eta_s != null ? `ETA ${fmtDuration(status.eta_s)}` : "ETA –";
  }
  if (status.state === "queued") return "waiting to start";
  if (status.already_complete) return fmtAlreadyComplete(status);
  if (status.finished_at != null && status.started_at != null) {
    return `${status.state} at ${fmtWhen(status.finished_at)} `
      + `after ${fmtDuration(status.finished_at - status.started_at)}`;
  }
  return "";
}

function renderElapsed(status) {
  let text = "–";
  if (status.started_at != null && !status.already_complete) {
    // The server's clock when it has one: the browser may run on another machine.
    const now = status.updated_at != null ? status.updated_at : Date.now() / 1000;
    const end = status.finished_at != null ? status.finished_at : now;
    text = fmtDuration(end - status.started_at);
  }
  $("#stat-elapsed").textContent = text;
}

function workerTotalsText(t) {
  if (!t) return "";
  return `${fmtInt(t.units)} unit${t.units === 1 ? "" : "s"} · ${fmtCompact(t.tokens)} tok`
    + ` · ${fmtBytes(t.bytes)}`;
}

// Live engines with what each committed so far; once the job has ended, what each
// worker committed over the whole job ("ended").
function renderWorkers(status) {
  const totals = new Map((status.worker_totals || []).map((t) => [t.name, t]));
  const workers = FINISHED.has(status.state)
    ? [...totals.keys()].map((name) => ({ name, state: "ended", unit: null }))
    : status.workers || [];
  const counts = {};
  const items = workers.map((w) => {
    counts[w.state] = (counts[w.state] || 0) + 1;
    const t = totals.get(w.name);
    return el("li", { class: "worker", "data-worker": w.name, "data-state": w.state },
      el("span", { class: `dot state-${w.state}` }),
      el("div", { class: "worker-who" },
        el("div", { class: "worker-name mono", text: w.name }),
        el("div", { class: "worker-totals muted", "data-units": t ? String(t.units) : "0",
          "data-tokens": t ? String(t.tokens) : "0", text: workerTotalsText(t),
          title: t ? `${fmtInt(t.samples)} samples, ${fmtInt(t.tokens)} tokens, `
            + `${fmtInt(t.bytes)} bytes in ${fmtDuration(t.seconds)} of unit time` : "" })),
      el("span", { class: `pill state-${w.state}`, text: w.state }),
      el("span", { class: "worker-unit muted", text: w.unit != null ? `unit ${w.unit}` : "" }));
  });
  if (!items.length) {
    items.push(el("li", { class: "empty", text: FINISHED.has(status.state)
      ? "No worker committed anything." : "No workers yet." }));
  }
  $("#workers").replaceChildren(...items);
  $("#workers-summary").textContent = Object.entries(counts)
    .map(([state, n]) => `${n} ${state}`).join(" · ");
}

// Per Ray node, while the job runs: its engines, the trainer's workers (by rank) and
// the captured bytes in flight there (an online job's).
function renderNodes(status) {
  const nodes = status.nodes || [];
  const list = $("#nodes");
  list.hidden = nodes.length < 2;
  list.replaceChildren(...nodes.map((n) => {
    const parts = [...n.engines];
    if (n.trainer_workers.length) parts.push(`trainer ${n.trainer_workers.join(", ")}`);
    return el("li", { class: "worker node", "data-node": n.node },
      el("div", { class: "worker-who" },
        el("div", { class: "worker-name mono", text: `node ${n.node.slice(0, 8)}` }),
        el("div", { class: "worker-totals muted", text: parts.join(" · ") })),
      el("span", { class: "worker-unit muted", "data-bytes": String(n.bytes_in_flight),
        text: n.bytes_in_flight ? `${fmtBytes(n.bytes_in_flight)} in flight` : "" }));
  }));
}

function renderCancel(current, status) {
  const btn = $("#cancel-btn");
  btn.hidden = !CANCELLABLE.has(status.state);
  if (btn.hidden) {
    clearTimeout(current.cancelArmed);
    current.cancelArmed = null;
    btn.textContent = "Cancel job";
    btn.classList.remove("armed");
  }
}

$("#cancel-btn").addEventListener("click", async () => {
  const current = view;
  if (!current) return;
  const btn = $("#cancel-btn");
  // Two clicks: the first arms the button for a few seconds, the second cancels.
  if (!current.cancelArmed) {
    btn.textContent = "Click again to cancel";
    btn.classList.add("armed");
    current.cancelArmed = setTimeout(() => {
      current.cancelArmed = null;
      btn.textContent = "Cancel job";
      btn.classList.remove("armed");
    }, 4000);
    return;
  }
  clearTimeout(current.cancelArmed);
  current.cancelArmed = null;
  btn.disabled = true;
  btn.textContent = "Cancelling…";
  try {
    await api(jobPath(current.id), { method: "DELETE" });
    await refreshJob(current);
  } catch (err) {
    reportError(err);
  } finally {
    btn.disabled = false;
    btn.classList.remove("armed");
    btn.textContent = "Cancel job";
  }
});

// A job's dataset: a path, or {path, split} for one split of a dataset with several.
function datasetText(dataset) {
  if (dataset && typeof dataset === "object") {
    return dataset.split ? `${dataset.path} (split ${dataset.split})` : dataset.path;
  }
  return dataset;
}

function renderDetails(status) {
  const spec = status.spec || {};
  const rows = [
    ["Output", status.output],
    ["Model", spec.model],
    ["Dataset", datasetText(spec.dataset)],
    ["Engine", spec.engine],
    ["Layers", Array.isArray(spec.layers) ? spec.layers.join(", ") : (spec.model ? "default" : null)],
    ["Engines", spec.replicas != null
      ? `${spec.replicas} × TP${spec.tensor_parallel_size || 1}` : null],
    ["Storage dtype", spec.storage_dtype],
    ["Max sequence", spec.max_seq_len != null ? fmtInt(spec.max_seq_len) : null],
    ["Submitted", fmtWhen(status.created_at)],
    ["Started", fmtWhen(status.started_at)],
    ["Finished", fmtWhen(status.finished_at)],
  ];
  const nodes = [];
  for (const [key, value] of rows) {
    if (value == null || value === "") continue;
    nodes.push(el("div", {}, el("dt", { text: key }), el("dd", { class: "mono", text: String(value) })));
  }
  $("#details").replaceChildren(...nodes);
}

// ---------------------------------------------------------------- errors table
function maybeRefreshErrors(current, status) {
  if (status.samples_failed === current.errorsFailedSeen || current.errorsTimer) return;
  const wait = Math.max(0, current.errorsFetchedAt + ERRORS_REFRESH_MS - Date.now());
  current.errorsTimer = setTimeout(() => {
    current.errorsTimer = null;
    if (current === view) loadErrors(current, true);
  }, wait);
}

function loadErrors(current, reset) {
  // One request at a time, in order: a "load more" never races a refresh.
  current.errorsQueue = current.errorsQueue.then(() => fetchErrors(current, reset));
  return current.errorsQueue;
}

async function fetchErrors(current, reset) {
  if (current !== view) return;
  // A reset re-reads every row shown so far, so new records land in order whatever
  // order the server keeps them in; "load more" appends the next page.
  const offset = reset ? 0 : current.errorsLoaded;
  const limit = reset ? Math.max(ERRORS_PAGE, current.errorsLoaded) : ERRORS_PAGE;
  const failedSeen = current.status ? current.status.samples_failed : -1;
  try {
    const page = await api(`${jobPath(current.id)}/errors?offset=${offset}&limit=${limit}`);
    if (current !== view) return;
    const rows = page.items.map((item) =>
      el("tr", { "data-sample": String(item.sample_index) },
        el("td", { class: "num mono", text: String(item.sample_index) }),
        el("td", { class: "reason", text: item.reason })));
    const tbody = $("#errors-table tbody");
    if (reset) tbody.replaceChildren(...rows);
    else tbody.append(...rows);
    current.errorsLoaded = reset ? rows.length : current.errorsLoaded + rows.length;
    current.errorsFailedSeen = failedSeen;
    current.errorsFetchedAt = Date.now();
    const total = page.total;
    $("#errors-summary").textContent = total
      ? `${fmtInt(Math.min(current.errorsLoaded, total))} of ${fmtInt(total)} shown` : "";
    $("#errors-empty").hidden = total > 0;
    $("#errors-table").hidden = total === 0;
    $("#errors-more").hidden = current.errorsLoaded >= total || rows.length === 0;
  } catch (err) {
    if (current === view) reportError(err);
  }
}

$("#errors-more").addEventListener("click", () => {
  if (view) loadErrors(view, false);
});

// ---------------------------------------------------------------- tokens/s curve
// The curve is the server's: a point every few seconds while the job extracts, kept
// in its ledger, so a job that ended before the page opened still has it.
async function loadCurve(current) {
  clearTimeout(current.curveTimer);
  current.curveTimer = null;
  try {
    const curve = await api(`${jobPath(current.id)}/throughput`);
    if (current !== view) return;
    current.points = (curve.points || []).map((p) => ({ x: p.at * 1000, v: p.tokens_per_s }));
  } catch (err) {
    if (current !== view) return;
    if (!(err instanceof ApiError && err.status === 404)) reportError(err);
  }
  current.curveLoaded = true;
  drawRateChart(current);
  if (current.status && !FINISHED.has(current.status.state)) {
    current.curveTimer = setTimeout(() => {
      if (current === view) loadCurve(current);
    }, CURVE_REFRESH_MS);
  }
}

followHover($("#rate-chart"), () => drawRateChart(view));
