"use strict";
// The status page: the key's batches and the engines' load, read from the /v1 API with the key
// the user enters once (kept for this browser tab only). Everything the API returns is put in
// the page as text, never as markup.

const KEY_ITEM = "pagedbatch.apiKey";
const PAGE_SIZE = 20;
const MAX_LIMIT = 100; // the most /v1/batches returns at once
const BUSY_REFRESH_MS = 1000; // while a batch is moving or the engine is working
const IDLE_REFRESH_MS = 5000;
const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const ENDINGS = [
  ["completed_at", "completed"],
  ["failed_at", "failed"],
  ["expired_at", "expired"],
  ["cancelled_at", "cancelled"],
];

const state = {
  wanted: PAGE_SIZE, // batches shown; "Show more" adds a page
  timer: null,
  refreshing: false,
  again: false, // a refresh was asked for while one was running
  rows: new Map(), // batch id -> its table row
};

const $ = (id) => document.getElementById(id);

class Unauthorized extends Error {}

async function api(path) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) throw new Unauthorized(await errorMessage(response));
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function listBatches(wanted) {
  const batches = [];
  let after = null;
  let more = true;
  while (more && batches.length < wanted) {
    const params = new URLSearchParams({ limit: Math.min(MAX_LIMIT, wanted - batches.length) });
    if (after) params.set("after", after);
    const page = await (await api(`v1/batches?${params}`)).json();
    batches.push(...page.data);
    more = page.has_more;
    after = page.last_id;
  }
  return { batches, more };
}

function refreshNow() {
  clearTimeout(state.timer);
  if (state.refreshing) {
    state.again = true;
    return;
  }
  refresh();
}

async function refresh() {
  state.refreshing = true;
  state.again = false;
  let delay = IDLE_REFRESH_MS;
  try {
    const [listed, engines] = await Promise.all([
      listBatches(state.wanted),
      api("v1/engine/stats").then((response) => response.json()),
    ]);
    showSignedIn();
    renderBatches(listed.batches, listed.more);
    renderEngines(engines);
    $("problem").hidden = true;
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    const busy =
      listed.batches.some((batch) => ACTIVE.has(batch.status)) ||
      engines.engines.some((engine) => engine.running + engine.waiting > 0);
    if (busy) delay = BUSY_REFRESH_MS;
  } catch (error) {
    if (error instanceof Unauthorized) {
      askForKey(error.message);
      delay = null;
    } else {
      showProblem(`Could not refresh: ${error.message}`);
    }
  } finally {
    state.refreshing = false;
  }
  if (state.again) refresh();
  else if (delay !== null) state.timer = setTimeout(refresh, delay);
}

function showSignedIn() {
  $("key-form").hidden = true;
  $("batches").hidden = false;
  $("engines").hidden = false;
  $("forget-key").hidden = !sessionStorage.getItem(KEY_ITEM);
}

function askForKey(message) {
  clearTimeout(state.timer);
  // A stored key that the server refuses is dropped; a first visit just asks, without an error.
  const hadKey = sessionStorage.getItem(KEY_ITEM) !== null;
  sessionStorage.removeItem(KEY_ITEM);
  $("key-error").textContent = hadKey ? message : "";
  $("key-form").hidden = false;
  $("batches").hidden = true;
  $("engines").hidden = true;
  $("forget-key").hidden = true;
  $("updated").textContent = "";
  $("api-key").focus();
}

function showProblem(message) {
  $("problem").textContent = message;
  $("problem").hidden = false;
}

function renderEngines(stats) {
  const body = $("engine-rows");
  $("engines-unavailable").hidden = stats.available;
  body.closest("table").hidden = !stats.available;
  body.replaceChildren(
    ...stats.engines.map((engine) => {
      const kv = document.createElement("meter");
      kv.min = 0;
      kv.max = 1;
      kv.value = engine.kv_usage;
      const kvCell = cell("");
      // One decimal: a large cache is often well under 1% full.
      kvCell.append(kv, ` ${(engine.kv_usage * 100).toFixed(1)}%`);
      const rate = engine.tokens_per_second;
      return row(
        [
          cell(engine.id),
          cell(engine.model),
          cell(engine.running, "number"),
          cell(engine.waiting, "number"),
          kvCell,
          cell(rate === null ? "–" : rate.toFixed(1), "number"),
        ],
        { engineId: engine.id },
      );
    }),
  );
}

