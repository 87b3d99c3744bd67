/* hybridlm report: draws the JSON in #report-data as SVG and HTML.
   Plain ECMAScript and DOM, no library, no network: the file stays readable offline. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("report-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var PHASES = { prefill: "#8c8c8c", decode: "#1f77b4", constrained: "#ff7f0e", external: "#d62728" };
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf"];
  var root = document.getElementById("report");
  var tip = document.getElementById("tip");

  // ------------------------------------------------------------------ DOM helpers
  function h(tag, attrs, parent, text) {
    var e = document.createElement(tag);
    setAttrs(e, attrs);
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function s(tag, attrs, parent, text) {
    var e = document.createElementNS(SVGNS, tag);
    setAttrs(e, attrs);
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function setAttrs(e, attrs) {
    for (var k in attrs || {}) if (attrs[k] !== null && attrs[k] !== undefined) e.setAttribute(k, attrs[k]);
  }
  function section(title, id) {
    var sec = h("section", { id: id }, root);
    h("h2", {}, sec, title);
    return sec;
  }
  function note(parent, text, cls) { return h("p", { class: cls || "note" }, parent, text); }

  // ------------------------------------------------------------------ numbers and text
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (!isNum(v)) return typeof v === "object" ? JSON.stringify(v) : String(v);
    if (Number.isInteger(v)) return String(v);
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return String(+v.toPrecision(4));
  }
  function secs(v) { return isNum(v) ? v.toFixed(3) + " s" : "—"; }
  function quoted(text) { return JSON.stringify(text); }
  function visible(text) {
    if (text === "") return "∅";
    return text.replace(/\t/g, "⇥").replace(/\n/g, "↵\n");
  }
  function maxOf(list, start) {
    var m = start;
    for (var i = 0; i < list.length; i++) if (isNum(list[i]) && list[i] > m) m = list[i];
    return m;
  }
  function phaseColor(p) {
    if (PHASES[p]) return PHASES[p];
    var hsh = 0;
    for (var i = 0; i < String(p).length; i++) hsh = (hsh * 31 + String(p).charCodeAt(i)) >>> 0;
    return PALETTE[hsh % PALETTE.length];
  }

  // ------------------------------------------------------------------ tooltip
  function showTip(ev, rows) {
    tip.textContent = "";
    rows.forEach(function (r) {
      var line = h("div", {}, tip);
      if (r[0]) h("b", {}, line, r[0] + " ");
      h("span", {}, line, r[1]);
    });
    tip.hidden = false;
    placeTip(ev);
  }
  function placeTip(ev) {
    var pad = 14, x = ev.clientX + pad, y = ev.clientY + pad;
    if (x + tip.offsetWidth > window.innerWidth) x = Math.max(0, ev.clientX - tip.offsetWidth - pad);
    if (y + tip.offsetHeight > window.innerHeight) y = Math.max(0, ev.clientY - tip.offsetHeight - pad);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.hidden = true; }
  function hover(el, rows, enter, leave) {
    el.addEventListener("mouseenter", function (ev) { showTip(ev, rows()); if (enter) enter(); });
    el.addEventListener("mousemove", placeTip);
    el.addEventListener("mouseleave", function () { hideTip(); if (leave) leave(); });
  }

  // ------------------------------------------------------------------ scales and axes
  function scale(d0, d1, r0, r1, log) {
    var f;
    if (log) {
      var l0 = Math.log10(d0), l1 = Math.log10(d1);
      f = function (v) { return r0 + (Math.log10(v) - l0) / ((l1 - l0) || 1) * (r1 - r0); };
      f.ticks = function () { return logTicks(d0, d1); };
    } else {
      f = function (v) { return r0 + (v - d0) / ((d1 - d0) || 1) * (r1 - r0); };
      f.ticks = function (n) { return niceTicks(d0, d1, n || 6); };
    }
    f.log = !!log;
    return f;
  }
  function niceTicks(a, b, n) {
    var span = (b - a) || 1, raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), err = raw / mag;
    var step = (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1) * mag, out = [];
    for (var v = Math.ceil(a / step) * step; v <= b + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function logTicks(a, b) {
    var out = [], e0 = Math.floor(Math.log10(a)), e1 = Math.ceil(Math.log10(b));
    var every = Math.max(1, Math.ceil((e1 - e0) / 8)), steps = e1 - e0 <= 2 ? [1, 2, 5] : [1];
    for (var e = e0; e <= e1; e += every) {
      steps.forEach(function (m) {
        var v = m * Math.pow(10, e);
        if (v >= a * 0.999 && v <= b * 1.001) out.push(v);
      });
    }
    return out.length >= 2 ? out : [a, b];
  }
  function extent(values, log, zero) {
    var lo = Infinity, hi = -Infinity;
    values.forEach(function (v) {
      if (isNum(v) && (!log || v > 0)) { if (v < lo) lo = v; if (v > hi) hi = v; }
    });
    if (lo === Infinity) return log ? [1e-3, 1] : [0, 1];
    if (zero && !log) lo = Math.min(lo, 0);
    if (lo === hi) return log ? [lo / 10, hi * 10] : [lo - (Math.abs(lo) || 1) * 0.5, hi + (Math.abs(hi) || 1) * 0.5];
    if (log) return [lo / Math.pow(hi / lo, 0.04), hi * Math.pow(hi / lo, 0.04)];
    var pad = (hi - lo) * 0.04;
    return [zero && lo === 0 ? 0 : lo - pad, hi + pad];
  }
  function tickText(v, log) {
    if (!log || (v >= 1e-3 && v < 1e5)) return fmt(v);
    var m = v / Math.pow(10, Math.floor(Math.log10(v)));
    return v.toExponential(Math.abs(m - Math.round(m)) < 1e-6 ? 0 : 1).replace("e+", "e");
  }
  function xAxis(g, x, y0, x0, x1, label, log, ticks) {
    s("line", { x1: x0, x2: x1, y1: y0, y2: y0, class: "axis" }, g);
    (ticks || x.ticks(8)).forEach(function (v) {
      s("line", { x1: x(v), x2: x(v), y1: y0, y2: y0 + 4, class: "axis" }, g);
      s("text", { x: x(v), y: y0 + 16, class: "tick", "text-anchor": "middle" }, g, tickText(v, log));
    });
    s("text", { x: (x0 + x1) / 2, y: y0 + 34, class: "label", "text-anchor": "middle" }, g, label);
  }
  function yAxis(g, y, xPos, yTop, yBot, label, log, right, ticks) {
    var d = right ? 1 : -1;
    s("line", { x1: xPos, x2: xPos, y1: yTop, y2: yBot, class: "axis" }, g);
    (ticks || y.ticks(5)).forEach(function (v) {
      s("line", { x1: xPos, x2: xPos + 4 * d, y1: y(v), y2: y(v), class: "axis" }, g);
      s("text", { x: xPos + 7 * d, y: y(v) + 4, class: "tick", "text-anchor": right ? "start" : "end" }, g,
        tickText(v, log));
    });
    var lx = xPos + (right ? 1 : -1) * (log ? 52 : 44), ly = (yTop + yBot) / 2;
    s("text", { x: lx, y: ly, class: "label", "text-anchor": "middle",
      transform: "rotate(" + (right ? 90 : -90) + " " + lx + " " + ly + ")" }, g, label);
  }
  function svgPoint(svg, ev) {
    var pt = svg.createSVGPoint();
    pt.x = ev.clientX;
    pt.y = ev.clientY;
    return pt.matrixTransform(svg.getScreenCTM().inverse());
  }
  function legend(parent, items) {
    var ul = h("ul", { class: "legend" }, parent);
    items.forEach(function (it) {
      var li = h("li", {}, ul);
      h("span", { class: "swatch" + (it.dash ? " dash" : ""), style: "background:" + it.color }, li);
      h("span", {}, li, it.name);
    });
    return ul;
  }

  // ------------------------------------------------------------------ the generic chart
  // spec: {id, title, xlabel, ylabel, xlog, ylog, ymin0, logToggle, height,
  //        series: [{name, x, y, lo, hi, labels, color, marks, line, hover, step, until}], vlines: [{x, label}],
  //        hlines: [{y, label}], bands: [{lo, hi, label}], spans: [{x0, x1, label}]}
  // A series with `step` is drawn as held steps (each value holds until the next x, the last until `until`).
  function chart(parent, spec) {
    var fig = h("figure", { class: "chart", id: spec.id }, parent);
    if (spec.title) h("figcaption", {}, fig, spec.title);
    var logY = !!spec.ylog, holder;
    if (spec.logToggle) {
      var lab = h("label", { class: "toggle" }, fig);
      var box = h("input", { type: "checkbox" }, lab);
      lab.appendChild(document.createTextNode(" logarithmic E axis"));
      box.addEventListener("change", function () { logY = box.checked; draw(); });
    }
    holder = h("div", {}, fig);
    function draw() { holder.textContent = ""; drawChart(holder, spec, logY); }
    draw();
    legend(fig, spec.series.filter(function (se) { return se.name; }).map(function (se, i) {
      return { name: se.name, color: se.color || PALETTE[i % PALETTE.length] };
    }));
    return fig;
  }
  function drawChart(holder, spec, logY) {
    var W = 900, H = spec.height || 320, m = { l: 72, r: 18, t: 12, b: 46 };
    var svg = s("svg", { viewBox: "0 0 " + W + " " + H, class: "plot" }, holder);
    var xs = [], ys = [];
    spec.series.forEach(function (se) {
      xs = xs.concat(se.x, se.step && isNum(se.until) ? [se.until] : []);
      ys = ys.concat(se.y, se.lo || [], se.hi || []);
    });
    (spec.vlines || []).forEach(function (v) { xs.push(v.x); });
    (spec.hlines || []).forEach(function (v) { ys.push(v.y); });
    (spec.bands || []).forEach(function (b) { ys.push(b.lo, b.hi); });
    var xe = extent(xs, spec.xlog, false), ye = extent(ys, logY, spec.ymin0);
    var x = scale(xe[0], xe[1], m.l, W - m.r, spec.xlog), y = scale(ye[0], ye[1], H - m.b, m.t, logY);
    var ok = function (v, log) { return isNum(v) && (!log || v > 0); };
    var g = s("g", {}, svg);
    // integer data (layers, depths, steps) gets integer ticks; a few depths on a log axis are their own ticks
    var distinct = xs.filter(function (v, i) { return isNum(v) && xs.indexOf(v) === i; }).sort(function (a, b) { return a - b; });
    var xticks = x.ticks(8);
    if (distinct.every(Number.isInteger)) {
      xticks = spec.xlog && distinct.length <= 12 ? distinct : xticks.filter(Number.isInteger);
    }
    xAxis(g, x, H - m.b, m.l, W - m.r, spec.xlabel || "", spec.xlog, xticks);
    var hidden = 0;
    spec.series.forEach(function (se) {
      se.x.forEach(function (xv, i) { if (isNum(xv) && isNum(se.y[i]) && !(ok(xv, spec.xlog) && ok(se.y[i], logY))) hidden++; });
    });
    if (hidden) s("text", { x: W - m.r, y: H - 4, class: "mark-label", "text-anchor": "end" }, svg,
      hidden + " value" + (hidden > 1 ? "s" : "") + " ≤ 0 not drawn on the logarithmic axis");
    yAxis(g, y, m.l, m.t, H - m.b, spec.ylabel || "", logY, false);
    y.ticks(5).forEach(function (v) { s("line", { x1: m.l, x2: W - m.r, y1: y(v), y2: y(v), class: "grid" }, g); });
    var clipId = "clip-" + Math.random().toString(36).slice(2);
    s("rect", { x: m.l, y: m.t, width: W - m.l - m.r, height: H - m.t - m.b }, s("clipPath", { id: clipId }, svg));
    var plot = s("g", { "clip-path": "url(#" + clipId + ")" }, svg);
    (spec.bands || []).forEach(function (b) {
      var lo = isNum(b.lo) ? b.lo : ye[0], hi = isNum(b.hi) ? b.hi : ye[1];
      if (!(ok(lo, logY) && ok(hi, logY))) return;
      s("rect", { x: m.l, width: W - m.l - m.r, y: y(Math.min(hi, ye[1])), height: Math.max(0, y(Math.max(lo, ye[0])) -
        y(Math.min(hi, ye[1]))), class: "safe-band" }, plot);
      if (b.label) s("text", { x: m.l + 4, y: y(Math.min(hi, ye[1])) + 12, class: "mark-label" }, plot, b.label);
    });
    (spec.spans || []).forEach(function (sp) {
      if (!(ok(sp.x0, spec.xlog) && ok(sp.x1, spec.xlog))) return;
      var r = s("rect", { x: x(sp.x0), width: Math.max(1, x(sp.x1) - x(sp.x0)), y: m.t, height: H - m.t - m.b,
        class: "span" }, plot);
      if (sp.label) s("title", {}, r, sp.label);
    });
    (spec.hlines || []).forEach(function (l) {
      if (!ok(l.y, logY)) return;
      s("line", { x1: m.l, x2: W - m.r, y1: y(l.y), y2: y(l.y), class: "hline" }, plot);
      s("text", { x: W - m.r - 4, y: y(l.y) - 4, class: "mark-label", "text-anchor": "end" }, plot, l.label || "");
    });
    (spec.vlines || []).forEach(function (l) {
      if (!ok(l.x, spec.xlog)) return;
      s("line", { x1: x(l.x), x2: x(l.x), y1: m.t, y2: H - m.b, class: "vline" }, plot);
      s("text", { x: x(l.x) + 3, y: m.t + 10, class: "mark-label" }, plot, l.label || "");
    });
    var points = [];
    spec.series.forEach(function (se, si) {
      var color = se.color || PALETTE[si % PALETTE.length];
      if (se.lo && se.hi) {
        var up = [], down = [];
        se.x.forEach(function (xv, i) {
          if (ok(xv, spec.xlog) && ok(se.lo[i], logY) && ok(se.hi[i], logY)) {
            up.push(x(xv) + "," + y(se.hi[i]));
            down.unshift(x(xv) + "," + y(se.lo[i]));
          }
        });
        if (up.length) s("path", { d: "M" + up.concat(down).join("L") + "Z", fill: color, class: "band" }, plot);
      }
      if (se.step) {
        var sd = "", last = null;
        se.x.forEach(function (xv, i) {
          if (!(ok(xv, spec.xlog) && ok(se.y[i], logY))) return;
          sd += last === null ? "M" + x(xv) + "," + y(se.y[i]) : "H" + x(xv) + "V" + y(se.y[i]);
          last = xv;
        });
        if (sd && isNum(se.until) && se.until > last) sd += "H" + x(se.until);
        if (sd) s("path", { d: sd, stroke: color, class: "line step" }, plot);
      } else if (se.line !== false) {
        var d = "", pen = false;
        se.x.forEach(function (xv, i) {
          if (ok(xv, spec.xlog) && ok(se.y[i], logY)) { d += (pen ? "L" : "M") + x(xv) + "," + y(se.y[i]); pen = true; }
          else pen = false;
        });
        if (d) s("path", { d: d, stroke: color, class: "line" + (se.hover === false ? " faint" : "") }, plot);
      }
      se.x.forEach(function (xv, i) {
        if (!(ok(xv, spec.xlog) && ok(se.y[i], logY))) return;
        if (se.marks) s("circle", { cx: x(xv), cy: y(se.y[i]), r: 3, fill: color, class: "pt" }, plot);
        if (se.hover !== false) points.push([x(xv), y(se.y[i]), si, i]);
      });
    });
    var focus = s("circle", { r: 5, class: "focus", visibility: "hidden" }, svg);
    var overlay = s("rect", { x: m.l, y: m.t, width: W - m.l - m.r, height: H - m.t - m.b, class: "overlay" }, svg);
    overlay.addEventListener("mousemove", function (ev) {
      var p = svgPoint(svg, ev), best = null, bd = 900;  // within 30 user units
      points.forEach(function (q) {
        var dd = (q[0] - p.x) * (q[0] - p.x) + (q[1] - p.y) * (q[1] - p.y);
        if (dd < bd) { bd = dd; best = q; }
      });
      if (!best) { hideTip(); focus.setAttribute("visibility", "hidden"); return; }
      var se = spec.series[best[2]], i = best[3];
      focus.setAttribute("cx", best[0]);
      focus.setAttribute("cy", best[1]);
      focus.setAttribute("visibility", "visible");
      var rows = [["", se.name || ""], [spec.xlabel || "x", fmt(se.x[i])], [spec.ylabel || "y", fmt(se.y[i])]];
      if (se.lo && se.hi) rows.push(["band", fmt(se.lo[i]) + " … " + fmt(se.hi[i])]);
      if (se.labels && se.labels[i]) rows.push(["", se.labels[i]]);
      showTip(ev, rows);
    });
    overlay.addEventListener("mouseleave", function () { hideTip(); focus.setAttribute("visibility", "hidden"); });
  }

  // ------------------------------------------------------------------ tables
  function table(parent, rows, cols) {
    if (!rows.length) return null;
    cols = cols || rows.reduce(function (acc, r) {
      Object.keys(r).forEach(function (k) { if (acc.indexOf(k) < 0) acc.push(k); });
      return acc;
    }, []);
    var wrap = h("div", { class: "table" }, parent), t = h("table", {}, wrap);
    var tr = h("tr", {}, h("thead", {}, t));
    cols.forEach(function (c) { h("th", {}, tr, c); });
    var body = h("tbody", {}, t);
    rows.forEach(function (r) {
      var row = h("tr", {}, body);
      cols.forEach(function (c) { cell(h("td", {}, row), r[c]); });
    });
    return t;
  }
  function cell(td, v) {
    if (v !== null && typeof v === "object") h("pre", {}, td, JSON.stringify(v, null, 1));
    else if (typeof v === "string" && (v.length > 60 || v.indexOf("\n") >= 0)) h("pre", {}, td, v);
    else td.textContent = fmt(v);
  }
  function facts(parent, pairs) {
    var dl = h("dl", { class: "facts" }, parent);
    pairs.forEach(function (p) {
      if (p[1] === undefined) return;
      h("dt", {}, dl, p[0]);
      var dd = h("dd", {}, dl);
      cell(dd, p[1]);
    });
    return dl;
  }

  // ------------------------------------------------------------------ the agent arc
  function tokenRows(D, i) {
    var T = D.tokens, rows = [["token", quoted(T.text[i])], ["id", fmt(T.id[i])],
      ["(t, k)", "(" + fmt(T.t[i]) + ", " + fmt(T.k[i]) + ")"], ["wall", secs(T.wall[i])], ["phase", T.phase[i]]];
    if (T.p && isNum(T.p[i])) rows.push(["p_θ(token), τ = 1", fmt(T.p[i])]);
    if (T.kernel_p && isNum(T.kernel_p[i])) rows.push(["kernel p(token)", fmt(T.kernel_p[i])]);
    if (T.entropy && isNum(T.entropy[i])) rows.push(["entropy", fmt(T.entropy[i]) + " nats"]);
    if (T.extra && T.extra[i]) Object.keys(T.extra[i]).forEach(function (k) { rows.push([k, fmt(T.extra[i][k])]); });
    if (D.states && i < D.states.norm.length) rows.push(["‖h‖", fmt(D.states.norm[i])]);
    return rows;
  }
  function jumpRows(j) {
    var rows = [["jump", "k = " + fmt(j.k) + " at t = " + fmt(j.t)], ["tool", j.tool + "(" + JSON.stringify(j.arguments) + ")"],
      ["observation", String(j.observation).slice(0, 300)], ["duration", secs(j.duration_s)], ["at wall", secs(j.wall_s)]];
    if (j.error) rows.push(["error", j.error]);
    return rows;
  }
  function highlight(i, on) {
    document.querySelectorAll('[data-i="' + i + '"]').forEach(function (e) { e.classList.toggle("hl", on); });
  }

  function kernelText(k) {
    if (!k || typeof k !== "object") return undefined;
    var parts = [k.greedy ? "greedy" : isNum(k.temperature) ? "τ = " + k.temperature : null];
    if (!k.greedy) {
      if (k.top_k) parts.push("top-k " + k.top_k);
      if (k.top_p) parts.push("top-p " + k.top_p);
      if (k.min_p) parts.push("min-p " + k.min_p);
    }
    if (isNum(k.repeat_penalty) && k.repeat_penalty !== 1 && k.repeat_last_n !== 0)
      parts.push("repeat penalty " + k.repeat_penalty + " over " + (k.repeat_last_n === -1 ? "the context" :
        "the last " + (isNum(k.repeat_last_n) ? k.repeat_last_n : 64) + " tokens"));
    if (k.frequency_penalty) parts.push("frequency penalty " + k.frequency_penalty);
    if (k.presence_penalty) parts.push("presence penalty " + k.presence_penalty);
    if (Array.isArray(k.logit_bias) && k.logit_bias.length) parts.push("logit bias on " + k.logit_bias.length + " tokens");
    parts = parts.filter(function (p) { return p; });
    return parts.length ? parts.join(", ") : undefined;
  }
  function plantFacts(P) {
    var out = [];
    P.plants.forEach(function (p) {
      var sf = p.safe, who = P.plants.length > 1 ? " (" + p.name + ")" : "";
      if (!sf) return;
      var span = sf.to - sf.from, total = 0, longest = 0;
      sf.violations.forEach(function (v) { total += v.duration_s; longest = Math.max(longest, v.duration_s); });
      out.push(["time in band" + who, (isNum(sf.fraction) ? (100 * sf.fraction).toFixed(1) + " % of " : "") +
        fmt(+span.toFixed(3)) + " s of plant time (" + fmt(+sf.in_band_s.toFixed(3)) + " s)"]);
      out.push(["violations" + who, sf.left + (sf.violations.length ? ", outside the band " + fmt(+total.toFixed(3)) +
        " s in all, longest " + fmt(+longest.toFixed(3)) + " s" : "") +
        (sf.violations.length && !sf.violations[0].left ? " (outside from the start)" : "")]);
    });
    return out;
  }

  function renderArc(D) {
    var st = D.start || {}, end = D.end || {}, T = D.tokens;
    h("h1", {}, root, "Hybrid arc");
    if (st.task !== undefined) h("p", { class: "task" }, root, st.task);
    D.problems.forEach(function (p) { note(root, p, "problem"); });
    (D.sampled || []).forEach(function (p) { note(root, p, "sampled"); });
    var totals = D.totals || { token_steps: T.t.length, jumps: D.jumps.length };
    facts(root, [
      ["model", st.model], ["kernel", kernelText(st.kernel)],
      ["limits", st.limits && typeof st.limits === "object" ? st.limits.max_token_steps + " token steps, " + st.limits.max_jumps + " jumps (" +
        st.limits.max_jumps_per_step + " per token step)" : undefined], ["tool choice", st.tool_choice], ["seed", st.seed],
      ["tools", Array.isArray(st.tools) ? st.tools.map(function (t) { return t && t.name; }).join(", ") : undefined],
      ["answer", end.answer], ["termination", end.stop_reason],
      ["token steps", totals.token_steps], ["jumps", totals.jumps],
      ["wall q_G / q_E", end.wall_generate_s !== undefined ? secs(end.wall_generate_s) + " / " + secs(end.wall_external_s) : undefined],
      ["wall total", D.wall_curve.length ? secs(D.wall_curve[D.wall_curve.length - 1][1]) : undefined],
      ["rates", D.rates || undefined],
    ].concat(D.plant ? plantFacts(D.plant) : []));
    domain(section("Hybrid time domain", "domain"), D);
    wallBar(section("Wall clock", "wall"), D);
    tokenText(section("Tokens", "tokens"), D);
    var js = section("Jumps", "jumps");
    if (!D.jumps.length) note(js, "No jump: the arc stayed in the flow set.");
    table(js, D.jumps.map(function (j) {
      return { k: j.k, t: j.t, tool: j.tool, arguments: j.arguments, observation: j.observation, error: j.error,
        "duration (s)": j.duration_s, "wall at return (s)": j.wall_s, other: j.extra };
    }));
    if (D.controllers.length || D.controls.length) control(section("Control", "control"), D);
    if (D.states) states(section("Final-layer states", "states"), D);
    if (D.plant) plant(section("Plant", "plant"), D);
    if (D.marks.length) {
      var es = section("Engine events", "engine");
      note(es, "batch: the sequence left or joined the engine's batch; context: a context-horizon jump (Π_T); " +
        "rewrite: the jump map wrote the calling turn as the chat template writes it (ρ).");
      table(es, D.marks.map(function (e) { return { event: e.event, t: e.t, k: e.k, "wall (s)": e.wall_s, fields: e.fields }; }));
    }
    if (D.unknown.length || D.extra_fields.length) {
      var us = section("Other events and fields", "unknown");
      note(us, "Recorded in the trace but not drawn by this version of the report.");
      table(us, D.unknown.map(function (u) { return { event: u.event, count: u.count, examples: u.examples.join("\n") }; }));
      table(us, D.extra_fields);
    }
  }

  function domain(sec, D) {
    var T = D.tokens, n = T.t.length;
    note(sec, "The hybrid time domain as HyEQ draws it: flow intervals along the token clock t at height k, each " +
      "jump a step of k (dashed). One dot per token step, coloured by phase; the thin line is the wall clock " +
      "(right axis), which rises at fixed t while a prefill or a tool runs.");
    var tMax = Math.max(1, maxOf(T.t, 0), maxOf(D.wall_curve.map(function (p) { return p[0]; }), 0));
    var K = Math.max(maxOf(T.k, 0), maxOf(D.jumps.map(function (j) { return j.k; }), 0),
      maxOf(D.phases.map(function (p) { return p.k; }), 0));
    var wMax = Math.max(1e-6, maxOf(D.wall_curve.map(function (p) { return p[1]; }), 0));
    var W = 900, H = Math.min(440, Math.max(240, 150 + 45 * (K + 1))), m = { l: 56, r: 70, t: 16, b: 46 };
    var svg = s("svg", { viewBox: "0 0 " + W + " " + H, class: "plot", id: "domain-plot" }, sec);
    var x = scale(0, tMax, m.l, W - m.r), y = scale(-0.5, K + 0.5, H - m.b, m.t), yw = scale(0, wMax * 1.03, H - m.b, m.t);
    var g = s("g", {}, svg), kt = [];
    for (var kk = 0; kk <= K; kk += Math.max(1, Math.ceil(K / 10))) kt.push(kk);
    kt.forEach(function (v) { s("line", { x1: m.l, x2: W - m.r, y1: y(v), y2: y(v), class: "grid" }, g); });
    xAxis(g, x, H - m.b, m.l, W - m.r, "token step t", false);
    yAxis(g, y, m.l, m.t, H - m.b, "jump k", false, false, kt);
    yAxis(g, yw, W - m.r, m.t, H - m.b, "wall time (s)", false, true);
    // the wall clock: segment i-1 → i belongs to the phase in effect after event i-1; one path per run of a phase
    var wc = D.wall_curve, wg = s("g", { class: "wall-curve" }, svg);
    for (var a0 = 0; a0 < wc.length - 1; ) {
      var b0 = a0 + 1;
      while (b0 < wc.length - 1 && wc[b0][2] === wc[a0][2]) b0++;
      s("path", { d: "M" + wc.slice(a0, b0 + 1).map(function (p) { return x(p[0]) + "," + yw(p[1]); }).join("L"),
        stroke: phaseColor(wc[a0][2] || "?"), class: "wall-line" }, wg);
      a0 = b0;
    }
    // flow intervals: runs of token steps at one k and one phase
    var fg = s("g", { class: "flow" }, svg);
    for (var a = 0; a < n; ) {
      var b = a;
      while (b + 1 < n && T.k[b + 1] === T.k[a] && T.phase[b + 1] === T.phase[a] && T.t[b + 1] === T.t[b] + 1) b++;
      s("line", { x1: x(T.t[a] - 1), x2: x(T.t[b]), y1: y(T.k[a]), y2: y(T.k[a]), stroke: phaseColor(T.phase[a]),
        class: "flow-interval" }, fg);
      a = b + 1;
    }
    // phases that take wall time but no token step (prefill): a diamond at (t, k)
    D.phases.forEach(function (p) {
      if (p.phase === "external" || p.t1 > p.t0) return;
      var cx = x(p.t0), cy = y(p.k);
      var dm = s("path", { d: "M" + (cx - 6) + "," + cy + "l6,-6l6,6l-6,6z", fill: phaseColor(p.phase), class: "phase-mark" }, svg);
      hover(dm, function () {
        return [["phase", p.phase + (p.tokens ? " of " + p.tokens + " tokens" : "")], ["(t, k)", "(" + p.t0 + ", " + p.k + ")"],
          ["wall", secs(p.wall0) + " → " + secs(p.wall1) + " (" + secs(p.wall1 - p.wall0) + ")"]];
      });
    });
    // jumps: k − 1 → k at t_k
    var jg = s("g", { class: "jumps" }, svg);
    D.jumps.forEach(function (j) {
      var mark = s("g", { class: "jump-mark", "data-k": j.k }, jg), jx = x(j.t), y0 = y(j.k - 1), y1 = y(j.k);
      s("line", { x1: jx, x2: jx, y1: y0, y2: y1 + 6, class: "jump-line" + (j.error ? " error" : "") }, mark);
      s("path", { d: "M" + (jx - 5) + "," + (y1 + 8) + "l5,-8l5,8z", class: "jump-head" + (j.error ? " error" : "") }, mark);
      s("line", { x1: jx, x2: jx, y1: y0, y2: y1, class: "hit" }, mark);
      hover(mark, function () { return jumpRows(j); });
    });
    // engine marks and control actions
    D.marks.forEach(function (e) {
      var mk;
      if (e.event === "context" || e.event === "rewrite") {
        mk = s("g", { class: "context-mark" }, svg);
        s("line", { x1: x(e.t), x2: x(e.t), y1: m.t, y2: H - m.b, class: "context-line" }, mk);
        s("text", { x: x(e.t) + 3, y: H - m.b - 4, class: "mark-label" }, mk, e.event === "context" ? "Π_T" : "ρ");
      } else {
        mk = s("path", { d: "M" + (x(e.t) - 5) + "," + (H - m.b) + "l5,-9l5,9z", class: "batch-mark" }, svg);
      }
      hover(mk, function () {
        return [["event", e.event], ["(t, k)", "(" + e.t + ", " + e.k + ")"], ["wall", secs(e.wall_s)],
          ["fields", JSON.stringify(e.fields)]];
      });
    });
    D.controls.forEach(function (c) {
      var mk = s("rect", { x: x(c.t) - 1.5, y: m.t, width: 3, height: 8, class: "control-mark" + (c.no_safe_token ? " empty" : "") }, svg);
      hover(mk, function () {
        return Object.keys(c).map(function (k2) { return [k2, fmt(c[k2])]; });
      });
    });
    // one dot per token step
    var tg = s("g", { class: "token-marks" }, svg);
    for (var ti = 0; ti < n; ti++) (function (i) {
      var dot = s("circle", { cx: x(T.t[i]), cy: y(T.k[i]), r: n > 600 ? 1.6 : 3, fill: phaseColor(T.phase[i]),
        class: "token-mark", "data-i": i }, tg);
      hover(dot, function () { return tokenRows(D, i); }, function () { highlight(i, true); }, function () { highlight(i, false); });
    })(ti);
    var seen = [];
    D.phases.forEach(function (p) { if (seen.indexOf(p.phase) < 0) seen.push(p.phase); });
    T.phase.forEach(function (p) { if (seen.indexOf(p) < 0) seen.push(p); });
    legend(sec, seen.map(function (p) { return { name: p, color: phaseColor(p) }; }).concat(
      [{ name: "jump (k → k + 1)", color: PHASES.external, dash: true }]));
  }

  function wallBar(sec, D) {
    var P = D.phases;
    if (!P.length) { note(sec, "No phase events."); return; }
    note(sec, "Where the wall time went: each phase as a bar along wall time, with the token steps it bought.");
    var end = Math.max(1e-6, maxOf(P.map(function (p) { return p.wall1; }), 0));
    var W = 900, H = 70, m = { l: 56, r: 70 };
    var svg = s("svg", { viewBox: "0 0 " + W + " " + H, class: "plot", id: "wall-plot" }, sec);
    var x = scale(0, end, m.l, W - m.r);
    P.forEach(function (p) {
      var r = s("rect", { x: x(p.wall0), y: 6, width: Math.max(0.5, x(p.wall1) - x(p.wall0)), height: 22,
        fill: phaseColor(p.phase), class: "phase-bar" }, svg);
      hover(r, function () {
        var dt = p.wall1 - p.wall0, rows = [["phase", p.phase + " (" + (p.mode || "?") + ")"], ["k", fmt(p.k)],
          ["wall", secs(p.wall0) + " → " + secs(p.wall1) + " (" + secs(dt) + ")"], ["t", fmt(p.t0) + " → " + fmt(p.t1)]];
        if (p.tokens) rows.push(["tokens in", fmt(p.tokens) + (dt > 0 ? " (" + fmt(p.tokens / dt) + " tok/s)" : "")]);
        if (p.steps) rows.push(["token steps", fmt(p.steps) + (dt > 0 ? " (" + fmt(p.steps / dt) + " tok/s)" : "")]);
        return rows;
      });
    });
    D.jumps.forEach(function (j) {
      s("line", { x1: x(j.wall_s), x2: x(j.wall_s), y1: 2, y2: 32, class: "jump-tick" }, svg);
    });
    xAxis(s("g", {}, svg), x, 32, m.l, W - m.r, "wall time (s)", false);
  }

  function tokenText(sec, D) {
    var T = D.tokens, modes = ["phase"];
    if (T.p) modes.push("probability");
    if (T.kernel_p) modes.push("kernel probability");
    if (T.entropy) modes.push("entropy");
    if (!T.p && !T.kernel_p && !T.entropy) note(sec, "Hover a token for its step, phase and wall time (this trace " +
      "records no per-token probability or entropy).");
    else {
      var lab = h("label", { class: "toggle" }, sec, "colour by ");
      var sel = h("select", { id: "colour-by" }, lab);
      modes.forEach(function (mo) { h("option", { value: mo }, sel, mo); });
      sel.addEventListener("change", function () { paint(sel.value); });
    }
    var box = h("div", { class: "token-text", id: "token-text" }, sec);
    var items = [];
    T.t.forEach(function (t, i) { items.push([T.wall[i], 1, i, "token"]); });
    D.phases.forEach(function (p, i) { if (p.phase === "prefill") items.push([p.wall0, 0, i, "prefill"]); });
    D.jumps.forEach(function (j, i) { items.push([j.wall_s, 0, i, "jump"]); });
    items.sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; });
    var spans = [];
    items.forEach(function (it) {
      if (it[3] === "token") {
        var i = it[2], sp = h("span", { class: "tok", "data-i": i }, box, visible(T.text[i]));
        spans.push([sp, i]);
        hover(sp, function () { return tokenRows(D, i); }, function () { highlight(i, true); }, function () { highlight(i, false); });
      } else if (it[3] === "prefill") {
        var p = D.phases[it[2]];
        var c = h("span", { class: "chip prefill-chip" }, box, "prefill " + (p.tokens ? p.tokens + " tokens" : "") +
          " · " + secs(p.wall1 - p.wall0));
        hover(c, function () { return [["phase", "prefill at (t, k) = (" + p.t0 + ", " + p.k + ")"], ["tokens", fmt(p.tokens)]]; });
      } else {
        var j = D.jumps[it[2]];
        var jc = h("span", { class: "chip jump-chip" + (j.error ? " error" : "") }, box,
          "jump " + j.k + ": " + j.tool + "(" + JSON.stringify(j.arguments) + ") → " + String(j.observation).slice(0, 80));
        hover(jc, function () { return jumpRows(j); });
      }
    });
    function paint(mode) {
      spans.forEach(function (e) {
        var sp = e[0], i = e[1], bg;
        if (mode === "probability" && T.p) bg = ramp(isNum(T.p[i]) ? 1 - T.p[i] : null);
        else if (mode === "kernel probability" && T.kernel_p) bg = ramp(isNum(T.kernel_p[i]) ? 1 - T.kernel_p[i] : null);
        else if (mode === "entropy" && T.entropy) bg = ramp(isNum(T.entropy[i]) ? Math.min(1, T.entropy[i] / 5) : null);
        else bg = phaseColor(T.phase[i]) + "33";
        sp.style.background = bg;
        sp.style.borderBottomColor = phaseColor(T.phase[i]);
      });
    }
    paint("phase");
    if (T.p || T.kernel_p || T.entropy) note(sec, "probability: the model's own p_θ(token) at τ = 1, before any " +
      "input; kernel probability: p(token) under the kernel that drew it (1 under greedy decoding); darker = less " +
      "likely. entropy: darker = more uncertain (5 nats = darkest).");
    if (T.p || T.kernel_p) logprobChart(sec, D);
  }
  function logprobChart(sec, D) {
    var T = D.tokens, series = [], labels = T.text.map(function (t, i) { return quoted(t) + " · " + T.phase[i]; });
    function logs(p) { return p.map(function (v) { return isNum(v) && v > 0 ? Math.log(v) : null; }); }
    if (T.p) series.push({ name: "log p_θ(token) at τ = 1 (the model)", x: T.t, y: logs(T.p), labels: labels,
      color: "#1f77b4", marks: T.t.length <= 400, line: false });
    if (T.kernel_p) series.push({ name: "log p(token) under the kernel that drew it", x: T.t, y: logs(T.kernel_p),
      labels: labels, color: "#ff7f0e", marks: T.t.length <= 400, line: false });
    chart(sec, { id: "token-logprob", title: "log-probability of each token: the model's beside the kernel's",
      xlabel: "token step t", ylabel: "log p", height: 220, series: series });
  }
  function ramp(v) { return v === null ? "#eee" : "rgba(148, 40, 140, " + (0.08 + 0.7 * v).toFixed(3) + ")"; }

  function control(sec, D) {
    if (D.controllers.length) {
      h("h3", {}, sec, "Controllers (configured at the start)");
      table(sec, D.controllers);
    }
    if (!D.controls.length) { note(sec, "No control action was recorded at any token step."); return; }
    h("h3", {}, sec, "Actions per token step");
    var withMass = D.controls.filter(function (c) { return isNum(c.removed_mass); });
    if (withMass.length) chart(sec, { id: "removed-mass", title: "probability mass removed by the controllers",
      xlabel: "token step t", ylabel: "removed mass", ymin0: true, height: 220,
      series: [{ name: "removed mass", x: withMass.map(function (c) { return c.t; }),
        y: withMass.map(function (c) { return c.removed_mass; }),
        labels: withMass.map(function (c) { return c.controller + (c.no_safe_token ? ": no safe token → " + c.action : ""); }),
        marks: true, line: false }] });
    table(sec, D.controls);
  }

  function states(sec, D) {
    var S = D.states, T = D.tokens, n = S.norm.length;
    note(sec, S.rows + " rows of the final-layer residual state h⁽ᴸ⁾ (d = " + S.dim + "), one per token step.");
    if (S.note) note(sec, S.note, "problem");
    var labels = [];
    for (var i = 0; i < n; i++) labels.push(quoted(T.text[i] !== undefined ? T.text[i] : "") + " · " + (T.phase[i] || ""));
    chart(sec, { id: "state-norm", title: "‖h⁽ᴸ⁾‖ per token step", xlabel: "token step t", ylabel: "‖h‖", height: 240,
      series: [{ name: "‖h⁽ᴸ⁾_t‖", x: T.t.slice(0, n), y: S.norm, labels: labels, marks: n <= 2000 }] });
    var byPhase = {}, order = [];
    for (i = 0; i < n; i++) {
      var p = T.phase[i] || "?";
      if (!byPhase[p]) { byPhase[p] = { name: p, x: [], y: [], labels: [], color: phaseColor(p), marks: true, line: false }; order.push(p); }
      byPhase[p].x.push(S.pca[i][0]);
      byPhase[p].y.push(S.pca[i][1]);
      byPhase[p].labels.push("t = " + T.t[i] + " · " + quoted(T.text[i] !== undefined ? T.text[i] : ""));
    }
    var path = { name: "order in t", x: S.pca.map(function (q) { return q[0]; }), y: S.pca.map(function (q) { return q[1]; }),
      color: "#ccc", hover: false };
    chart(sec, { id: "state-pca", title: "the states on their two principal axes, in token order",
      xlabel: "PC1 (" + (100 * S.explained[0]).toFixed(1) + " % of variance)",
      ylabel: "PC2 (" + (100 * S.explained[1]).toFixed(1) + " % of variance)", height: 380,
      series: [path].concat(order.map(function (p) { return byPhase[p]; })) });
  }

  function plant(sec, D) {
    D.plant.plants.forEach(function (p, pi) {
      var vl = p.jumps.map(function (j) { return { x: j.time, label: "jump " + j.k + (j.tool ? ": " + j.tool : "") }; });
      var names = Object.keys(p.state), unit = function (c) { return p.units[c] ? c + " (" + p.units[c] + ")" : c; };
      var bands = [];
      names.forEach(function (c) {
        var b = p.bands[c];
        if (Array.isArray(b) && (isNum(b[0]) || isNum(b[1])))
          bands.push({ lo: b[0], hi: b[1], label: "safe band of " + c + ": " + (isNum(b[0]) ? fmt(b[0]) : "−∞") + " … " +
            (isNum(b[1]) ? fmt(b[1]) : "∞") + (p.units[c] ? " " + p.units[c] : "") });
      });
      var series = names.map(function (c) { return { name: unit(c), x: p.time, y: p.state[c], marks: p.time.length <= 400 }; });
      var spans = p.safe ? p.safe.violations.map(function (v) {
        return { x0: v.start, x1: v.end, label: "outside the safe set " + fmt(v.start) + " … " + fmt(v.end) + " s" };
      }) : [];
      chart(sec, { id: "plant-" + pi, title: p.name + ": state against plant time" + (bands.length ? ", the safe band shaded" : "") +
        (spans.length ? ", time outside it red" : "") + ", jumps marked", xlabel: "plant time (s)",
        ylabel: names.length === 1 ? unit(names[0]) : "state", series: series, vlines: vl, bands: bands, spans: spans });
      var held = p.held, us = Object.keys(held.u).map(function (c) {
        return { name: c + " (held)", x: held.time, y: held.u[c], step: true, until: held.until, marks: held.time.length <= 400 };
      });
      Object.keys(p.applied.u).forEach(function (c) {
        us.push({ name: c + " applied by the safety filter", x: p.applied.time, y: p.applied.u[c], marks: true, line: false });
      });
      if (us.length) chart(sec, { id: "plant-u-" + pi, title: p.name + ": input u against plant time, each command held " +
        "until the next", xlabel: "plant time (s)", ylabel: "u", series: us, vlines: vl, height: 220 });
    });
  }

  // ------------------------------------------------------------------ analysis runs
  function renderConsensus(D) {
    h("h1", {}, root, D.title);
    var sec = section("E(k)", "consensus");
    note(sec, "E(k) = 1 − (1/m) Σ_i cos(z_1(k), z_i(k)) over the m tokens at layer-step k (survey eq. 0.45); " +
      "dashed lines mark the end of each pass through the blocks. Hover for the values.");
    D.charts.forEach(function (c) { chart(sec, c); });
    D.tables.forEach(function (t) { h("h3", {}, sec, t.title); table(sec, t.rows); });
  }
  function renderSurvey(D) {
    h("h1", {}, root, D.title);
    D.runs.forEach(function (r) {
      var sec = section(r.name, "run-" + r.name.replace(/[^A-Za-z0-9_-]/g, "-"));
      r.charts.forEach(function (c) { chart(sec, c); });
      table(sec, Object.keys(r.scalars).map(function (k) { return { quantity: k, value: r.scalars[k] }; }));
    });
  }

  ({ arc: renderArc, consensus: renderConsensus, survey: renderSurvey })[DATA.kind](DATA);
  var foot = h("footer", {}, document.body, (DATA.meta && DATA.meta.generator ? DATA.meta.generator + " · " : "") +
    "a self-contained file: no network, no library");
  foot.id = "footer";
  document.body.setAttribute("data-rendered", "1");
})();
