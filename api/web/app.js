// ringmaster's web view: jobs, a job's live curves (server-sent events), the queue with the tenants' fair share,
// planning and submitting. Plain JS, no build
// step; charts are uPlot (vendored beside this file). The API token stays in this browser tab's sessionStorage.
"use strict";

const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const STATES = ["QUEUED", "ADMITTED", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED"];
const view = document.getElementById("view");
let leaving = [];  // what the current page must stop (its stream, its timers) when another is shown

// -- the token and the API ----------------------------------------------------------------------------------------

const token = () => sessionStorage.getItem("ringmaster-token") || "";

class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
  }
}

async function api(method, path, body, contentType) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  if (body !== undefined) headers["Content-Type"] = contentType || "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined
    : contentType ? body : JSON.stringify(body) });
  const text = await response.text();
  const data = response.headers.get("content-type")?.startsWith("application/json") && text ? JSON.parse(text) : text;
  if (!response.ok) throw new ApiError(response.status, data && data.detail !== undefined ? data.detail : data);
  return data;
}

function explain(error) {
  if (error.status === 401) return "The API refused the token (or none is set): enter a token above.";
  if (error.status === 422 && Array.isArray(error.detail)) {
    return error.detail.map(item => `${(item.loc || []).slice(1).join(".") || "(spec)"}: ${item.msg}`).join("\n");
  }
  return error.message || String(error);
}

// Server-sent events over fetch (EventSource cannot send the Authorization header); resumes with Last-Event-ID.
function stream(path, onMessage, onEnd) {
  const controller = new AbortController();
  let lastId = null;
  let stopped = false;
  (async () => {
    for (let failures = 0; !stopped && failures < 6;) {
      try {
        const headers = { Accept: "text/event-stream" };
        if (token()) headers.Authorization = `Bearer ${token()}`;
        if (lastId) headers["Last-Event-ID"] = lastId;
        const response = await fetch(path, { headers, signal: controller.signal });
        if (!response.ok) throw new ApiError(response.status, await response.text());
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            const fields = {};
            for (const line of block.split("\n")) {
              if (!line || line.startsWith(":")) continue;
              const colon = line.indexOf(":");
              fields[line.slice(0, colon)] = line.slice(colon + 1).replace(/^ /, "");
            }
            if (fields.data !== undefined) {
              lastId = fields.id || lastId;
              failures = 0;
              onMessage(fields.event || "message", JSON.parse(fields.data));
            }
          }
        }
        break;  // the server ends the stream once the job is over
      } catch (error) {
        if (stopped || error.name === "AbortError" || error.status) { if (error.status) onEnd(error); return; }
        failures += 1;
        await new Promise(resolve => setTimeout(resolve, 500 * failures));
      }
    }
    if (!stopped) onEnd(null);
  })();
  return () => { stopped = true; controller.abort(); };
}

// -- small DOM helpers ----------------------------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
}

const stateCell = state => el("span", { class: `state state-${state}` }, state);
const when = iso => (iso ? iso.slice(0, 19).replace("T", " ") : "");
const link = (href, text) => el("a", { href }, text);
// A job's error in one line for the list: the exception a traceback ends in (the user's code raised), else its first
// line (a reason ringmaster wrote: the job's input, a driver that never started, a recovery limit).
const reason = error => {
  if (!error) return "";
  const lines = error.split("\n").map(line => line.trim()).filter(Boolean);
  return error.includes("Traceback (most recent call last):") ? lines[lines.length - 1] : lines[0];
};

