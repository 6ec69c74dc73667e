// The open job page, which job.js opens and closes and training.js also draws on:
// {id, status, es, points, errors..., train, timers}, or null on the job list. An answer
// that comes back for a page no longer open (`current !== view`) is dropped.

export let view = null;

export function setView(next) {
  view = next;
}
