// The live view of the KV cache: polls GET /kv-cache (only while this tab is visible and "live" is on) and
// draws every physical block as a cell of a canvas, coloured by the request that holds it.
// The wire format is described in tinypaged/server/kv_view.py: per block a code
//   holder << 2 | shared << 1 | cached   (holder: 1 + index into `requests`, 0 = free)
// run-length encoded as [code, count, code, count, ...].
"use strict";

const KV_POLL_MS = 250;
const KV_HISTORY_MS = 60_000;
const KV_COLORS = { free: "#e4e7ec", freeCached: "#c5e3da", mark: "#1d2330", gpu: "#2f6fdf", cpu: "#d97706" };

// A colour per request id, the same in the grid, the table and across polls: hues a golden angle apart in the
// order this tab first saw the requests, so that requests running together get distinct colours.
const KV_HUES = new Map();

function requestHue(id) {
  let hue = KV_HUES.get(id);
  if (hue === undefined) {
    hue = (KV_HUES.size * 137.508 + 210) % 360;
    KV_HUES.set(id, hue);
  }
  return hue;
}

function forgetHues(requests) {
  if (KV_HUES.size < 4096) return;
  const live = new Set(requests.map((r) => r.id));
  for (const id of KV_HUES.keys()) if (!live.has(id)) KV_HUES.delete(id);
}

function requestColor(id, light = false) {
  return `hsl(${requestHue(id).toFixed(0)}, 62%, ${light ? 70 : 52}%)`;
}

function decodeRuns(runs, numBlocks) {
  const codes = new Uint32Array(numBlocks);
  let at = 0;
  for (let i = 0; i < runs.length; i += 2) {
    codes.fill(runs[i], at, at + runs[i + 1]);
    at += runs[i + 1];
  }
  return codes;
}

class BlockGrid {
  // One pool drawn on a canvas: a cell per block, as large as fits in maxHeight CSS pixels.
  constructor(canvas, maxHeight) {
    this.canvas = canvas;
    this.maxHeight = maxHeight;
    this.codes = new Uint32Array(0);
    this.requests = [];
    this.cell = 1;
    this.cols = 1;
    canvas.addEventListener("mousemove", (e) => this.describe(e));
  }

  draw(pool, requests) {
    this.codes = decodeRuns(pool.runs, pool.num_blocks);
    this.requests = requests;
    const n = Math.max(pool.num_blocks, 1);
    const width = this.canvas.clientWidth || 600;
    const cell = Math.max(1, Math.min(20, Math.floor(Math.sqrt((width * this.maxHeight) / n))));
    const cols = Math.max(1, Math.floor(width / cell));
    const height = Math.ceil(n / cols) * cell;
    const dpr = window.devicePixelRatio || 1;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    this.cell = cell;
    this.cols = cols;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const gap = cell >= 5 ? 1 : 0;
    const fills = requests.map((r) => [requestColor(r.id), requestColor(r.id, true)]);
    for (let b = 0; b < this.codes.length; b++) {
      const code = this.codes[b];
      const holder = code >>> 2;
      const shared = (code & 2) !== 0;
      const cached = (code & 1) !== 0;
      const x = (b % cols) * cell;
      const y = Math.floor(b / cols) * cell;
      const size = cell - gap;
      if (holder === 0) {
        ctx.fillStyle = cached ? KV_COLORS.freeCached : KV_COLORS.free;
      } else {
        // Too small for marks: a shared block is drawn lighter instead.
        ctx.fillStyle = fills[holder - 1][shared && cell < 6 ? 1 : 0];
      }
      ctx.fillRect(x, y, size, size);
      if (cell < 6) continue;
      if (shared) {
        const dot = Math.max(2, Math.floor(size / 3));
        ctx.fillStyle = "#ffffff";
        ctx.fillRect(x + (size - dot) / 2, y + (size - dot) / 2, dot, dot);
      }
      if (cached) {
        const t = Math.floor(size / 2);
        ctx.fillStyle = KV_COLORS.mark;
        ctx.beginPath();
        ctx.moveTo(x, y);
        ctx.lineTo(x + t, y);
        ctx.lineTo(x, y + t);
        ctx.fill();
      }
    }
  }

  describe(event) {
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / this.cell);
    const b = Math.floor((event.clientY - rect.top) / this.cell) * this.cols + col;
    if (col >= this.cols || b < 0 || b >= this.codes.length) {
      this.canvas.title = "";
      return;
    }
    const code = this.codes[b];
    const holder = code >>> 2;
    const parts = [`block ${b}`, holder ? this.requests[holder - 1].id : "free"];
    if (code & 2) parts.push("shared");
    if (code & 1) parts.push("prefix-cached");
    this.canvas.title = parts.join(" · ");
  }
}

class UsageChart {
  // GPU and CPU cache usage over the last minute, from this tab's own polls.
  constructor(canvas) {
    this.canvas = canvas;
    this.points = [];
  }

  add(view) {
    const now = performance.now();
    this.points.push([now, view.gpu_cache_usage, view.cpu_cache_usage]);
    while (this.points.length && this.points[0][0] < now - KV_HISTORY_MS) this.points.shift();
    this.draw(now);
  }

