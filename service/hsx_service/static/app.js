// hsx dashboard: the job list (#/) and a live job page (#/jobs/<id>).
// Plain browser JavaScript, no framework and no build step. The REST contract is
// client/hsx/wire.py; live updates come from GET /v1/jobs/<id>/events (SSE).
"use strict";

(() => {
  const LIST_POLL_MS = 3000;
  const TICK_MS = 1000;
  const CHART_WINDOW_MS = 10 * 60 * 1000;
  const CHART_MIN_SPAN_MS = 30 * 1000;
  const ERRORS_PAGE = 50;
  const ERRORS_REFRESH_MS = 2000;
  const RECONNECT_MS = 2000;
  // The tokens/s curve is the server's (GET <job>/throughput, kept after the job ends),
  // fetched again this often while the job runs.
  const CURVE_REFRESH_MS = 5000;
  const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
  const CANCELLABLE = new Set(["queued", "running"]);
  const TRAIN_POLL_MS = 2000;
  const TRAIN_ABSENT_POLL_MS = 10000;
  // "stopped": the coordinator shut down; it resumes the training when it starts again.
  const TRAIN_ENDED = new Set(["done", "failed", "stopped"]);

  const $ = (sel) => document.querySelector(sel);

  // ---------------------------------------------------------------- API token
  // A server with HSX_API_TOKEN needs it on every /v1 call. The page takes it from
  // ?token= once, keeps it in localStorage, and drops it from the address bar so it
  // does not end up in screenshots or shared links.
  const token = (() => {
    const url = new URL(window.location.href);
    const fromUrl = url.searchParams.get("token");
    try {
      if (fromUrl) {
        localStorage.setItem("hsx.token", fromUrl);
        url.searchParams.delete("token");
        history.replaceState(null, "", url.pathname + url.search + url.hash);
      }
      return fromUrl || localStorage.getItem("hsx.token") || "";
    } catch (_) {
      return fromUrl || "";
    }
  })();

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(path, options = {}) {
    const headers = { Accept: "application/json", ...(options.headers || {}) };
    if (token) headers.Authorization = `Bearer ${token}`;
    const resp = await fetch(path, { ...options, headers });
    const text = await resp.text();
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch (_) {
      body = null;
    }
    if (!resp.ok) {
      // ErrorBody {type, message, field}; FastAPI's own errors carry {detail}.
      let message = `${resp.status} ${resp.statusText}`;
      if (body && typeof body.message === "string") message = body.message;
      else if (body && typeof body.detail === "string") message = body.detail;
      throw new ApiError(resp.status, message);
    }
    return body;
  }

  // Paths are relative to the page, so the dashboard also works behind a path prefix
  // (a reverse proxy serving the coordinator at /hsx/, say).
  const jobPath = (id) => `v1/jobs/${encodeURIComponent(id)}`;

  function eventsUrl(id) {
    // EventSource cannot send headers: the token travels as a query parameter.
    const url = `${jobPath(id)}/events`;
    return token ? `${url}?access_token=${encodeURIComponent(token)}` : url;
  }

  // ---------------------------------------------------------------- formatting
  const intFmt = new Intl.NumberFormat("en-US");

  function fmtInt(n) {
    return intFmt.format(Math.round(n || 0));
  }

  function fmtCompact(n) {
    const v = Math.abs(n || 0);
    if (v >= 1e9) return `${(n / 1e9).toFixed(v >= 1e10 ? 0 : 1)}G`;
    if (v >= 1e6) return `${(n / 1e6).toFixed(v >= 1e7 ? 0 : 1)}M`;
    if (v >= 1e3) return `${(n / 1e3).toFixed(v >= 1e4 ? 0 : 1)}k`;
    return `${Math.round(n || 0)}`;
  }

  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = n || 0;
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return i === 0 ? `${v} B` : `${v.toFixed(v >= 100 ? 0 : 1)} ${units[i]}`;
  }

  function fmtDuration(seconds) {
    if (seconds == null || !Number.isFinite(seconds)) return "–";
    const s = Math.max(0, Math.round(seconds));
    const d = Math.floor(s / 86400);
    const h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60);
    const sec = s % 60;
    if (d > 0) return `${d}d ${h}h`;
    if (h > 0) return `${h}h ${String(m).padStart(2, "0")}m`;
    if (m > 0) return `${m}m ${String(sec).padStart(2, "0")}s`;
    return `${sec}s`;
  }

  function fmtClock(ms) {
    return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
  }

  function fmtWhen(unix) {
    if (unix == null) return "–";
    const date = new Date(unix * 1000);
    const now = new Date();
    if (date.toDateString() === now.toDateString()) return fmtClock(date.getTime());
    return date.toLocaleString("en-GB", {
      year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
    });
  }

  function fmtAgo(unix) {
    if (unix == null) return "";
    const s = Date.now() / 1000 - unix;
    return s < 5 ? "just now" : `${fmtDuration(s)} ago`;
  }

  function percent(status) {
    if (status.samples_total > 0) {
      return Math.min(100, (100 * status.samples_done) / status.samples_total);
    }
    return status.state === "succeeded" ? 100 : 0;
  }

  function fmtPercent(p) {
    return p >= 100 || p === 0 ? `${Math.round(p)}%` : `${p.toFixed(1)}%`;
  }

  // ---------------------------------------------------------------- DOM helpers
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value == null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-") || key.startsWith("aria-") || key === "role"
               || key === "href" || key === "title" || key === "tabindex") {
        node.setAttribute(key, value);
      } else node[key] = value;
    }
    for (const child of children) {
      if (child != null) node.append(child);
    }
    return node;
  }

  function stateBadge(state) {
    return el("span", { class: `badge state-${state}`, text: state });
  }

  function setBadge(badge, state) {
    badge.textContent = state || "";
    badge.className = state ? `badge state-${state}` : "badge";
    badge.dataset.state = state || "";
  }

  function clearStats(selector) {
    for (const dd of document.querySelectorAll(`${selector} dd`)) {
      dd.textContent = "–";
      dd.classList.remove("warn");
    }
  }

  function progressBar(status, small) {
    const p = percent(status);
    const bar = el("div", {
      class: `progress ${small ? "small" : ""} state-${status.state}`,
      role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100",
      "aria-valuenow": p.toFixed(1),
    });
    const fill = el("div", { class: "progress-fill" });
    fill.style.width = `${p}%`;
    bar.append(fill);
    return bar;
  }

  function setProgress(bar, status) {
    const p = percent(status);
    bar.className = `progress big state-${status.state}`;
    bar.setAttribute("aria-valuenow", p.toFixed(1));
    bar.querySelector(".progress-fill").style.width = `${p}%`;
  }

  function showBanner(message) {
    const banner = $("#banner");
    banner.textContent = message;
    banner.hidden = false;
  }

  function clearBanner() {
    $("#banner").hidden = true;
  }

  function reportError(err) {
    if (err instanceof ApiError && err.status === 401) {
      showBanner("This server needs an API token: open the dashboard as /?token=<token>.");
    } else if (err instanceof ApiError) {
      showBanner(err.message);
    } else {
      showBanner(`Cannot reach the server (${err.message || err}).`);
    }
  }

  function setConn(state, label) {
    const conn = $("#conn");
    conn.dataset.state = state;
    conn.textContent = label || "";
  }

  // ---------------------------------------------------------------- job list
  const list = { timer: null, gen: 0 };

  async function refreshList() {
    const gen = list.gen;
    const state = $("#state-filter").value;
    let body;
    try {
      body = await api(`v1/jobs${state ? `?state=${encodeURIComponent(state)}` : ""}`);
    } catch (err) {
      if (gen === list.gen) reportError(err);
      return;
    }
    if (gen !== list.gen) return;
    clearBanner();
    renderList(body.jobs || []);
  }

  function jobCells(job) {
    const failed = job.samples_failed
      ? el("span", { class: "failed", text: ` · ${fmtInt(job.samples_failed)} failed` })
      : null;
    return [
      el("td", {},
        el("a", { class: "job-name", href: jobHref(job.id), text: job.name || job.id }),
        el("div", { class: "muted mono small", text: job.id })),
      el("td", {}, stateBadge(job.state),
        // A running job that waits says so in the list too (its page says for what).
        job.state === "running" && job.waiting_for
          ? el("div", { class: "waits small", text: "waiting", title: job.waiting_for }) : null),
      el("td", { class: "col-progress" },
        el("div", { class: "progress-cell" },
          progressBar(job, true),
          el("span", { class: "pct", text: fmtPercent(percent(job)) }))),
      el("td", { class: "num" },
        `${fmtInt(job.samples_done)} / ${fmtInt(job.samples_total)}`, failed),
      el("td", { class: "num", text: listRate(job),
        title: job.state === "running" ? "now" : (job.tokens_per_s_avg ? "average over the run" : "") }),
      el("td", { class: "num", text: job.bytes ? fmtBytes(job.bytes) : "–",
        title: job.bytes ? `${fmtInt(job.bytes)} bytes in ${fmtInt(job.shards)} shards` : "" }),
      el("td", { title: job.started_at ? new Date(job.started_at * 1000).toString() : "" },
        fmtWhen(job.started_at),
        el("div", { class: "muted small", text: fmtAgo(job.started_at) })),
    ];
  }

  // Running: the current rate; otherwise the average over the time the job ran.
  function listRate(job) {
    if (job.state === "running") return fmtCompact(job.tokens_per_s);
    return job.tokens_per_s_avg ? `${fmtCompact(job.tokens_per_s_avg)} avg` : "–";
  }

  const jobHref = (id) => `#/jobs/${encodeURIComponent(id)}`;

  function jobRow(id) {
    const row = el("tr", { "data-job-id": id, tabindex: "0", class: "clickable" });
    row.addEventListener("click", (ev) => {
      if (!ev.target.closest("a")) window.location.hash = jobHref(id);
    });
    row.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") window.location.hash = jobHref(id);
    });
    return row;
  }

  function renderList(jobs) {
    // Rows stay the same elements across refreshes (only their cells are redrawn), so
    // a click or the keyboard focus is never lost to a refresh.
    jobs.sort((a, b) => b.created_at - a.created_at);
    const tbody = $("#job-rows");
    const existing = new Map();
    for (const row of tbody.querySelectorAll("tr[data-job-id]")) {
      existing.set(row.dataset.jobId, row);
    }
    const rows = jobs.map((job) => {
      const row = existing.get(job.id) || jobRow(job.id);
      row.replaceChildren(...jobCells(job));
      return row;
    });
    rows.forEach((row, i) => {
      if (tbody.children[i] !== row) tbody.insertBefore(row, tbody.children[i] || null);
    });
    while (tbody.children.length > rows.length) tbody.lastElementChild.remove();
    $("#job-list-empty").hidden = jobs.length > 0;
    document.title = "hsx · jobs";
  }

  function startList() {
    list.gen += 1;
    setConn("idle", "");
    refreshList();
    list.timer = setInterval(() => {
      if (!document.hidden) refreshList();
    }, LIST_POLL_MS);
  }

  function stopList() {
    list.gen += 1;
    clearInterval(list.timer);
    list.timer = null;
  }

  $("#state-filter").addEventListener("change", () => refreshList());

  // ---------------------------------------------------------------- job page
  let view = null; // the open job page: {id, status, es, points, errors..., train, timers}

  function openJob(id) {
    view = {
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
    };
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

  function closeJob() {
    if (!view) return;
    if (view.es) view.es.close();
    clearTimeout(view.reconnectTimer);
    clearTimeout(view.errorsTimer);
    clearTimeout(view.cancelArmed);
    clearTimeout(view.trainTimer);
    clearTimeout(view.curveTimer);
    clearInterval(view.tick);
    view = null;
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
    $("#progress-text").textContent =
      `${fmtInt(status.samples_done)} / ${totalText} samples · ${fmtPercent(p)}`;
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
    $("#stat-units").textContent = `${fmtInt(status.units_done)} / ${fmtInt(status.units_total)}`
      + (status.units_failed ? ` (${fmtInt(status.units_failed)} failed)` : "");
    const regenerates = Boolean(status.spec && status.spec.regenerate);
    $("#stat-generated-box").hidden = !regenerates;
    $("#stat-generated").textContent = regenerates
      ? `${fmtInt(status.samples_generated)} samples, ${fmtCompact(status.tokens_generated)} tokens`
      : "–";
    $("#stat-failed").textContent = fmtInt(status.samples_failed);
    $("#stat-failed").classList.toggle("warn", status.samples_failed > 0);
    $("#stat-restarts").textContent = fmtInt(status.restarts);
    $("#stat-restarts").classList.toggle("warn", status.restarts > 0);
    renderElapsed(status);

    renderWaiting($("#waiting"), status.waiting_for);
    $("#job-plan").hidden = !status.plan;
    $("#job-plan").textContent = status.plan ? `Plan: ${status.plan.summary}` : "";

    renderWorkers(status);
    $("#last-error-card").hidden = !status.last_error;
    $("#last-error").textContent = status.last_error || "";

    renderCancel(current, status);
    renderDetails(status);
    drawRateChart(current);
    maybeRefreshErrors(current, status);
  }

  // "waiting for 1 GPU of 1: held by the trainer of job a" -> "Waiting for 1 GPU of 1: …"
  function renderWaiting(box, text) {
    box.hidden = !text;
    box.textContent = text ? text.charAt(0).toUpperCase() + text.slice(1) : "";
  }

  function etaText(status) {
    if (status.state === "running") {
      return status.eta_s != null ? `ETA ${fmtDuration(status.eta_s)}` : "ETA –";
    }
    if (status.state === "queued") return "waiting to start";
    if (status.finished_at != null && status.started_at != null) {
      return `${status.state} at ${fmtWhen(status.finished_at)} `
        + `after ${fmtDuration(status.finished_at - status.started_at)}`;
    }
    return "";
  }

  function renderElapsed(status) {
    let text = "–";
    if (status.started_at != null) {
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

  function renderDetails(status) {
    const spec = status.spec || {};
    const rows = [
      ["Output", status.output],
      ["Model", spec.model],
      ["Dataset", spec.dataset],
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

  // ---------------------------------------------------------------- line charts
  // The page's two charts (tokens/s over time, the draft's loss over steps) are one line
  // over a shaded area with y from 0 to a round maximum: drawLineChart draws both.
  function niceMax(v) {
    if (v <= 0) return 1;
    const exp = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) {
      if (v <= m * exp) return m * exp;
    }
    return 10 * exp;
  }

  function roundStep(span, most) {
    // The smallest whole 1, 2 or 5 × 10^k that cuts `span` into at most `most` parts.
    let exp = Math.max(1, 10 ** Math.floor(Math.log10(Math.max(span, 1) / most)));
    for (;;) {
      for (const m of [1, 2, 5]) {
        if (span / (m * exp) <= most) return m * exp;
      }
      exp *= 10;
    }
  }

  const chartHover = new Map(); // canvas -> the pointer's x while it is over the canvas

  function followHover(canvas, redraw) {
    canvas.addEventListener("mousemove", (ev) => {
      chartHover.set(canvas, ev.offsetX);
      redraw();
    });
    canvas.addEventListener("mouseleave", () => {
      chartHover.delete(canvas);
      redraw();
    });
  }

  // `points` ({x, v}, x ascending) between `axis.x0` and `axis.x1`; `axis.xTicks` are
  // the x values labelled with `axis.xLabel(x)`; `axis.hoverLabel(point)` names a point.
  function drawLineChart(canvas, points, axis) {
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth;
    const cssH = canvas.clientHeight;
    if (!cssW || !cssH) return;
    if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);

    const css = getComputedStyle(document.documentElement);
    const color = {
      grid: css.getPropertyValue("--grid").trim() || "#e5e7eb",
      text: css.getPropertyValue("--muted").trim() || "#6b7280",
      line: css.getPropertyValue("--accent").trim() || "#2563eb",
    };
    const pad = { left: 48, right: 14, top: 12, bottom: 24 };
    const w = cssW - pad.left - pad.right;
    const h = cssH - pad.top - pad.bottom;

    const vMax = niceMax(Math.max(0, ...points.map((p) => p.v)) * 1.1);
    const x = (xv) => pad.left + ((xv - axis.x0) / (axis.x1 - axis.x0)) * w;
    const y = (v) => pad.top + h - (v / vMax) * h;

    ctx.font = "11px system-ui, -apple-system, 'Segoe UI', sans-serif";
    ctx.lineWidth = 1;
    if (!points.length) {
      // An empty frame: grid lines only, no made-up scale.
      ctx.strokeStyle = color.grid;
      for (let i = 0; i <= 4; i += 1) {
        const yy = Math.round(pad.top + (h * i) / 4) + 0.5;
        ctx.beginPath();
        ctx.moveTo(pad.left, yy);
        ctx.lineTo(pad.left + w, yy);
        ctx.stroke();
      }
      return;
    }
    // Horizontal grid and y labels.
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i += 1) {
      const v = (vMax * i) / 4;
      const yy = Math.round(y(v)) + 0.5;
      ctx.strokeStyle = color.grid;
      ctx.beginPath();
      ctx.moveTo(pad.left, yy);
      ctx.lineTo(pad.left + w, yy);
      ctx.stroke();
      ctx.fillStyle = color.text;
      // Quarters of a round maximum: 2.5 and 0.375 keep their digits, 25000 reads 25k.
      ctx.fillText(v >= 1000 ? fmtCompact(v) : String(parseFloat(v.toFixed(2))), pad.left - 8, yy);
    }
    // x ticks and labels, kept inside the plot.
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.fillStyle = color.text;
    for (const tick of axis.xTicks) {
      const xx = Math.round(x(tick)) + 0.5;
      ctx.strokeStyle = color.grid;
      ctx.beginPath();
      ctx.moveTo(xx, pad.top + h);
      ctx.lineTo(xx, pad.top + h + 4);
      ctx.stroke();
      const label = axis.xLabel(tick);
      const half = ctx.measureText(label).width / 2;
      ctx.fillText(label, Math.min(Math.max(xx, pad.left + half), pad.left + w - half), pad.top + h + 7);
    }

    // Area, then line.
    ctx.beginPath();
    ctx.moveTo(x(points[0].x), y(0));
    for (const p of points) ctx.lineTo(x(p.x), y(p.v));
    ctx.lineTo(x(points[points.length - 1].x), y(0));
    ctx.closePath();
    const gradient = ctx.createLinearGradient(0, pad.top, 0, pad.top + h);
    gradient.addColorStop(0, hexToRgba(color.line, 0.22));
    gradient.addColorStop(1, hexToRgba(color.line, 0.02));
    ctx.fillStyle = gradient;
    ctx.fill();

    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(x(p.x), y(p.v)) : ctx.moveTo(x(p.x), y(p.v))));
    ctx.strokeStyle = color.line;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.stroke();

    const last = points[points.length - 1];
    ctx.fillStyle = color.line;
    ctx.beginPath();
    ctx.arc(x(last.x), y(last.v), 3.5, 0, 2 * Math.PI);
    ctx.fill();

    // Hover: the point nearest the pointer, with its label.
    const hoverX = chartHover.get(canvas);
    if (hoverX != null && hoverX >= pad.left && hoverX <= pad.left + w) {
      let best = points[0];
      for (const p of points) {
        if (Math.abs(x(p.x) - hoverX) < Math.abs(x(best.x) - hoverX)) best = p;
      }
      const bx = Math.round(x(best.x)) + 0.5;
      ctx.strokeStyle = color.text;
      ctx.lineWidth = 1;
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(bx, pad.top);
      ctx.lineTo(bx, pad.top + h);
      ctx.stroke();
      ctx.setLineDash([]);
      const label = axis.hoverLabel(best);
      ctx.font = "12px system-ui, -apple-system, 'Segoe UI', sans-serif";
      const tw = ctx.measureText(label).width + 12;
      const lx = Math.min(Math.max(bx - tw / 2, pad.left), pad.left + w - tw);
      ctx.fillStyle = "rgba(17, 24, 39, 0.88)";
      ctx.fillRect(lx, pad.top, tw, 20);
      ctx.fillStyle = "#fff";
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillText(label, lx + 6, pad.top + 10);
    }
  }

  function hexToRgba(hex, alpha) {
    const m = /^#?([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(hex);
    if (!m) return hex;
    return `rgba(${parseInt(m[1], 16)}, ${parseInt(m[2], 16)}, ${parseInt(m[3], 16)}, ${alpha})`;
  }

  // ---------------------------------------------------------------- tokens/s chart
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

  function drawRateChart(current) {
    const canvas = $("#rate-chart");
    const points = current ? current.points : [];
    canvas.dataset.points = String(points.length);
    const empty = $("#rate-chart-empty");
    empty.hidden = points.length > 0;
    const ended = Boolean(current && current.status && FINISHED.has(current.status.state));
    if (ended && current.curveLoaded) {
      empty.textContent = "No throughput was recorded for this job.";
    } else if (current && current.status && current.status.state === "running") {
      empty.textContent = "Waiting for the first measurements…";
    } else {
      empty.textContent = "No extraction yet.";
    }
    // A running job: its last 10 minutes, moving. An ended one: its whole run.
    $("#rate-chart-span").textContent = ended ? "whole run" : "last 10 minutes";

    const live = current && current.status && current.status.state === "running";
    const lastT = points.length ? points[points.length - 1].x : Date.now();
    const now = live ? Math.max(Date.now(), lastT) : lastT;
    const t0 = !points.length ? now - CHART_MIN_SPAN_MS
      : (ended ? points[0].x : Math.max(points[0].x, now - CHART_WINDOW_MS));
    // An ended job's curve spans the chart, however short its run was.
    const t1 = Math.max(now, t0 + (ended && points.length > 1 ? 1000 : CHART_MIN_SPAN_MS));
    // Time labels on round clock times (every 1 s, 2 s, 5 s, ... 6 h), at most five.
    const stepS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600]
      .find((st) => (t1 - t0) / (st * 1000) <= 5) || 21600;
    const step = stepS * 1000;
    const ticks = [];
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) ticks.push(t);
    drawLineChart(canvas, points.filter((p) => p.x >= t0), {
      x0: t0, x1: t1, xTicks: ticks, xLabel: fmtClock,
      hoverLabel: (p) => `${fmtCompact(p.v)} tok/s · ${fmtClock(p.x)}`,
    });
  }

  followHover($("#rate-chart"), () => drawRateChart(view));

  // ---------------------------------------------------------------- draft training
  // GET <job>/train, polled while the training goes on. A 404 means the job has no
  // training (yet): the section stays hidden and the page asks again now and then, as
  // one can start at any time (hsx train, POST <job>/train).
  function pollTraining(current) {
    current.trainTimer = null;
    api(`${jobPath(current.id)}/train`).then((train) => {
      if (current !== view) return;
      clearBanner();
      renderTraining(current, train);
      if (!TRAIN_ENDED.has(train.state)) scheduleTraining(current, TRAIN_POLL_MS);
    }, (err) => {
      if (current !== view) return;
      if (err instanceof ApiError && err.status === 404) {
        current.train = null;
        $("#training").hidden = true;
        scheduleTraining(current, TRAIN_ABSENT_POLL_MS);
        return;
      }
      reportError(err);
      if (!(err instanceof ApiError && [401, 403].includes(err.status))) {
        scheduleTraining(current, TRAIN_POLL_MS);
      }
    });
  }

  function scheduleTraining(current, ms) {
    current.trainTimer = setTimeout(() => {
      if (current === view) pollTraining(current);
    }, ms);
  }

  function fmtLoss(v) {
    return v == null || !Number.isFinite(v) ? "–" : v.toFixed(Math.abs(v) < 10 ? 3 : 2);
  }

  function resetTraining() {
    $("#training").hidden = true;
    clearStats("#train-stats");
    setBadge($("#train-state"), null);
    $("#train-draft").textContent = "";
    $("#train-meta").textContent = "";
    $("#train-plan").textContent = "";
    $("#train-warning").hidden = true;
    $("#train-warning").textContent = "";
    renderWaiting($("#train-waiting"), null);
    $("#train-error-box").hidden = true;
    $("#train-error").textContent = "";
    drawLossChart(null);
  }

  function renderTraining(current, train) {
    current.train = train;
    const spec = train.spec || {};
    const running = train.state === "running";
    $("#training").hidden = false;
    setBadge($("#train-state"), train.state);

    const plan = train.plan || null;
    const lastStep = spec.max_steps != null ? spec.max_steps : plan && plan.steps;
    $("#train-step").textContent = fmtInt(train.step)
      + (lastStep != null ? ` / ${fmtInt(lastStep)}` : "");
    // Epochs count from 0 while they run; a finished training has epoch == epochs.
    const epochs = spec.epochs != null ? Math.ceil(spec.epochs)
      : plan ? Math.max(1, Math.ceil(plan.passes - 1e-9)) : null;
    $("#train-epoch").textContent = epochs != null
      ? `${Math.min(train.epoch + 1, epochs)} / ${epochs}` : String(train.epoch + 1);
    $("#train-loss").textContent = fmtLoss(train.loss);
    const acc = (train.acc || []).map((a) => a.toFixed(2)).join(" / ");
    $("#train-acc").textContent = acc || "–";
    $("#train-acc").title = acc ? "draft accuracy at TTT steps 1, 2, … of the last logged step" : "";
    $("#train-rate").textContent = running ? fmtInt(train.tokens_per_s) : "–";
    $("#train-wait").textContent = running ? fmtPercent(100 * (train.wait_fraction || 0)) : "–";
    // Mostly waiting on data: the trainer outruns the extraction.
    $("#train-wait").classList.toggle("warn", running && train.wait_fraction > 0.5);
    $("#train-checkpoint").textContent = train.checkpoint_step != null
      ? `step ${fmtInt(train.checkpoint_step)}` : "none yet";
    $("#train-restarts").textContent = fmtInt(train.restarts);
    $("#train-restarts").classList.toggle("warn", train.restarts > 0);

    $("#train-draft").textContent = train.draft;
    const meta = [];
    if (train.first_step_at != null) meta.push(`first step at ${fmtWhen(train.first_step_at)}`);
    if (train.resumed_from != null) meta.push(`resumed from step ${fmtInt(train.resumed_from)}`);
    $("#train-meta").textContent = meta.join(" · ");

    renderTrainingQuality(train, plan);
    renderWaiting($("#train-waiting"), train.waiting_for);

    $("#train-error-box").hidden = !train.error;
    $("#train-error").textContent = train.error || "";
    drawLossChart(train);
  }

  // The schedule the trainer chose, its warning, the held-out validation (the draft in
  // draft/ is the best checkpoint by it) and vLLM's measurement after training.
  function renderTrainingQuality(train, plan) {
    $("#train-plan").textContent = plan
      ? `Plan: ${fmtInt(plan.steps)} steps of ${fmtInt(plan.batch_tokens)} tokens`
        + (plan.workers > 1 ? ` × ${plan.workers} workers` : "")
        + ` on ${plan.device}, lr ${plan.lr} (${plan.lr_schedule}),`
        + ` ${plan.passes.toFixed(1)} passes over ${fmtInt(plan.train_tokens)} tokens;`
        + ` ${fmtInt(plan.val_samples)} samples held out`
      : "";
    $("#train-warning").hidden = !train.warning;
    $("#train-warning").textContent = train.warning ? `Warning: ${train.warning}` : "";

    const checks = train.validation || [];
    const last = checks.length ? checks[checks.length - 1] : null;
    $("#train-val").textContent = last
      ? `${last.expected_acceptance_length.toFixed(2)} at step ${fmtInt(last.step)}` : "–";
    $("#train-val").title = last
      ? `loss ${fmtLoss(last.loss)}; P(right | earlier right) per TTT step: `
        + last.cond_acc.map((a) => a.toFixed(2)).join(" / ") : "";
    $("#train-best").textContent = train.best_step != null
      ? `step ${fmtInt(train.best_step)} (${train.best_expected_acceptance_length.toFixed(2)})`
      : "–";

    const ev = train.eval;
    const measured = ev && !ev.error && ev.mean_acceptance_length != null;
    $("#train-eval").textContent = measured
      ? `${ev.mean_acceptance_length.toFixed(2)} at k=${ev.k}`
      : ev && ev.error ? "failed" : train.state === "evaluating" ? "measuring…" : "–";
    $("#train-eval").title = measured
      ? `${fmtInt(ev.prompts)} ${ev.prompt_source || "prompts"}; ${fmtInt(ev.accepted_tokens)}`
        + ` of ${fmtInt(ev.draft_tokens)} draft tokens accepted` : (ev && ev.error) || "";
    $("#train-eval").classList.toggle("warn", Boolean(ev && ev.error));
    $("#train-eval-pos").textContent = measured
      ? ev.acceptance_per_position.map((a) => a.toFixed(2)).join(" / ") : "–";
  }

  function drawLossChart(train) {
    const canvas = $("#loss-chart");
    const points = (train ? train.history || [] : [])
      .filter((p) => Number.isFinite(p.loss))
      .map((p) => ({ x: p.step, v: p.loss }));
    canvas.dataset.points = String(points.length);
    canvas.dataset.lastLoss = points.length ? String(points[points.length - 1].v) : "";
    $("#loss-chart-empty").hidden = points.length > 0;
    const x1 = Math.max(1, points.length ? points[points.length - 1].x : 0);
    const step = roundStep(x1, 5);
    const ticks = [];
    for (let s = 0; s <= x1; s += step) ticks.push(s);
    drawLineChart(canvas, points, {
      x0: 0, x1, xTicks: ticks, xLabel: fmtCompact,
      hoverLabel: (p) => `loss ${fmtLoss(p.v)} · step ${fmtInt(p.x)}`,
    });
  }

  followHover($("#loss-chart"), () => drawLossChart(view && view.train));
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

  window.addEventListener("hashchange", route);
  route();
})();
