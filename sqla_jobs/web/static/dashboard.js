// Draws the overview's charts from /api/series with uPlot and redraws them every refresh.
// One chart per series name; one line per label (queue name or kind). No build step.
(function () {
  "use strict";
  var root = document.getElementById("charts");
  if (!root || typeof uPlot === "undefined") { return; }
  var colours = ["#1d3557", "#e63946", "#2a9d8f", "#f4a261", "#6d597a", "#457b9d", "#8ab17d", "#b5838d"];
  var plots = {};
  var axis = { from: null, to: null };  // the time axis of the latest data: the chosen window, ending now
  root.plots = plots;  // for the browser tests

  function iso(seconds) { return new Date(seconds * 1000).toISOString().slice(0, 19) + "Z"; }
  // The axis ticks in UTC too, not in the browser's time zone.
  function utc(seconds) { return uPlot.tzDate(new Date(seconds * 1000), "Etc/UTC"); }
  // Ticks as the hour and minute of that format (24-hour, UTC), not uPlot's "8:20pm 12/3/26".
  function ticks(u, splits) { return splits.map(function (v) { return iso(v).slice(11, 16); }); }

  function draw(data) {
    axis.from = data.from; axis.to = data.to;
    root.querySelectorAll(".chart").forEach(function (el) {
      var name = el.getAttribute("data-series");
      var lines = (data.series || {})[name] || {};
      var labels = Object.keys(lines).sort();
      if (!data.times.length || !labels.length) {
        if (plots[name]) { plots[name].destroy(); delete plots[name]; }
        el.innerHTML = '<div class="empty">no samples yet</div>';
        return;
      }
      var columns = [data.times].concat(labels.map(function (l) { return lines[l]; }));
      var key = labels.join("\u0000");
      if (plots[name] && plots[name].key === key) { plots[name].setData(columns); return; }
      if (plots[name]) { plots[name].destroy(); }
      el.textContent = "";
      // The time column as every page writes a moment (sqla_jobs.web._format): ISO-8601 to the second, UTC.
      var series = [{ label: "time (UTC)", value: function (u, v) { return v == null ? "-" : iso(v); } }]
        .concat(labels.map(function (l, i) {
        // A null value is a period without samples: drawn as a gap, not a straight line across it.
        return { label: l || name, stroke: colours[i % colours.length], width: 2, spanGaps: false };
      }));
      var plot = new uPlot({ width: Math.max(300, el.clientWidth), height: 200, series: series, tzDate: utc,
                             axes: [{ values: ticks }, { size: 60 }], scales: {
                               x: { time: true, range: function (u, min, max) {
                                 return axis.from === null ? [min, max] : [axis.from, axis.to]; } },
                               y: { range: function (u, min, max) { return [0, Math.max(1, max * 1.1)]; } } } },
                           columns, el);
      plot.key = key;
      plots[name] = plot;
    });
  }

  function load() {
    fetch(root.getAttribute("data-series"), { credentials: "same-origin" })
      .then(function (r) { return r.json(); }).then(draw)
      .catch(function () { /* the next refresh tries again */ });
  }

  load();
  setInterval(load, Math.max(5, parseFloat(root.getAttribute("data-refresh")) || 5) * 1000);
})();
