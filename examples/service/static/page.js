// The live page: one EventSource on /events (the browser reconnects by itself and sends
// Last-Event-ID, so the service replays what it missed), and /health once a second for
// the service's own counters. Text goes in through textContent only: a process names
// itself, and its name must never become markup.
"use strict";

const MAX_ROWS = 500;
const HEALTH_PERIOD_MS = 1000;
const HEALTH_AFTER_EVENTS_MS = 200;  // the service's counters soon after events came

const $ = (id) => document.getElementById(id);
const counts = { events: 0, lost: 0, missed: 0 };
let healthSoon = null;

function setText(id, value) {
  $(id).textContent = String(value);
}

function setStatus(state) {
  const status = $("status");
  status.textContent = state;
  status.className = "status " + state;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
}

function addEvent(record) {
  const row = document.createElement("tr");
  const kind = record.event.toLowerCase();
  row.className = kind;
  row.dataset.pid = record.pid;
  row.dataset.event = record.event;
  cell(row, record.time.slice(11, 23), "time");  // HH:MM:SS.mmm of the kernel's time
  cell(row, record.event, "kind");
  cell(row, record.comm);
  cell(row, record.pid, "num");
  cell(row, record.ppid, "num");
  if (record.exit_event) {
    cell(row, "[" + record.exit_code + "]");
    cell(row, record.duration_ns ? (record.duration_ns / 1e6).toFixed(1) + " ms" : "", "num");
  } else {
    cell(row, record.filename);
    cell(row, "");
  }
  cell(row, record.cpu, "num");
  const body = $("events");
  body.insertBefore(row, body.firstChild);
  while (body.rows.length > MAX_ROWS) body.deleteRow(-1);
  setText("count-events", ++counts.events);
}

function connect() {
  const source = new EventSource("/events");
  source.onopen = () => setStatus("live");
  source.onerror = () => {
    setStatus(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  };
  source.onmessage = (e) => {
    addEvent(JSON.parse(e.data));
    refreshHealthSoon();
  };
  source.addEventListener("lost", (e) => {
    counts.lost += JSON.parse(e.data).count;
    setText("count-lost", counts.lost);
    refreshHealthSoon();
  });
  source.addEventListener("missed", (e) => {
    const notice = JSON.parse(e.data);
    // null: the service restarted, and how many were missed is unknown.
    if (notice.missed !== null) counts.missed += notice.missed;
    setText("count-missed", counts.missed + (notice.missed === null ? "+" : ""));
  });
}

function refreshHealthSoon() {
  if (healthSoon === null) {
    healthSoon = setTimeout(() => {
      healthSoon = null;
      refreshHealth();
    }, HEALTH_AFTER_EVENTS_MS);
  }
}

async function refreshHealth() {
  try {
    const response = await fetch("/health", { cache: "no-store" });
    const health = await response.json();
    setText("samples", health.samples ?? "–");
    setText("lost-total", health.lost ?? "–");
    setText("clients", health.clients);
    const byCpu = health.lost_by_cpu || {};
    setText("lost-by-cpu",
      Object.keys(byCpu).map((cpu) => "CPU " + cpu + ": " + byCpu[cpu]).join(", ") || "–");
  } catch (err) {
    setText("clients", "–");  // the service is down; EventSource shows "reconnecting"
  }
}

connect();
refreshHealth();
setInterval(refreshHealth, HEALTH_PERIOD_MS);
