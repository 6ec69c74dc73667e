// Building and updating the page's elements: el(), badges, progress bars, the banner
// and the connection mark.

import { ApiError } from "./api.js";
import { percent } from "./format.js";

export const $ = (sel) => document.querySelector(sel);

export function el(tag, attrs = {}, ...children) {
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

export function stateBadge(state) {
  return el("span", { class: `badge state-${state}`, text: state });
}

export function setBadge(badge, state) {
  badge.textContent = state || "";
  badge.className = state ? `badge state-${state}` : "badge";
  badge.dataset.state = state || "";
}

export function clearStats(selector) {
  for (const dd of document.querySelectorAll(`${selector} dd`)) {
    dd.textContent = "–";
    dd.classList.remove("warn");
  }
}

export function progressBar(status, small) {
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

export function setProgress(bar, status) {
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

export function clearBanner() {
  $("#banner").hidden = true;
}

export function reportError(err) {
  if (err instanceof ApiError && err.status === 401) {
    showBanner("This server needs an API token: open the dashboard as /?token=<token>.");
  } else if (err instanceof ApiError) {
    showBanner(err.message);
  } else {
    showBanner(`Cannot reach the server (${err.message || err}).`);
  }
}

export function setConn(state, label) {
  const conn = $("#conn");
  conn.dataset.state = state;
  conn.textContent = label || "";
}

// "waiting for 1 GPU of 1: held by the trainer of job a" -> "Waiting for 1 GPU of 1: …"
export function renderWaiting(box, text) {
  box.hidden = !text;
  box.textContent = text ? text.charAt(0).toUpperCase() + text.slice(1) : "";
}
