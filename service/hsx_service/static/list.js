// The job list (#/): every job with its state, progress and rate, polled.

import { api } from "./api.js";
import {
  $, clearBanner, el, progressBar, reportError, setConn, stateBadge,
} from "./dom.js";
import {
  fmtAgo, fmtBytes, fmtCompact, fmtInt, fmtPercent, fmtWhen, percent,
} from "./format.js";

const LIST_POLL_MS = 3000;

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

export function startList() {
  list.gen += 1;
  setConn("idle", "");
  refreshList();
  list.timer = setInterval(() => {
    if (!document.hidden) refreshList();
  }, LIST_POLL_MS);
}

export function stopList() {
  list.gen += 1;
  clearInterval(list.timer);
  list.timer = null;
}

$("#state-filter").addEventListener("change", () => refreshList());