function duration(seconds) {
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(s % 60).padStart(2, "0")}s`;
}

function show(...children) {
  for (const stop of leaving) stop();
  leaving = [];
  view.replaceChildren(...children);
}

function failure(error) {
  return el("p", { class: "error", id: "error" }, explain(error));
}

// -- pages ----------------------------------------------------------------------------------------------------------

async function jobsPage() {
  const params = new URLSearchParams(location.search);
  const filter = el("select", { id: "state-filter", onchange: () => navigate(`/ui${filter.value ? `?state=${filter.value}` : ""}`) },
    el("option", { value: "" }, "all states"), STATES.map(state => el("option", { value: state }, state)));
  filter.value = params.get("state") || "";
  const body = el("tbody");
  const table = el("table", { id: "jobs" },
    el("thead", {}, el("tr", {}, ["id", "name", "tenant", "state", "attempt", "created", "finished", "reason"].map(h => el("th", {}, h)))), body);
  const status = el("p", { class: "muted" });
  show(el("h1", {}, "Jobs"), el("div", { class: "toolbar" }, "Show ", filter), table, status);
  const refresh = async () => {
    try {
      const page = await api("GET", `/v1/jobs?limit=200${filter.value ? `&state=${filter.value}` : ""}`);
      body.replaceChildren(...page.items.map(job => el("tr", { "data-job-id": job.id },
        el("td", { class: "mono" }, link(`/ui/jobs/${job.id}`, job.id.slice(0, 12))), el("td", {}, job.name),
        el("td", {}, job.tenant), el("td", {}, stateCell(job.state)), el("td", {}, String(job.attempt)),
        el("td", {}, when(job.created_at)), el("td", {}, when(job.finished_at)),
        el("td", { class: "reason", title: job.error || "" }, reason(job.error)))));
      status.textContent = `${page.total} job(s)`;
    } catch (error) {
      status.replaceChildren(failure(error));
    }
  };
  await refresh();
  const timer = setInterval(refresh, 5000);  // one small request every 5 s; a job's own page streams instead
  leaving.push(() => clearInterval(timer));
}

function chart(title, series, id, options = {}) {
  // series: [{label, stroke, points}]; the x axis is the step. points: dots at the values, for a sparse series (a
  // validation loss every few hundred steps), where a lone value draws no line. options.yValue: the y axis's labels
  // (uPlot's default rounds a learning rate's 0.0008 and 0.001 to the same "0.001").
  const box = el("div", { class: "chart", id, "data-points": "0" }, el("div", { class: "title" }, title));
  const data = [[], ...series.map(() => [])];
  const plot = new uPlot({
    width: 540, height: 210, scales: { x: { time: false } },
    series: [{ label: "step" }, ...series.map(s => ({ label: s.label, stroke: s.stroke, width: 1.5, spanGaps: true,
      paths: options.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined,
      points: s.points ? { show: true, size: 6, fill: s.stroke } : undefined }))],
    axes: [{ label: "step" }, options.yValue ? { values: (u, splits) => splits.map(options.yValue), size: 60 } : {}],
    hooks: options.marks ? { draw: [u => drawMarks(u, options.marks())] } : {},
  }, data, box);
  return {
    box,
    add(step, values) {
      // Steps arrive in order per attempt; a resumed attempt replays steps it redoes: keep the newest value of each.
      let index = data[0].length;
      while (index > 0 && data[0][index - 1] >= step) index -= 1;
      if (index < data[0].length && data[0][index] === step) values.forEach((v, i) => { data[i + 1][index] = v; });
      else { data[0].splice(index, 0, step); values.forEach((v, i) => data[i + 1].splice(index, 0, v)); }
    },
    redraw() {
      plot.setData(data);
      box.dataset.points = String(data[0].length);
    },
  };
}

function drawMarks(u, steps) {
  // Recoveries: a dashed red line at the step the group was re-formed after.
  const { ctx } = u;
  ctx.save();
  ctx.strokeStyle = "#c0392b";
  ctx.setLineDash([4, 3]);
  for (const step of steps) {
    const x = u.valToPos(step, "x", true);
    ctx.beginPath();
    ctx.moveTo(x, u.bbox.top);
    ctx.lineTo(x, u.bbox.top + u.bbox.height);
    ctx.stroke();
  }
  ctx.restore();
}

async function jobPage(jobId) {
  let job;
  try {
    job = await api("GET", `/v1/jobs/${jobId}`);
  } catch (error) {
    show(el("h1", {}, "Job"), failure(error));
    return;
  }
  const recoveries = [];
  let lastStep = 0;
  const charts = {
    loss: chart("Loss", [{ label: "loss", stroke: "#3056d3" }, { label: "validation loss", stroke: "#e67e22", points: true }],
      "chart-loss"),
    speed: chart("Samples/s", [{ label: "samples/s", stroke: "#1e8e3e" }], "chart-speed"),
    lr: chart("Learning rate", [{ label: "lr", stroke: "#8e44ad" }], "chart-lr", { yValue: v => v.toExponential(1) }),
    norm: chart("Gradient norm", [{ label: "grad norm", stroke: "#16a085" }], "chart-grad-norm"),
    world: chart("World size (red: recoveries)", [{ label: "workers", stroke: "#34495e" }], "chart-world-size",
      { stepped: true, marks: () => recoveries }),
  };
  const chartsBox = el("div", { class: "charts" }, Object.values(charts).map(c => c.box));
  // The metrics of the user's own that the model's loss_fn returns beside its loss: a chart each, added as its name
  // first arrives (in charts too, so that every redraw covers it), with its value over the validation set (val_<name>)
  // as the loss chart has val_loss.
  const userChart = name => {
    const key = `user:${name}`;
    if (!charts[key]) {
      charts[key] = chart(name, [{ label: name, stroke: "#2c3e50" },
        { label: `validation ${name}`, stroke: "#e67e22", points: true }], `chart-user-${name}`);
      chartsBox.append(charts[key].box);
    }
    return charts[key];
  };
  const addUserMetrics = (step, metrics) => {  // [value, validation value] by chart, so neither blanks the other
    const byChart = {};
    for (const [name, value] of Object.entries(metrics || {})) {
      const validation = name.startsWith("val_");
      (byChart[validation ? name.slice(4) : name] ||= [null, null])[validation ? 1 : 0] = value;
    }
    for (const [name, values] of Object.entries(byChart)) userChart(name).add(step, values);
  };
  const facts = el("div", { class: "facts", id: "facts" });
  const events = el("tbody", { id: "events" });
  const checkpoints = el("tbody", { id: "checkpoints" });
  const log = el("pre", { class: "log", id: "log" }, "…");
  const cancel = el("button", { id: "cancel", onclick: async () => {
    try { await api("POST", `/v1/jobs/${jobId}/cancel`); } catch (error) { alert(explain(error)); }
  } }, "Cancel job");
  const links = el("p", { id: "links" });
  show(
    el("h1", {}, `${job.name} `, el("span", { class: "muted mono" }, job.id)),
    facts, links, chartsBox,
    el("h2", {}, "Events"), el("table", {}, el("thead", {}, el("tr", {}, ["at", "state", "message"].map(h => el("th", {}, h)))), events),
    el("h2", {}, "Checkpoints"),
    el("table", {}, el("thead", {}, el("tr", {}, ["step", "world size", "final", "uri"].map(h => el("th", {}, h)))), checkpoints),
    el("h2", {}, "Driver log (tail)"), log, cancel,
  );

  const renderFacts = () => {
    const p = job.progress;
    facts.replaceChildren(
      el("span", {}, el("b", {}, "state "), stateCell(job.state)),
      el("span", {}, el("b", {}, "step "), p.total_steps == null ? String(p.step) : `${p.step}/${p.total_steps}`),
      el("span", {}, el("b", {}, "loss "), p.loss == null ? "-" : p.loss.toFixed(4)),
      el("span", {}, el("b", {}, "val loss "), p.val_loss == null ? "-" : `${p.val_loss.toFixed(4)} (step ${p.val_step})`),
      el("span", {}, el("b", {}, "world size "), p.world_size == null ? "-" : String(p.world_size)),
      el("span", {}, el("b", {}, "recoveries "), String(p.recoveries)),
      el("span", {}, el("b", {}, "ETA "), p.eta_s == null ? "-" : duration(p.eta_s)),
      el("span", {}, el("b", {}, "attempt "), String(job.attempt)),
      el("span", {}, el("b", {}, "tenant "), job.tenant),
    );
    // A traceback keeps its lines and columns: monospace, as the driver's log shows it.
    if (job.error) facts.append(el("pre", { class: "error" }, job.error));
    cancel.hidden = TERMINAL.has(job.state);
    links.replaceChildren(...(job.dashboard_url ? [link(job.dashboard_url, "This attempt in the Ray dashboard")] : []));
  };
  renderFacts();

  const loadCheckpoints = async () => {
    const page = await api("GET", `/v1/jobs/${jobId}/checkpoints`);
    checkpoints.replaceChildren(...page.items.map(c => el("tr", {},
      el("td", {}, String(c.step)), el("td", {}, String(c.world_size)), el("td", {}, c.final ? "yes" : ""),
      el("td", { class: "mono" }, c.uri))));
  };
  const loadLog = async () => {
    try {
      const text = await api("GET", `/v1/jobs/${jobId}/logs`);
      log.textContent = text.split("\n").slice(-60).join("\n");
    } catch (error) {
      log.textContent = explain(error);
    }
  };
  const reloadJob = async () => { job = await api("GET", `/v1/jobs/${jobId}`); renderFacts(); };
  loadCheckpoints().catch(() => {});
  loadLog();

  let pending = false;
  const redraw = () => {  // at most one redraw per animation frame, however many points arrive
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; Object.values(charts).forEach(c => c.redraw()); });
  };
  const stop = stream(`/v1/jobs/${jobId}/stream`, (kind, data) => {
    if (kind === "metric") {
      if (data.loss != null || data.samples_per_s != null) {
        lastStep = Math.max(lastStep, data.step);
        charts.speed.add(data.step, [data.samples_per_s]);
        charts.lr.add(data.step, [data.lr]);
        charts.norm.add(data.step, [data.grad_norm]);
        charts.world.add(data.step, [data.world_size]);
      }
      charts.loss.add(data.step, [data.loss, data.val_loss]);
      addUserMetrics(data.step, data.user_metrics);
      redraw();
    } else if (kind === "state" || kind === "event") {
      if (data.to_state === "RECOVERING") recoveries.push(lastStep);
      events.append(el("tr", {}, el("td", {}, when(data.at)), el("td", {}, data.to_state ? stateCell(data.to_state) : ""),
        el("td", {}, data.message || "")));
      if (data.kind === "checkpoint") loadCheckpoints().catch(() => {});
      if (data.to_state) reloadJob().catch(() => {});
    }
  }, async () => { await reloadJob().catch(() => {}); loadCheckpoints().catch(() => {}); loadLog(); });
  const facts_timer = setInterval(() => { if (!TERMINAL.has(job.state)) reloadJob().catch(() => {}); }, 5000);
  const log_timer = setInterval(() => { if (!TERMINAL.has(job.state)) loadLog(); }, 10000);
  leaving.push(stop, () => clearInterval(facts_timer), () => clearInterval(log_timer));
}

// The queue in the dispatcher's plan order with why each job waits, each tenant's standing, and a chart of each
// tenant's share of the cluster (solid) against what its weight entitles it to (dashed).
const SHARE_WINDOWS = [["60", "last hour"], ["360", "last 6 hours"], ["1440", "last day"], ["10080", "last week"]];
const TENANT_COLOURS = ["#3056d3", "#e67e22", "#1e8e3e", "#8e44ad", "#c0392b", "#16a085", "#34495e", "#d35400"];
const percent = value => `${(value * 100).toFixed(1)}%`;

function workersText(w) {
  const sizes = w.min === w.max ? String(w.min) : `${w.min}-${w.max}`;
  return `${sizes} × ${w.gpus_per_worker ? `${w.gpus_per_worker} GPU` : `${w.cpus_per_worker} CPU`}`;
}

function whyText(job) {
  let why = job.waiting_reason || "not planned yet";
  if (job.preemptions) {
    why += ` (preempted ${job.preemptions}×${job.preempted_for ? ` for ${job.preempted_for.slice(0, 12)}` : ""})`;
  }
  return why;
}

function shareChart(box, answer) {
  // One x axis (seconds) for every tenant: the dispatcher samples all tenants at once, so their times line up; a
  // tenant missing at a time is a gap, which spanGaps draws across.
  const times = [...new Set(answer.series.flatMap(s => s.points.map(p => Date.parse(p.at) / 1000)))].sort((a, b) => a - b);
  const index = new Map(times.map((t, i) => [t, i]));
  const data = [times];
  const series = [{}];
  answer.series.forEach((tenant, n) => {
    const colour = TENANT_COLOURS[n % TENANT_COLOURS.length];
    const share = new Array(times.length).fill(null);
    const entitled = new Array(times.length).fill(null);
    for (const p of tenant.points) {
      const i = index.get(Date.parse(p.at) / 1000);
      share[i] = p.share;
      entitled[i] = p.entitled_share;
    }
    data.push(share, entitled);
    series.push({ label: `${tenant.tenant} share`, stroke: colour, width: 1.5, spanGaps: true, value: (u, v) => v == null ? "-" : percent(v) },
      { label: `${tenant.tenant} entitled`, stroke: colour, dash: [6, 4], width: 1, spanGaps: true, value: (u, v) => v == null ? "-" : percent(v) });
  });
  box.replaceChildren(el("div", { class: "title" }, "Share of the cluster (solid) and entitled share (dashed)"));
  box.dataset.points = String(times.length);
  box.dataset.tenants = answer.series.map(s => s.tenant).join(",");
  if (!times.length) {
    box.append(el("p", { class: "muted" }, "No samples in this window yet: the dispatcher records them as it plans."));
    return;
  }
  new uPlot({ width: 1100, height: 260, series, scales: { y: { range: [0, 1] } },
    axes: [{}, { values: (u, splits) => splits.map(percent), size: 60 }] }, data, box);
}

async function queuePage() {
  const params = new URLSearchParams(location.search);
  const window_ = el("select", { id: "share-window" }, SHARE_WINDOWS.map(([minutes, label]) => el("option", { value: minutes }, label)));
  window_.value = params.get("minutes") || "60";
  const body = el("tbody");
  const table = el("table", { id: "queue" },
    el("thead", {}, el("tr", {}, ["#", "job", "tenant", "priority", "workers", "waiting", "why"].map(h => el("th", {}, h)))), body);
  const tenantsBody = el("tbody");
  const tenants = el("table", { id: "tenants" },
    el("thead", {}, el("tr", {}, ["tenant", "weight", "share now", "decayed share", "entitled share", "held"].map(h => el("th", {}, h)))),
    tenantsBody);
  const status = el("p", { class: "muted", id: "queue-status" });
  const chartBox = el("div", { class: "chart", id: "chart-shares", "data-points": "0" });
  window_.addEventListener("change", () => { history.replaceState(null, "", `/ui/queue?minutes=${window_.value}`); loadShares(); });
  show(el("h1", {}, "Queue"), table, status, el("h2", {}, "Tenants"), tenants,
    el("h2", {}, "Fair share"), el("div", { class: "toolbar" }, "Show ", window_), chartBox);
  const refresh = async () => {
    try {
      const answer = await api("GET", "/v1/queue?limit=500");
      const now = Date.now();
      body.replaceChildren(...answer.items.map(job => el("tr", { "data-job-id": job.id },
        el("td", {}, job.position == null ? "-" : String(job.position)),
        el("td", {}, link(`/ui/jobs/${job.id}`, job.id.slice(0, 12)), " ", job.name),
        el("td", {}, job.tenant), el("td", {}, String(job.priority)), el("td", {}, workersText(job.workers)),
        el("td", { title: when(job.queued_since) }, duration(Math.max(now - Date.parse(job.queued_since), 0) / 1000)),
        el("td", { class: "why" }, whyText(job)))));
      tenantsBody.replaceChildren(...answer.tenants.map(t => el("tr", { "data-tenant": t.name },
        el("td", {}, t.name), el("td", {}, String(t.weight)), el("td", {}, percent(t.share)),
        el("td", {}, percent(t.decayed_share)), el("td", {}, percent(t.entitled_share)),
        el("td", {}, `${t.held_gpus} GPU, ${t.held_cpus} CPU`))));
      status.textContent = answer.total > answer.items.length
        ? `${answer.items.length} of ${answer.total} queued job(s) shown` : `${answer.total} queued job(s)`;
    } catch (error) {
      status.replaceChildren(failure(error));
    }
  };
  const loadShares = async () => {
    try {
      shareChart(chartBox, await api("GET", `/v1/queue/shares?minutes=${window_.value}`));
    } catch (error) {
      chartBox.replaceChildren(failure(error));
    }
  };
  await Promise.all([refresh(), loadShares()]);
  const timers = [setInterval(refresh, 5000), setInterval(loadShares, 15000)];
  leaving.push(() => timers.forEach(clearInterval));
}

function planPage() {
  const field = (name, label, value, type = "text") => [el("label", { for: name }, label), el("input", { id: name, name, value, type })];
  const precision = el("select", { id: "precision", name: "precision" }, ["mixed", "bf16", "fp32"].map(p => el("option", { value: p }, p)));
  const result = el("div", { id: "plan-result" });
  const form = el("form", { class: "grid", id: "plan-form", onsubmit: async event => {
    event.preventDefault();
    const values = Object.fromEntries(new FormData(form));
    const request = { gpu_memory_gb: Number(values.gpu_memory_gb), gpus_per_node: Number(values.gpus_per_node),
      nodes: Number(values.nodes), precision: values.precision };
    if (values.model) { request.model = values.model; } else { request.parameters = Number(values.parameters); }
    try {
      const plan = await api("POST", "/v1/plan", request);
      const chosen = plan.recommendation?.label;
      result.replaceChildren(
        el("p", {}, `${plan.model}: ${plan.parameters.toLocaleString()} parameters on ${plan.world_size} GPUs`),
        el("table", {}, el("thead", {}, el("tr", {}, ["option", "total/GPU (GB)", "fits", "traffic/step (GB)", "bubble"].map(h => el("th", {}, h)))),
          el("tbody", {}, plan.options.map(o => el("tr", {},
            el("td", {}, o.label === chosen ? `${o.label} ★` : o.label),
            el("td", {}, o.memory_per_gpu.total_gb == null ? "?" : o.memory_per_gpu.total_gb.toFixed(2)),
            el("td", {}, o.fits == null ? "?" : o.fits ? "yes" : "no"),
            el("td", {}, o.communication_per_step.total_gb == null ? "?" : o.communication_per_step.total_gb.toFixed(3)),
            el("td", {}, o.bubble == null ? "-" : `${(o.bubble * 100).toFixed(1)}%`))))),
        el("p", {}, chosen ? `recommended: ${chosen}` : "nothing fits"),
        el("ul", {}, [...plan.reasons, ...(plan.recommendation?.reasons || [])].map(r => el("li", {}, r))));
    } catch (error) {
      result.replaceChildren(failure(error));
    }
  } },
  field("parameters", "Parameters", "7000000000", "number"), field("model", "or a built-in model", ""),
  field("gpu_memory_gb", "GPU memory (GB)", "80", "number"), field("gpus_per_node", "GPUs per node", "8", "number"),
  field("nodes", "Nodes", "1", "number"), el("label", { for: "precision" }, "Precision"), precision,
  el("span"), el("button", { type: "submit" }, "Plan"));
  show(el("h1", {}, "Plan"), form, result);
}

function submitPage() {
  const text = el("textarea", { id: "spec", spellcheck: "false" },
    "name: my-job\nmodel: tiny-gpt\nworkers: {min: 1, max: 2}\ntrain: {steps: 100, global_batch_size: 16, micro_batch_size: 4}\n");
  const result = el("div", { id: "submit-result" });
  const button = el("button", { id: "submit", onclick: async () => {
    try {
      const job = await api("POST", "/v1/jobs", text.value, "application/yaml");
      navigate(`/ui/jobs/${job.id}`);
    } catch (error) {
      result.replaceChildren(failure(error));
    }
  } }, "Submit");
  show(el("h1", {}, "Submit a job spec (YAML)"), text, el("p", {}, button), result);
}

// -- routing and the token ------------------------------------------------------------------------------------------

function route() {
  const path = location.pathname.replace(/\/+$/, "");
  const job = path.match(/^\/ui\/jobs\/([0-9a-f]{32})$/);
  if (job) return jobPage(job[1]);
  if (path === "/ui/queue") return queuePage();
  if (path === "/ui/plan") return planPage();
  if (path === "/ui/submit") return submitPage();
  return jobsPage();
}

function navigate(url) {
  history.pushState(null, "", url);
  route();
}

document.addEventListener("click", event => {
  const anchor = event.target.closest("a");
  if (anchor && anchor.getAttribute("href")?.startsWith("/ui") && !event.metaKey && !event.ctrlKey) {
    event.preventDefault();
    navigate(anchor.getAttribute("href"));
  }
});
window.addEventListener("popstate", route);

async function whoami() {
  const label = document.getElementById("whoami");
  if (!token()) { label.textContent = "no token"; return; }
  try {
    const me = await api("GET", "/v1/me");
    label.textContent = `tenant ${me.tenant.name}${me.admin ? " (admin)" : ""}`;
  } catch (error) {
    label.textContent = error.status === 401 ? "token refused" : "";
  }
}

document.getElementById("token-form").addEventListener("submit", event => {
  event.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem("ringmaster-token", input.value.trim());
  input.value = "";
  whoami();
  route();
});
document.getElementById("forget").addEventListener("click", () => {
  sessionStorage.removeItem("ringmaster-token");
  whoami();
  route();
});

whoami();
route();
