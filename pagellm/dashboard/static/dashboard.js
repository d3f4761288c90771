// pagellm dashboard: draws a KV view (GET /stats/blocks, pagellm/core/kv_view.py) as a block
// map per pool, with a legend, the requests' colours and charts of the history. No build step,
// no dependencies. live() polls a server; report() shows views embedded in a static page.
"use strict";
const PagellmDashboard = (() => {
  // Paul Tol's muted palette: told apart by the common forms of colour blindness.
  const PALETTE = ["#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE", "#882255",
                   "#44AA99", "#999933", "#AA4499"];
  const POLL_MS = 500;  // at most two views a second per open page
  const SHARED_MARK = "repeating-linear-gradient(45deg, rgba(255,255,255,.6) 0 1.5px, " +
                      "transparent 1.5px 4px)";

  function colourOf(requestId) {
    let h = 0;
    for (const ch of String(requestId)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
    return PALETTE[h % PALETTE.length];
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child);
    return node;
  }

  const pct = (x) => (100 * x).toFixed(1) + "%";

  // ---------------------------------------------------------------- block map
  function ensureCells(grid, n) {
    if (grid.children.length === n) return;
    grid.replaceChildren();
    const cols = n > 4096 ? 128 : n >= 512 ? 64 : 32;
    grid.style.setProperty("--cols", Math.min(cols, Math.max(n, 1)));
    if (n > 4096) grid.style.setProperty("--cell", "6px");
    const frag = document.createDocumentFragment();
    for (let i = 0; i < n; i++) frag.append(el("div", {class: "block", "data-block": i}));
    grid.append(frag);
  }

  function drawPool(grid, pool, view, stranded) {
    const n = pool.state.length;
    ensureCells(grid, n);
    grid._pool = pool;
    grid._view = view;
    for (let i = 0; i < n; i++) {
      const cell = grid.children[i];
      const state = view.states[pool.state[i]];
      const owners = pool.owners[i];
      let cls = "block " + state;
      if (pool.ref_cnt[i] > 1) cls += " shared";
      if (pool.cached[i]) cls += " cached";
      if (stranded && stranded.has(i)) cls += " stranded";
      let background = "";
      let requests = "";
      if (owners.length) {
        const ids = [...new Set(owners.map((o) => view.sequences[o].request_id))];
        requests = ids.join(" ");
        const colour = colourOf(ids[0]);
        const filled = (100 * pool.fill[i] / view.block_size).toFixed(0);
        background = `linear-gradient(to top, ${colour} ${filled}%, ${colour}4d ${filled}%)`;
        if (pool.ref_cnt[i] > 1) background = SHARED_MARK + ", " + background;
      }
      if (cell.className !== cls) cell.className = cls;
      if (cell._bg !== background) { cell.style.backgroundImage = background; cell._bg = background; }
      if (requests) cell.dataset.requests = requests; else delete cell.dataset.requests;
    }
  }

  function describeBlock(grid, i) {
    const pool = grid._pool, view = grid._view;
    const lines = [`${grid.dataset.pool} block ${i}: ${view.states[pool.state[i]].replace("_", "-")}`,
                   `ref count ${pool.ref_cnt[i]}`,
                   `tokens ${pool.fill[i]} / ${view.block_size}`];
    if (pool.cached[i]) lines.push("prefix-cached (reusable by a later prompt)");
    const owners = pool.owners[i];
    for (const o of owners.slice(0, 8)) {
      const seq = view.sequences[o];
      lines.push(`request ${seq.request_id}  (sequence ${seq.seq_id}, ${seq.status}, ` +
                 `${seq.num_tokens} tokens)`);
    }
    if (owners.length > 8) lines.push(`… and ${owners.length - 8} more sequences`);
    return lines.join("\n");
  }

  let tooltip = null;
  function installTooltip() {
    if (tooltip) return;
    tooltip = el("div", {id: "tooltip", hidden: ""});
    document.body.append(tooltip);
    document.addEventListener("mouseover", (event) => {
      const cell = event.target.closest && event.target.closest(".grid .block");
      if (!cell) { tooltip.hidden = true; return; }
      tooltip.textContent = describeBlock(cell.parentElement, Number(cell.dataset.block));
      tooltip.hidden = false;
    });
    document.addEventListener("mousemove", (event) => {
      tooltip.style.left = event.clientX + 14 + "px";
      tooltip.style.top = event.clientY + 14 + "px";
    });
  }

  function legend() {
    const item = (cls, style, text) => {
      const swatch = el("span", {class: "block " + cls});
      if (style) swatch.style.backgroundImage = style;
      return el("span", {}, swatch, text);
    };
    const c = PALETTE[0];
    return el("div", {class: "legend"},
      item("used", `linear-gradient(${c}, ${c})`, "held by a request (colour)"),
      item("used", `linear-gradient(to top, ${c} 40%, ${c}4d 40%)`, "partly filled (pale part empty)"),
      item("used shared", `${SHARED_MARK}, linear-gradient(${c}, ${c})`,
           "shared, ref count > 1 (stripes, black edge)"),
      item("used cached", `linear-gradient(${c}, ${c})`, "prefix-cached (dot)"),
      item("cached_free cached", "", "free, still cached"),
      item("free", "", "free"),
      item("free stranded", "", "free, too short for a reservation"));
  }

  function summary(view) {
    const s = view.stats;
    const used = view.blocks.state.filter((x) => x === 1).length;
    const cachedFree = view.blocks.state.filter((x) => x === 2).length;
    const cpuUsed = view.cpu_blocks.state.filter((x) => x === 1).length;
    return `${view.num_blocks} blocks of ${view.block_size} tokens (${view.kind}) · ` +
      `used ${used} (${pct(used / Math.max(view.num_blocks, 1))}) · cached-free ${cachedFree} · ` +
      `waste ${pct(s.kv_waste_ratio)} · running ${s.num_running} · waiting ${s.num_waiting} · ` +
      `swapped ${s.num_swapped} (${cpuUsed} of ${view.num_cpu_blocks} CPU blocks) · ` +
      `preemptions ${s.num_preemptions} · prefix hits ${pct(s.prefix_hit_rate)}`;
  }

  function requestList(view) {
    const counts = new Map();
    for (const owners of view.blocks.owners) {
      for (const o of new Set(owners.map((x) => view.sequences[x].request_id))) {
        counts.set(o, (counts.get(o) || 0) + 1);
      }
    }
    const list = el("div", {class: "requests"});
    const top = [...counts.entries()].sort((a, b) => b[1] - a[1]).slice(0, 48);
    for (const [rid, n] of top) {
      const swatch = el("span", {class: "block used"});
      swatch.style.backgroundImage = `linear-gradient(${colourOf(rid)}, ${colourOf(rid)})`;
      list.append(el("span", {}, swatch, `${rid} · ${n}`));
    }
    if (counts.size > top.length) list.append(el("span", {text: `… ${counts.size - top.length} more`}));
    return list;
  }

  // ---------------------------------------------------------------- charts
  const SVG = "http://www.w3.org/2000/svg";
  function chart(title, series, points, yMax, marker) {
    const w = 300, h = 100, pad = 4;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("width", w); svg.setAttribute("height", h);
    svg.setAttribute("role", "img"); svg.setAttribute("aria-label", title);
    const t0 = points.length ? points[0].t : 0;
    const span = points.length ? Math.max(points[points.length - 1].t - t0, 1e-9) : 1;
    const top = yMax || Math.max(1, ...series.flatMap((s) => points.map((p) => p[s.key])));
    const x = (t) => pad + (w - 2 * pad) * (t - t0) / span;
    const y = (v) => h - pad - (h - 2 * pad) * v / top;
    for (const s of series) {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", points.map((p) => `${x(p.t).toFixed(1)},${y(p[s.key]).toFixed(1)}`).join(" "));
      line.setAttribute("fill", "none"); line.setAttribute("stroke", s.colour);
      line.setAttribute("stroke-width", "1.8");
      if (s.dash) line.setAttribute("stroke-dasharray", s.dash);
      svg.append(line);
    }
    if (marker !== undefined && points.length) {
      const m = document.createElementNS(SVG, "line");
      m.setAttribute("x1", x(marker)); m.setAttribute("x2", x(marker));
      m.setAttribute("y1", 0); m.setAttribute("y2", h); m.setAttribute("stroke", "#000");
      m.setAttribute("stroke-dasharray", "2 2");
      svg.append(m);
    }
    const key = el("div", {class: "key"});
    for (const s of series) {
      const sample = el("span", {text: s.dash ? "╌╌ " : "── "});
      sample.style.color = s.colour;
      key.append(el("span", {}, sample, s.label));
    }
    const head = `${title} (max ${Number(top.toFixed ? top.toFixed(2) : top)}, ` +
                 `last ${span.toFixed(0)} s)`;
    return el("div", {class: "chart"}, el("div", {text: head}), svg, key);
  }

  function charts(history, marker) {
    const [c1, c2, c3] = ["#332288", "#CC6677", "#117733"];
    return el("div", {class: "charts"},
      chart("KV usage and waste", [{key: "kv_usage", label: "usage", colour: c1},
                                   {key: "kv_waste_ratio", label: "waste", colour: c2, dash: "5 3"}],
            history, 1, marker),
      chart("requests", [{key: "num_running", label: "running", colour: c1},
                         {key: "num_waiting", label: "waiting", colour: c2, dash: "5 3"},
                         {key: "num_swapped", label: "swapped", colour: c3, dash: "1 2"}],
            history, 0, marker),
      chart("preemptions (total)", [{key: "num_preemptions", label: "preemptions", colour: c2}],
            history, 0, marker),
      chart("prefix hit rate", [{key: "prefix_hit_rate", label: "hit rate", colour: c3}],
            history, 1, marker));
  }

  // ---------------------------------------------------------------- one view
  function renderView(root, view, history, marker) {
    if (!root._parts) {
      const parts = {summary: el("div", {class: "summary"}), requests: el("div"),
                     device: el("div", {class: "grid", "data-pool": "device"}),
                     cpu: el("div", {class: "grid", "data-pool": "CPU"}), charts: el("div")};
      root.append(parts.summary, legend(),
        el("div", {class: "pools"},
           el("div", {}, el("h3", {text: "device blocks"}), parts.device),
           el("div", {}, el("h3", {text: "CPU swap blocks"}), parts.cpu)),
        el("h3", {text: "requests holding the most device blocks"}), parts.requests,
        el("h3", {text: "over time"}), parts.charts);
      root._parts = parts;
      installTooltip();
    }
    const parts = root._parts;
    parts.summary.textContent = summary(view);
    drawPool(parts.device, view.blocks, view, new Set(view.stranded_blocks || []));
    drawPool(parts.cpu, view.cpu_blocks, view, null);
    parts.requests.replaceChildren(requestList(view));
    parts.charts.replaceChildren(charts(history || view.history, marker));
    root.dataset.rendered = String((Number(root.dataset.rendered) || 0) + 1);
  }

  // ---------------------------------------------------------------- live and static pages
  function live(root, url) {
    const status = document.getElementById("status");
    const form = document.getElementById("auth");
    let key = sessionStorage.getItem("pagellm-api-key") || "";
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      key = document.getElementById("api-key").value;
      sessionStorage.setItem("pagellm-api-key", key);
      form.hidden = true;
    });
    async function poll() {
      if (!document.hidden) {
        try {
          const headers = key ? {Authorization: `Bearer ${key}`} : {};
          const response = await fetch(url, {headers, cache: "no-store"});
          if (response.status === 401) {
            form.hidden = false;
            status.textContent = "needs the server's API key";
          } else if (!response.ok) {
            status.textContent = `error: HTTP ${response.status}`;
          } else {
            renderView(root, await response.json());
            status.textContent = `live · ${new Date().toLocaleTimeString()}`;
          }
        } catch (err) {
          status.textContent = `server unreachable (${err.message})`;
        }
      }
      setTimeout(poll, POLL_MS);
    }
    poll();
  }

  function report(root, systems) {
    for (const system of systems) {
      const section = el("section", {class: "system", "data-system": system.name});
      const body = el("div");
      section.append(el("h2", {text: system.title || system.name}));
      if (system.description) section.append(el("p", {text: system.description}));
      const frames = system.frames;
      const show = (i) => renderView(body, frames[i], system.history, frames[i].time);
      if (frames.length > 1) {
        const slider = el("input", {type: "range", min: 0, max: frames.length - 1,
                                    value: system.default_frame || 0,
                                    "aria-label": `${system.name}: moment of the run`});
        const label = el("span");
        slider.addEventListener("input", () => {
          show(Number(slider.value));
          label.textContent = ` t = ${frames[slider.value].time.toFixed(2)} s`;
        });
        section.append(el("div", {class: "frames"}, "moment of the run: ", slider, label));
        label.textContent = ` t = ${frames[slider.value].time.toFixed(2)} s`;
      }
      section.append(body);
      root.append(section);
      show(Number(system.default_frame || 0));
    }
  }

  return {live, report, renderView, colourOf};
})();
