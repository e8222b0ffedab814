// The live page: one EventSource on /events (the browser reconnects by itself and sends
// Last-Event-ID, so the service replays what it missed), and /health once a second for
// the service's own counters. Text goes in through textContent only: a process names
// itself, and its name must never become markup. The chart is an SVG drawn here: no
// library, nothing from elsewhere.
//
// First paint: the stream asks for the last MAX_ROWS events (?history=), which fill the
// table, and the service says `ready` once they are all sent, with the clients it has,
// this page among them. Until then the page says "connecting…" and shows no number it
// does not have yet; /health is asked only from then on (asked before, it could answer
// before this page's stream was counted: "clients 0").
"use strict";

const MAX_ROWS = 500;
const HEALTH_PERIOD_MS = 1000;
const HEALTH_AFTER_EVENTS_MS = 200;  // the service's counters soon after events came

const CHART_SECONDS = 60;
const CHART_PERIOD_MS = 500;
const SVG = "http://www.w3.org/2000/svg";
// The plot area inside the SVG's viewBox (0 0 1000 170): room for the axis labels.
const PLOT = { left: 44, right: 990, top: 8, bottom: 150 };
const CPU_COLORS = ["#1f5fa8", "#2a9d8f", "#6a4c93", "#4d908e", "#277da1", "#577590"];
const OTHER_COLORS = { lost: "#b3261e", missed: "#e09f3e" };

const $ = (id) => document.getElementById(id);
const counts = { events: 0, lost: 0, missed: 0 };  // since the page had its history
let healthSoon = null;
let caughtUp = false;  // the first `ready` came: what follows happened while the page is open

function setText(id, value) {
  $(id).textContent = String(value);
}

let signedOut = false;

function setStatus(state, label = state) {
  if (signedOut) return;  // for good: only the token lets this browser in again
  const status = $("status");
  status.textContent = label;
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
  $("table-state").hidden = true;
  if (!caughtUp) return;  // history: in the table, not in the counts of this page
  setText("count-events", ++counts.events);
  countPerSecond("cpu " + record.cpu, 1);
}

function showCounts() {
  setText("count-events", counts.events);
  setText("count-lost", counts.lost);
  setText("count-missed", counts.missed);
}

// --- the chart: per-second counts of the last minute, one series per CPU, lost, missed ---

// name -> counts of the last CHART_SECONDS whole seconds, then of the current one (drawn
// once it is over: a second under way would show as a drop).
const series = new Map([["lost", []], ["missed", []]]);
let chartSecond = Math.floor(Date.now() / 1000);

function zeros() {
  return new Array(CHART_SECONDS + 1).fill(0);
}
series.forEach((_, name) => series.set(name, zeros()));

function rollChart() {
  const now = Math.floor(Date.now() / 1000);
  const shift = Math.min(CHART_SECONDS + 1, now - chartSecond);
  if (shift > 0) {
    series.forEach((values) => {
      values.splice(0, shift);
      for (let i = 0; i < shift; i++) values.push(0);
    });
    chartSecond = now;
  }
}

function countPerSecond(name, count) {
  rollChart();
  if (!series.has(name)) {
    series.set(name, zeros());
  }
  series.get(name)[CHART_SECONDS] += count;
}

function svg(name, attributes, text) {
  const element = document.createElementNS(SVG, name);
  for (const key in attributes) element.setAttribute(key, String(attributes[key]));
  if (text !== undefined) element.textContent = text;
  return element;
}

function seriesNames() {
  const cpus = [...series.keys()].filter((n) => n.startsWith("cpu "))
    .sort((a, b) => Number(a.slice(4)) - Number(b.slice(4)));
  return [...cpus, "lost", "missed"];
}

function colorOf(name, index) {
  return OTHER_COLORS[name] || CPU_COLORS[index % CPU_COLORS.length];
}