  draw(now) {
    const width = this.canvas.clientWidth || 600;
    const height = this.canvas.clientHeight || 64;
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    // The scale follows the data (a small model's few requests use a sliver of the cache), labelled at the top.
    let top = 0.02;
    for (const p of this.points) top = Math.max(top, p[1], p[2]);
    top = Math.min(1, top * 1.15);
    ctx.strokeStyle = "#eef0f3";
    ctx.lineWidth = 1;
    for (const f of [0.25, 0.5, 0.75]) {
      ctx.beginPath();
      ctx.moveTo(0, height * f);
      ctx.lineTo(width, height * f);
      ctx.stroke();
    }
    ctx.fillStyle = "#6b7280";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(`${(top * 100).toFixed(top < 0.1 ? 1 : 0)}%`, 4, 12);
    ctx.fillText("60 s ago", 4, height - 4);
    [
      [1, KV_COLORS.gpu],
      [2, KV_COLORS.cpu],
    ].forEach(([k, color]) => {
      ctx.strokeStyle = color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      this.points.forEach((p, i) => {
        const x = width - ((now - p[0]) / KV_HISTORY_MS) * width;
        const y = height - 2 - (p[k] / top) * (height - 4);
        if (i === 0) ctx.moveTo(x, y);
        else ctx.lineTo(x, y);
      });
      ctx.stroke();
    });
  }
}

class KVView {
  // api(path) -> fetch Response with the tab's API key; mine() -> the id prefix of this tab's request, or null.
  constructor(api, mine) {
    this.api = api;
    this.mine = mine;
    this.timer = null;
    this.inFlight = false;
    this.gpu = new BlockGrid(document.getElementById("kv-gpu"), 300);
    this.cpu = new BlockGrid(document.getElementById("kv-cpu"), 140);
    this.usage = new UsageChart(document.getElementById("kv-usage"));
    this.live = document.getElementById("kv-live");
    this.live.addEventListener("change", () => this.schedule(0));
    document.addEventListener("visibilitychange", () => this.schedule(0));
  }

  start() {
    this.schedule(0);
  }

  // Nobody watching (tab hidden, or live off): no polls, so the engine takes no snapshot.
  schedule(delay = KV_POLL_MS) {
    clearTimeout(this.timer);
    this.timer = null;
    if (!this.live.checked || document.hidden) return;
    this.timer = setTimeout(() => this.poll(), delay);
  }

  async poll() {
    if (this.inFlight) return;
    this.inFlight = true;
    let ok = false;
    try {
      const resp = await this.api("/kv-cache");
      if (resp.ok) {
        this.render(await resp.json());
        ok = true;
      }
    } catch (e) {
      // The server is gone or restarting: try again a little later.
    } finally {
      this.inFlight = false;
      if (ok) this.schedule();
      else if (this.live.checked) this.schedule(2000);
    }
  }

  render(view) {
    const set = (id, value) => {
      document.getElementById(id).textContent = String(value);
    };
    set("kv-running", view.num_running);
    set("kv-waiting", view.num_waiting);
    set("kv-swapped", view.num_swapped);
    set("kv-preemptions", view.num_preemptions);
    set("kv-block-size", `${view.block_size} tokens`);
    for (const [name, pool] of [
      ["gpu", view.gpu],
      ["cpu", view.cpu],
    ]) {
      set(`kv-${name}-held`, pool.num_blocks - pool.num_free);
      set(`kv-${name}-shared`, pool.num_shared);
      set(`kv-${name}-free`, pool.num_free);
      set(`kv-${name}-total`, pool.num_blocks);
    }
    set("kv-gpu-cached", view.gpu.num_cached);
    set(
      "kv-usage-now",
      `GPU ${(view.gpu_cache_usage * 100).toFixed(1)}% · CPU ${(view.cpu_cache_usage * 100).toFixed(1)}%`,
    );
    forgetHues(view.requests);
    this.usage.add(view);
    this.gpu.draw(view.gpu, view.requests);
    this.cpu.draw(view.cpu, view.requests);
    this.renderRequests(view.requests);
  }

  renderRequests(requests) {
    const body = document.querySelector("#kv-requests tbody");
    const mine = this.mine();
    const rows = requests.slice(0, 64).map((r) => {
      const tr = document.createElement("tr");
      if (mine && r.id.startsWith(mine)) tr.className = "mine";
      const swatch = document.createElement("i");
      swatch.className = "sw";
      swatch.style.background = requestColor(r.id);
      const where = r.cpu_blocks ? "swapped out" : "GPU";
      const cells = [swatch, r.id + (tr.className ? " (this tab)" : ""), r.gpu_blocks, r.cpu_blocks, where];
      cells.forEach((c, i) => {
        const td = document.createElement("td");
        if (i === 1) td.className = "id";
        if (c instanceof Node) td.append(c);
        else td.textContent = String(c);
        tr.append(td);
      });
      return tr;
    });
    if (!rows.length) {
      const td = document.createElement("td");
      td.colSpan = 5;
      td.className = "muted";
      td.textContent = "none";
      const tr = document.createElement("tr");
      tr.append(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }
}
