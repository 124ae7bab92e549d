// tether's live page: polls /ui/state and draws it. Plain JS, no library.
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const every = Math.max(1, Number(params.get("refresh")) || 2);
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const num = (n) => (n == null ? "-" : Number(n).toLocaleString("en-US"));
  const pct = (x) => (x == null ? "-" : Math.round(x * 100) + "%");
  const secs = (s) => (s == null ? "-" : s < 1 ? Math.round(s * 1000) + " ms" : s < 120 ? s.toFixed(s < 10 ? 2 : 1) + " s" : Math.round(s / 60) + " min");
  let refreshes = 0;
  let hist = []; // the samples so far: each refresh asks only for the new ones
  const keepMs = 15 * 60 * 1000;
  $("every").textContent = every;

  function bar(x) {
    if (x == null) return "-";
    const p = Math.max(0, Math.min(1, x));
    const cls = p >= 0.95 ? "bar full" : p >= 0.8 ? "bar hi" : "bar";
    return `<span class="${cls}" title="${pct(p)}"><i style="width:${(p * 100).toFixed(1)}%"></i></span> ${pct(p)}`;
  }

  function card(label, value, extra) {
    return `<div class="card"><small>${esc(label)}</small><b>${value}</b>${extra ? `<small>${extra}</small>` : ""}</div>`;
  }

  function renderFleet(st) {
    const f = st.fleet;
    let h = "";
    if (f) {
      const phase = `<span class="badge st-${esc(f.phase)}" id="fleet-phase" data-phase="${esc(f.phase)}">${esc(f.phase)}</span>`;
      h += card("phase", phase, (f.mode ? esc(f.mode) + " · " : "") + "for " + secs(f.phase_since_s));
      h += card("held now", `<span id="fleet-held">${num(f.held)}</span>`, `${num(f.released_total)} released · ${num(f.hold_timeouts_total)} timed out · ${num(f.hold_full_total)} refused`);
      h += card("target version", esc(f.target_version || "none set"), "epoch " + num(f.epoch));
      h += card("pauses", num(f.pauses_total), f.cluster_link === "down" ? '<span class="fail">cluster store out of sight: holding</span>' : "");
    }
    h += card("workers", `${num(st.healthy)} / ${num(st.total)} healthy`, st.panic ? '<span class="fail">panic: every worker unhealthy</span>' : "");
    $("fleet").innerHTML = h;
  }

  function decisions(d) {
    if (!d) return "";
    return Object.keys(d).filter((k) => d[k] > 0).sort().map((k) => `${esc(k)}=${num(d[k])}`).join(" ");
  }

  function renderWorkers(st) {
    const rows = st.workers.map((w) => {
      const e = w.engine || null;
      const kind = e ? e.kind : "-";
      const runwait = e && e.signals ? `${num(e.running)} / ${num(e.waiting)}` : "-";
      const ver = w.weight_version || (e && e.weight_version) || "-";
      return `<tr class="worker" data-slot="${w.slot}" data-state="${esc(w.view)}">` +
        `<td class="num">${w.slot}</td><td class="url" title="${esc(w.url)}">${esc(w.url)}</td><td>${esc(w.role)}</td><td>${esc(kind)}</td>` +
        `<td><span class="badge st-${esc(w.view)}">${esc(w.view)}</span>${w.reason ? `<span class="reason">${esc(w.reason)}</span>` : ""}</td>` +
        `<td>${esc(ver)}</td><td>${e ? bar(e.kv_usage) : "-"}</td><td class="num">${runwait}</td><td class="num">${e ? pct(e.prefix_hit_rate) : "-"}</td>` +
        `<td class="num">${num(w.in_flight)}</td><td class="num">${num(w.run_requests)} / ${num(w.requests)}</td>` +
        `<td class="dec">${decisions(w.decisions)}</td><td class="num">${w.pinned == null ? "-" : num(w.pinned)}</td></tr>`;
    });
    document.querySelector("#workers tbody").innerHTML = rows.join("") || '<tr><td colspan="13" class="note">no worker</td></tr>';
    const count = {};
    st.workers.forEach((w) => { count[w.view] = (count[w.view] || 0) + 1; });
    $("workers-note").textContent = Object.keys(count).sort().map((k) => `${count[k]} ${k}`).join(" · ");
  }

  function renderSyncs(st) {
    if (!st.syncs.length) { $("syncs").innerHTML = '<p class="note">no weight sync through this tetherd yet</p>'; return; }
    $("syncs").innerHTML = st.syncs.map((s) => {
      const t0 = new Date(s.start).getTime();
      const end = s.steps.reduce((m, x) => Math.max(m, new Date(x.start).getTime() + x.duration_s * 1000), t0);
      const span = Math.max(end - t0, 1);
      const segs = s.steps.map((x) => {
        const w = Math.max(0.5, (x.duration_s * 1000 / span) * 100);
        return `<span class="k-${esc(x.kind)}${x.failed ? " k-failed" : ""}" style="width:${w.toFixed(2)}%" title="${esc(x.kind)} ${secs(x.duration_s)}"></span>`;
      }).join("");
      const rows = s.steps.map((x) => {
        const eng = (x.engines || []).map((c) => `<span class="${c.error ? "fail" : ""}">${c.slot}:${secs(c.duration_s)}${c.error ? " " + esc(c.error) : ""}</span>`).join(" ");
        let what = "";
        if (x.kind === "quiesce") what = `${esc(x.mode)}, ${num(x.abort_waves)} abort waves${x.quiet === false ? `, <span class="fail">${num(x.still_running)} workers still running</span>` : ", quiet"}`;
        if (x.kind === "pause") what = `held ${num(x.held)}`;
        if (x.kind === "resume") what = `released ${num(x.released)}${x.fenced && x.fenced.length ? `, fenced ${x.fenced.join(",")}` : ""}`;
        if (x.kind === "update") what = (x.version ? "version " + esc(x.version) : "") + (x.fenced && x.fenced.length ? `, fenced ${x.fenced.join(",")}` : "");
        return `<tr class="step" data-kind="${esc(x.kind)}"><td><span class="badge k-${esc(x.kind)}">${esc(x.kind)}</span></td><td>${esc(x.path)}</td><td class="num">${secs(x.duration_s)}</td>` +
          `<td class="num">${x.status}</td><td>${what}</td><td class="${x.failed ? "fail" : ""}">${x.failed ? x.failed + " failed" : ""}</td><td class="dec">${eng}</td></tr>`;
      }).join("");
      const state = s.open ? "open" : "done in " + secs(span / 1000);
      return `<div class="sync${s.failed ? " failed" : ""}" data-sync="${s.id}"><b>sync ${s.id}</b> <small>${esc(new Date(s.start).toLocaleTimeString())} · ${state} · held peak ${num(s.held_peak)} · ${s.failed ? `<span class="fail">${s.failed} engine calls failed</span>` : "no failure"}${s.dropped_steps ? ` · ${s.dropped_steps} more steps` : ""}</small>` +
        `<div class="timeline">${segs}</div><table class="steps"><tbody>${rows}</tbody></table></div>`;
    }).join("");
  }

  function renderListeners(st) {
    const rows = st.listeners.map((l) => `<tr class="listener" data-slot="${l.slot}"><td class="num">${l.slot}</td><td class="num">${num(l.active)}</td><td class="num">${num(l.accepted)}</td><td class="num">${num(l.closed)}</td>` +
      `<td class="num">${l.steered ? num(l.selected) : "-"}</td><td class="num">${l.steered ? num(l.migrated) : "-"}</td><td>${bar(l.share)}</td></tr>`);
    document.querySelector("#listeners tbody").innerHTML = rows.join("");
    const steered = st.listeners.some((l) => l.steered);
    let note = steered ? "share: new connections the BPF program steered to each listener" : "no BPF steering: share of connections accepted (the kernel's hash)";
    if (st.listeners.length > 1) {
      const sh = st.listeners.map((l) => l.share);
      note += ` · spread ${pct(Math.min(...sh))}–${pct(Math.max(...sh))} (even: ${pct(1 / st.listeners.length)})`;
    }
    $("steering-note").textContent = note;
  }

  function renderCluster(st) {
    const c = st.cluster;
    $("cluster-section").hidden = !c;
    if (!c) return;
    $("cluster").innerHTML = card("cluster", esc(c.name || ""), "link " + (c.up ? "up" : '<span class="fail">down</span>')) +
      card("workers in etcd", num(c.workers), "revision " + num(c.revision)) + card("this replica", esc(st.instance_id), "shows the cluster's table and its own traffic");
  }

  const palette = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#c62828", "#00838f", "#5d4037", "#ad1457"];
  const NS = "http://www.w3.org/2000/svg";
  function chart(el, series, opts) {
    const W = 300, H = 110, L = 34, B = 14;
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    let tmin = Infinity, tmax = -Infinity, ymax = opts.ymax || 0;
    series.forEach((s) => s.pts.forEach(([t, y]) => { tmin = Math.min(tmin, t); tmax = Math.max(tmax, t); if (!opts.ymax) ymax = Math.max(ymax, y); }));
    if (!isFinite(tmin)) {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", 10); t.setAttribute("y", 55); t.setAttribute("class", "axis"); t.textContent = "no samples yet";
      svg.appendChild(t); el.replaceChildren(svg); return;
    }
    if (ymax <= 0) ymax = 1;
    const tspan = Math.max(tmax - tmin, 1);
    const x = (t) => L + ((t - tmin) / tspan) * (W - L - 4);
    const y = (v) => 4 + (1 - v / ymax) * (H - B - 8);
    [[0, "0"], [ymax, opts.fmt(ymax)]].forEach(([v, lab]) => {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", 2); t.setAttribute("y", y(v) + 3); t.setAttribute("class", "axis"); t.textContent = lab; svg.appendChild(t);
      const g = document.createElementNS(NS, "line");
      g.setAttribute("x1", L); g.setAttribute("x2", W); g.setAttribute("y1", y(v)); g.setAttribute("y2", y(v)); g.setAttribute("stroke", "#e0e0e0"); svg.appendChild(g);
    });
    const tl = document.createElementNS(NS, "text");
    tl.setAttribute("x", L); tl.setAttribute("y", H - 2); tl.setAttribute("class", "axis"); tl.textContent = "-" + Math.round(tspan / 60000) + " min";
    svg.appendChild(tl);
    series.forEach((s, i) => {
      if (!s.pts.length) return;
      const p = document.createElementNS(NS, "polyline");
      p.setAttribute("points", s.pts.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" "));
      p.setAttribute("fill", "none"); p.setAttribute("stroke", palette[i % palette.length]); p.setAttribute("stroke-width", "1.3");
      p.setAttribute("vector-effect", "non-scaling-stroke");
      const title = document.createElementNS(NS, "title"); title.textContent = s.name; p.appendChild(title);
      svg.appendChild(p);
    });
    el.replaceChildren(svg);
  }

  function renderCharts(st) {
    hist = hist.concat(st.history.map((p) => ({ t: new Date(p.t).getTime(), p })));
    const now = new Date(st.now).getTime();
    hist = hist.filter((x) => now - x.t <= keepMs);
    const h = hist;
    chart($("chart-rps"), [{ name: "requests/s", pts: h.map(({ t, p }) => [t, p.rps]) }], { fmt: (v) => v.toFixed(v < 10 ? 1 : 0) });
    chart($("chart-held"), [{ name: "held", pts: h.map(({ t, p }) => [t, p.held]) }], { fmt: (v) => String(Math.round(v)) });
    const bySlot = new Map();
    h.forEach(({ t, p }) => (p.kv || []).forEach((k) => { if (!bySlot.has(k.slot)) bySlot.set(k.slot, []); bySlot.get(k.slot).push([t, k.kv]); }));
    chart($("chart-kv"), [...bySlot.entries()].map(([slot, pts]) => ({ name: "slot " + slot, pts })), { ymax: 1, fmt: (v) => pct(v) });
  }

  function render(st) {
    $("instance").textContent = st.instance_id ? "instance " + st.instance_id : "";
    const up = st.started ? (new Date(st.now) - new Date(st.started)) / 1000 : null;
    $("summary").textContent = up != null ? "up " + secs(up) : "";
    renderFleet(st); renderWorkers(st); renderSyncs(st); renderListeners(st); renderCluster(st); renderCharts(st);
    refreshes++;
    document.body.dataset.seq = st.seq;
    document.body.dataset.refreshes = refreshes;
    $("seq").textContent = st.seq;
  }

  async function tick() {
    try {
      const since = hist.length ? "?since=" + encodeURIComponent(hist[hist.length - 1].p.t) : "";
      const r = await fetch("/ui/state" + since, { credentials: "same-origin", cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      $("status").textContent = "live " + new Date().toLocaleTimeString();
      $("status").className = "status ok";
    } catch (e) {
      $("status").textContent = "not updated: " + e.message;
      $("status").className = "status err";
    }
    setTimeout(tick, every * 1000);
  }
  tick();
})();