function renderBatches(batches, more) {
  const body = $("batch-rows");
  const shown = new Set(batches.map((batch) => batch.id));
  for (const [id, tr] of state.rows) {
    if (!shown.has(id)) {
      tr.remove();
      state.rows.delete(id);
    }
  }
  batches.forEach((batch, index) => {
    let tr = state.rows.get(batch.id);
    if (!tr) {
      tr = batchRow(batch.id);
      state.rows.set(batch.id, tr);
    }
    updateBatchRow(tr, batch);
    // Rows move only when the order changes, so a button being clicked stays put.
    if (body.children[index] !== tr) body.insertBefore(tr, body.children[index] ?? null);
  });
  $("no-batches").hidden = batches.length > 0;
  $("more").hidden = !more;
}

function batchRow(id) {
  const tr = row([], { batchId: id });
  tr.innerHTML = `
    <td><code class="batch-id"></code><div class="muted detail"></div></td>
    <td><span class="status"></span><div class="error detail batch-error"></div></td>
    <td class="progress-cell"><progress></progress> <span class="percent"></span></td>
    <td class="number completed"></td><td class="number failed"></td><td class="number total"></td>
    <td class="created"></td><td class="started"></td><td class="ended"></td>
    <td class="files">
      <button type="button" class="link output" hidden>output</button>
      <button type="button" class="link errors" hidden>errors</button>
    </td>`;
  tr.querySelector(".batch-id").textContent = id;
  for (const kind of ["output", "errors"]) {
    const button = tr.querySelector(`.${kind}`);
    button.addEventListener("click", () =>
      download(button.dataset.fileId, `${id}_${kind}.jsonl`),
    );
  }
  return tr;
}

function updateBatchRow(tr, batch) {
  const counts = batch.request_counts;
  const done = counts.completed + counts.failed;
  const part = (selector) => tr.querySelector(selector);
  tr.dataset.status = batch.status;
  part(".detail").textContent = [batch.endpoint, batch.model].filter(Boolean).join(" · ");
  const status = part(".status");
  status.textContent = batch.status;
  status.className = `status status-${batch.status}`;
  const firstError = batch.errors?.data?.[0];
  part(".batch-error").textContent = firstError
    ? `${firstError.line ? `line ${firstError.line}: ` : ""}${firstError.message}`
    : "";

  const progress = part("progress");
  if (counts.total > 0) {
    progress.max = counts.total;
    progress.value = done;
    part(".percent").textContent = percent(done / counts.total);
  } else if (ACTIVE.has(batch.status)) {
    progress.removeAttribute("value"); // indeterminate: the lines are not counted yet
    part(".percent").textContent = "";
  } else {
    progress.max = 1;
    progress.value = 0;
    part(".percent").textContent = "";
  }
  progress.setAttribute("aria-label", `${batch.id}: ${done} of ${counts.total} requests done`);
  part(".completed").textContent = counts.completed;
  part(".failed").textContent = counts.failed;
  part(".total").textContent = counts.total;

  setTime(part(".created"), batch.created_at);
  setTime(part(".started"), batch.in_progress_at);
  // Only an ending other than completion is named: its time alone would not tell which it was.
  const [field, ending] = ENDINGS.find(([name]) => batch[name]) ?? [null, ""];
  setTime(part(".ended"), field && batch[field], ending === "completed" ? "" : ending);

  for (const [kind, fileId] of [["output", batch.output_file_id], ["errors", batch.error_file_id]]) {
    const button = part(`.${kind}`);
    button.hidden = !fileId;
    button.dataset.fileId = fileId ?? "";
  }
}

function setTime(td, seconds, label = "") {
  if (!seconds) {
    td.textContent = "";
    td.removeAttribute("title");
    return;
  }
  const when = new Date(seconds * 1000);
  const today = when.toDateString() === new Date().toDateString();
  const shown = today ? when.toLocaleTimeString() : when.toLocaleString();
  td.textContent = label ? `${label} ${shown}` : shown;
  td.title = when.toISOString();
}

async function download(fileId, name) {
  // A plain link could not send the key, so the file is fetched and handed over as a blob.
  try {
    const response = await api(`v1/files/${encodeURIComponent(fileId)}/content`);
    const url = URL.createObjectURL(await response.blob());
    const link = document.createElement("a");
    link.href = url;
    link.download = name;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (error) {
    if (error instanceof Unauthorized) askForKey(error.message);
    else showProblem(`Could not download ${name}: ${error.message}`);
  }
}

function row(cells, data) {
  const tr = document.createElement("tr");
  Object.assign(tr.dataset, data);
  tr.append(...cells);
  return tr;
}

function cell(text, className = "") {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function percent(fraction) {
  return `${Math.floor(fraction * 100)}%`;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("api-key").value.trim());
  $("api-key").value = "";
  refreshNow();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  for (const tr of state.rows.values()) tr.remove();
  state.rows.clear();
  $("engine-rows").replaceChildren();
  refreshNow();
});

$("more").addEventListener("click", () => {
  state.wanted += PAGE_SIZE;
  refreshNow();
});

refreshNow();