function drawChart() {
  rollChart();
  const chart = $("chart");
  const names = seriesNames();
  const shown = (name) => series.get(name).slice(0, CHART_SECONDS);
  const peak = Math.max(1, ...names.map((n) => Math.max(...shown(n))));
  // Log scale, so that a burst of thousands lost and a few events a second both show.
  const top = Math.pow(10, Math.ceil(Math.log10(peak + 1)));
  const height = PLOT.bottom - PLOT.top;
  const y = (v) => PLOT.bottom - height * Math.log10(1 + v) / Math.log10(1 + top);
  const x = (i) => PLOT.left + (PLOT.right - PLOT.left) * i / (CHART_SECONDS - 1);
  const parts = [];
  for (let grid = 1; grid <= top; grid *= 10) {
    parts.push(svg("line", { class: "grid", x1: PLOT.left, x2: PLOT.right, y1: y(grid),
                             y2: y(grid) }));
    parts.push(svg("text", { x: PLOT.left - 6, y: y(grid) + 4, "text-anchor": "end" },
                   grid.toLocaleString("en")));
  }
  parts.push(svg("text", { x: PLOT.left - 6, y: PLOT.bottom + 4, "text-anchor": "end" }, "0"));
  parts.push(svg("line", { class: "axis", x1: PLOT.left, x2: PLOT.right, y1: PLOT.bottom,
                           y2: PLOT.bottom }));
  parts.push(svg("text", { x: PLOT.left, y: PLOT.bottom + 16 }, "-" + CHART_SECONDS + " s"));
  parts.push(svg("text", { x: PLOT.right, y: PLOT.bottom + 16, "text-anchor": "end" }, "now"));
  const legend = [];
  names.forEach((name, index) => {
    const values = shown(name);
    const color = colorOf(name, index);
    parts.push(svg("polyline", {
      "data-series": name,
      "data-values": values.join(" "),
      stroke: color,
      points: values.map((v, i) => x(i).toFixed(1) + "," + y(v).toFixed(1)).join(" "),
    }));
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.append(swatch, name === "lost" ? "lost in the kernel"
      : name === "missed" ? "missed by this page" : name.replace("cpu", "CPU") + " events");
    legend.push(item);
  });
  chart.replaceChildren(...parts);
  $("chart-legend").replaceChildren(...legend);
}

function connect() {
  const source = new EventSource("/events?history=" + MAX_ROWS);
  source.onerror = () => {
    setStatus(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  };
  // After every (re)connection, once the service has sent what it held when this page
  // came: the page is live, and counted among the clients.
  source.addEventListener("ready", (e) => {
    const ready = JSON.parse(e.data);
    if (!caughtUp) {
      caughtUp = true;
      showCounts();
      if ($("events").rows.length === 0) setText("table-state", "no events yet");
      refreshHealth();
      setInterval(refreshHealth, HEALTH_PERIOD_MS);
    }
    setText("clients", ready.clients);
    setStatus("live");
  });
  source.onmessage = (e) => {
    addEvent(JSON.parse(e.data));
    if (caughtUp) refreshHealthSoon();
  };
  source.addEventListener("lost", (e) => {
    if (!caughtUp) return;  // lost before the page opened: in /health's count
    const count = JSON.parse(e.data).count;
    counts.lost += count;
    countPerSecond("lost", count);
    setText("count-lost", counts.lost);
    refreshHealthSoon();
  });
  source.addEventListener("missed", (e) => {
    const notice = JSON.parse(e.data);
    if (!caughtUp) return;  // history that left the window while it was sent: not live
    // null: the service restarted, and how many were missed is unknown.
    if (notice.missed !== null) {
      counts.missed += notice.missed;
      countPerSecond("missed", notice.missed);
    }
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
    if (response.status === 401) {
      // The session ended (the service restarted, the page was closed too long, or a
      // copy of its cookie was used): the URL with the token opens a new one.
      setStatus("signed-out", "signed out: open /?token=… again");
      signedOut = true;
      return;
    }
    const health = await response.json();
    setText("samples", health.samples ?? "–");
    setText("lost-total", health.lost ?? "–");
    setText("clients", health.clients);
    const byCpu = health.lost_by_cpu || {};
    Object.keys(byCpu).forEach((cpu) => countPerSecond("cpu " + cpu, 0));  // every CPU's line
    setText("lost-by-cpu",
      Object.keys(byCpu).map((cpu) => "CPU " + cpu + ": " + byCpu[cpu]).join(", ") || "–");
  } catch (err) {
    setText("clients", "–");  // the service is down; EventSource shows "reconnecting"
  }
}

connect();
drawChart();
setInterval(drawChart, CHART_PERIOD_MS);
