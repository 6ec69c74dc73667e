// The draft training's card on a job's page: its plan, step, loss curve, validation
// and measured acceptance.

import { ApiError, api, jobPath } from "./api.js";
import { drawLossChart, followHover } from "./charts.js";
import {
  $, clearBanner, clearStats, renderWaiting, reportError, setBadge,
} from "./dom.js";
import { fmtInt, fmtLoss, fmtPercent, fmtWhen } from "./format.js";
import { view } from "./view.js";

const TRAIN_POLL_MS = 2000;
const TRAIN_ABSENT_POLL_MS = 10000;
// "stopped": the coordinator shut down; it resumes the training when it starts again.
const TRAIN_ENDED = new Set(["done", "failed", "stopped"]);

// GET <job>/train, polled while the training goes on. A 404 means the job has no
// training (yet): the section stays hidden and the page asks again now and then, as
// one can start at any time (hsx train, POST <job>/train).
export function pollTraining(current) {
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

export function resetTraining() {
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
      + (plan.online ? `. ${plan.online[0].toUpperCase()}${plan.online.slice(1)}` : "")
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

followHover($("#loss-chart"), () => drawLossChart(view && view.train));
