// How the dashboard writes counts, sizes, durations, times, percentages and losses.

const intFmt = new Intl.NumberFormat("en-US");

export function fmtInt(n) {
  return intFmt.format(Math.round(n || 0));
}

export function fmtCompact(n) {
  const v = Math.abs(n || 0);
  if (v >= 1e9) return `${(n / 1e9).toFixed(v >= 1e10 ? 0 : 1)}G`;
  if (v >= 1e6) return `${(n / 1e6).toFixed(v >= 1e7 ? 0 : 1)}M`;
  if (v >= 1e3) return `${(n / 1e3).toFixed(v >= 1e4 ? 0 : 1)}k`;
  return `${Math.round(n || 0)}`;
}

export function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = n || 0;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(v >= 100 ? 0 : 1)} ${units[i]}`;
}

export function fmtDuration(seconds) {
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

export function fmtClock(ms) {
  return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
}

export function fmtWhen(unix) {
  if (unix == null) return "–";
  const date = new Date(unix * 1000);
  const now = new Date();
  if (date.toDateString() === now.toDateString()) return fmtClock(date.getTime());
  return date.toLocaleString("en-GB", {
    year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
  });
}

export function fmtAgo(unix) {
  if (unix == null) return "";
  const s = Date.now() / 1000 - unix;
  return s < 5 ? "just now" : `${fmtDuration(s)} ago`;
}

export function percent(status) {
  if (status.samples_total > 0) {
    return Math.min(100, (100 * status.samples_done) / status.samples_total);
  }
  return status.state === "succeeded" ? 100 : 0;
}

export function fmtPercent(p) {
  return p >= 100 || p === 0 ? `${Math.round(p)}%` : `${p.toFixed(1)}%`;
}

export function fmtLoss(v) {
  return v == null || !Number.isFinite(v) ? "–" : v.toFixed(Math.abs(v) < 10 ? 3 : 2);
}

// A rerun of a finished job (the CLI says the same): it found every sample committed,
// extracted nothing, and so has no rate or elapsed time of its own.
export function fmtAlreadyComplete(status) {
  return `already complete: ${fmtInt(status.samples_done)} samples committed by an earlier run`;
}
