// The job page's two charts: tokens/s over time and the draft's loss over steps.

import { FINISHED } from "./api.js";
import { $ } from "./dom.js";
import { fmtAlreadyComplete, fmtClock, fmtCompact, fmtInt, fmtLoss } from "./format.js";

const CHART_WINDOW_MS = 10 * 60 * 1000;
const CHART_MIN_SPAN_MS = 30 * 1000;

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

export function followHover(canvas, redraw) {
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
export function drawRateChart(current) {
  const canvas = $("#rate-chart");
  const points = current ? current.points : [];
  canvas.dataset.points = String(points.length);
  const empty = $("#rate-chart-empty");
  empty.hidden = points.length > 0;
  const ended = Boolean(current && current.status && FINISHED.has(current.status.state));
  if (ended && current.status.already_complete) {
    empty.textContent = `Nothing extracted: ${fmtAlreadyComplete(current.status)}.`;
  } else if (ended && current.curveLoaded) {
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

// ---------------------------------------------------------------- loss chart
export function drawLossChart(train) {
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
