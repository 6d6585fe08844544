#!/usr/bin/env python3
"""The real mix: transcriptions, OCR pages, embeddings and small KServe models arriving at
once, open loop, first with every model resident, then under a memory budget of about half
of what that took — what the budget costs each task, and whether the light tasks stay quick
while the heavy ones run.

One server (target/release/snooze, or SNOOZE_BIN) serves the real models of `make prepare`,
declared as in crates/server/src/default.toml:

    whisper-tiny-en     POST /v1/audio/transcriptions (multipart, response_format json)
    ocr                 POST /v1/ocr, one page (the pipeline ocr-det / ocr-cls / ocr-rec)
    minilm-onnx(-int8)  POST /v1/embeddings, 1-32 short texts (base64 answers)
    mlp-10m, mlp-100m-1..3   POST /v2/models/NAME/infer, x FP32 [1,256]

Two runs of the same seeded schedule (`--seconds`, default 120), each on a fresh server over
one state dir (made by `snooze prepare` first, so no run converts weights in its background):

  baseline  no limit (`auto`), keep_alive -1; every model warmed first (each page, the
            longest clip). Its idle RSS after the warm-up is the figure the budget halves.
  limited   host_memory_limit = half that RSS (or `--limit`); warmed the same way (which
            evicts), then the same arrivals.

Each run first sends `--preroll` seconds (default 20) of the same mix with other arrivals,
untimed, and goes on into the timed schedule without a pause: what is measured is the mix
in its steady state, not the loads and evictions that follow the warm-up (the cold start
has its own benchmark, `make bench-zipf`). Counters, CPU and peak RSS are the timed part's;
heavy work of the pre-roll still in flight counts as heavy for the fairness figures.

Arrivals are open loop: per task a seeded Poisson process at its own rate; each request is
sent at its scheduled time by a pool of threads whatever happened to the ones before, and
its latency runs from the scheduled time to the end of its answer (a late send counts
against the server). No retries: a 429 / 503 is a refusal and counted as such.

    .venv/bin/python bench/mix.py            # or: make bench-mix
    SNOOZE_BIN=/path/to/snooze .venv/bin/python bench/mix.py --seconds 30

Needs only the project venv (numpy), sox and pocketsphinx-testdata (for the clips). The
tasks, their payloads and checks, and the figures live in bench/mix_tasks.py; what is printed, in
bench/mix_report.py.
"""

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from embeddings import (MODELS, ROOT, Background, loadavg, machine_info, ort_dylib, proc_cpu_seconds,  # noqa: E402
                        status_bytes)
from mix_report import MIB, print_comparison, print_footprints, print_run  # noqa: E402
from mix_tasks import Task, build_tasks, heavy_intervals  # noqa: E402

BINARY = os.environ.get("SNOOZE_BIN") or os.path.join(ROOT, "target", "release", "snooze")
MODEL_TABLES = """\
[models.whisper-tiny-en]
path = "{m}/whisper-tiny-en"
max_batch_size = 8

[models.ocr-det]
path = "{m}/ocr-det"

[models.ocr-cls]
path = "{m}/ocr-cls"

[models.ocr-rec]
path = "{m}/ocr-rec"

[pipelines.ocr]
det = "ocr-det"
cls = "ocr-cls"
rec = "ocr-rec"

[models.minilm-onnx]
path = "{m}/minilm-onnx"

[models.minilm-onnx-int8]
path = "{m}/minilm-onnx-int8"

[models.mlp-10m]
path = "{m}/mlp-10m"
"""


def config_text(k_big, limit=None):
    server = ['[server]', 'keep_alive = "-1"']
    if limit:
        server.append(f'host_memory_limit = "{limit}"')
    big = "".join(f'\n[models.mlp-100m-{i}]\npath = "{MODELS}/mlp-100m-{i}"\n' for i in range(1, k_big + 1))
    return "\n".join(server) + "\n\n" + MODEL_TABLES.format(m=MODELS) + big


# --- the server ----------------------------------------------------------------------------

class Server:
    """`snooze serve` on a free port over a given state dir; its log goes to `<name>.log` in
    the work dir (printed at the end), and its tail is kept for errors."""

    def __init__(self, workdir, name, config, state_dir, extra_args):
        cfg = os.path.join(workdir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(config)
        env = dict(os.environ, NO_COLOR="1")
        if ort_dylib():
            env["ORT_DYLIB_PATH"] = ort_dylib()
        self.proc = subprocess.Popen([BINARY, "serve", *extra_args, "--config", cfg, "--http-address", "127.0.0.1:0",
                                      "--grpc-address", "off", "--state-dir", state_dir],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.pid, self.tail, found, addr = self.proc.pid, [], threading.Event(), {}

        self.log_path = os.path.join(workdir, f"{name}.log")
        log = open(self.log_path, "w")

        def pump():
            for line in self.proc.stderr:
                log.write(line)
                self.tail.append(line)
                del self.tail[:-60]
                m = re.search(r"listening on http://(\S+)", line)
                if m and not found.is_set():
                    addr["a"] = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(60):
            self.proc.kill()
            sys.exit("server did not start:\n" + "".join(self.tail))
        self.host = addr["a"]

    def get(self, path):
        conn = http.client.HTTPConnection(self.host, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: {r.status} {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def refusals(self):
        """snooze_refusals_total summed by reason, from /metrics."""
        conn = http.client.HTTPConnection(self.host, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out = {}
        for m in re.finditer(r'^snooze_refusals_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
        return out

    def alerts_since(self, unix_ms):
        """Memory-pressure alerts raised since `unix_ms`, counted by level."""
        out = {}
        for a in self.get("/admin/memory/stats").get("alerts", []):
            if a.get("since_unix_ms", 0) >= unix_ms:
                out[str(a.get("level"))] = out.get(str(a.get("level")), 0) + 1
        return out

    def models(self):
        return {m["name"]: m for m in self.get("/admin/models")["models"]}

    def rss(self):
        return status_bytes(self.pid, "VmRSS")

    def stop(self):
        """SIGTERM; returns how it ended."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return f"exit status {self.proc.wait(60)}"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "killed after 60 s"


def prepare(workdir, state_dir, k_big):
    """`snooze prepare`: both weight forms of every model, before any run is timed."""
    cfg = os.path.join(workdir, "prepare.toml")
    with open(cfg, "w") as f:
        f.write(config_text(k_big))
    env = dict(os.environ, NO_COLOR="1")
    if ort_dylib():
        env["ORT_DYLIB_PATH"] = ort_dylib()
    t0 = time.perf_counter()
    r = subprocess.run([BINARY, "prepare", "--config", cfg, "--state-dir", state_dir], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"snooze prepare failed:\n{r.stdout}{r.stderr}")
    return time.perf_counter() - t0


class Monitor:
    """While a run is timed: the server's VmRSS every 50 ms (peak) and how many models
    /admin/models shows resident, every second (most at once)."""

    def __init__(self, server):
        self.server, self.peak, self.stop_ev = server, 0, threading.Event()
        self.most_resident = self.most_accounted = 0
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._rss, self._models)]
        for t in self.threads:
            t.start()

    def _rss(self):
        while not self.stop_ev.is_set():
            try:
                self.peak = max(self.peak, self.server.rss())
            except OSError:
                return
            self.stop_ev.wait(0.05)

    def _models(self):
        while not self.stop_ev.is_set():
            try:
                resident = [m for m in self.server.models().values() if m["state"] in ("ready", "loading")]
                accounted = sum(m.get("footprint_measured_bytes") or m["footprint_estimated_bytes"] for m in resident)
                if (len(resident), accounted) > (self.most_resident, self.most_accounted):
                    self.most_resident, self.most_accounted = len(resident), accounted
            except (OSError, RuntimeError, ValueError, KeyError):
                pass
            self.stop_ev.wait(1.0)

    def finish(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join()
        return self.peak


# --- one run ---------------------------------------------------------------------------------

class Sender:
    """One keep-alive connection per worker thread; (status, body) or raises."""

    def __init__(self, host):
        self.host, self.local = host, threading.local()

    def send(self, path, body, content_type):
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection(self.host, timeout=300)
            try:
                conn.request("POST", path, body=body, headers={"Content-Type": content_type})
                r = conn.getresponse()
                return r.status, r.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise


def warm_up(server, tasks):
    """Every payload a task marks for warm-up, one after another; refusals waited out."""
    sender = Sender(server.host)
    for task in tasks:
        for req in task.warmup:
            for attempt in range(20):
                status, body = sender.send(req.path, req.body, req.content_type)
                if status == 200:
                    problem = req.check(body)
                    if problem:
                        sys.exit(f"warm-up {task.name}: {problem}")
                    break
                if status not in (429, 503):
                    sys.exit(f"warm-up {task.name}: {status} {body[:300]!r}")
                time.sleep(1 + attempt)
            else:
                sys.exit(f"warm-up {task.name}: still refused after 20 tries")


CALIBRATION = {"transcribe": 3, "ocr": 4, "embed-fp32": 8, "embed-int8": 8, "mlp-10m": 40, "mlp-100m": 12}


def calibrate(server, tasks, seed):
    """Each task alone, one request after another (drawn as its arrivals are, another seed):
    the server's CPU seconds and the wall time per request. Returns name -> (cpu, wall)."""
    sender, out = Sender(server.host), {}
    for task in tasks:
        rng = random.Random(seed + 1)
        reqs = [task.make(rng) for _ in range(CALIBRATION.get(task.name, 5))]
        cpu0, t0 = proc_cpu_seconds(server.pid), time.perf_counter()
        for req in reqs:
            status, body = sender.send(req.path, req.body, req.content_type)
            if status != 200 or req.check(body):
                sys.exit(f"calibration {task.name}: {status} {req.check(body) if status == 200 else body[:300]!r}")
        out[task.name] = ((proc_cpu_seconds(server.pid) - cpu0) / len(reqs), (time.perf_counter() - t0) / len(reqs))
    return out


def counters(models):
    return {n: (m.get("loads", 0), m.get("evictions", 0)) for n, m in models.items()}


def run(name, workdir, state_dir, tasks, schedule, args, limit=None, extra_args=(), preroll=()):
    """Starts a server, warms it, sends `preroll` (times < 0, untimed) then `schedule` open
    loop without a pause between them, returns the figures of `schedule`."""
    server = Server(workdir, name, config_text(args.big_models, limit), state_dir, list(extra_args))
    try:
        t0 = time.perf_counter()
        warm_up(server, tasks)
        warm_s = time.perf_counter() - t0
        costs = calibrate(server, tasks, args.seed) if name == "baseline" else None
        time.sleep(1.0)  # let the last run's buffers go back before the idle RSS is read
        idle_rss = server.rss()
        budget = server.get("/admin/models")["memory"].get("budget_bytes")
        at = {}

        def at_zero():
            """The timed part starts: every counter is read from here."""
            at.update(before=server.models(), refused0=server.refusals(), since=int(time.time() * 1000),
                      monitor=Monitor(server), cpu0=proc_cpu_seconds(server.pid),
                      me0=proc_cpu_seconds(os.getpid()), background=Background([server.pid, os.getpid()]))

        records = send_open_loop(server, list(preroll) + list(schedule), args, at_zero)
        wall = records.pop("__wall__")
        if args.trace:
            write_trace(args.trace, name, server.log_path, records)
        monitor = at["monitor"]
        peak = monitor.finish()
        cpu = proc_cpu_seconds(server.pid) - at["cpu0"]
        me = proc_cpu_seconds(os.getpid()) - at["me0"]
        after, refused1, alerts = server.models(), server.refusals(), server.alerts_since(at["since"])
        bg = at["background"].report()
    finally:
        ended = server.stop()
    before, refused0 = at["before"], at["refused0"]
    c0, c1 = counters(before), counters(after)
    deltas = {n: (c1[n][0] - c0.get(n, (0, 0))[0], c1[n][1] - c0.get(n, (0, 0))[1]) for n in c1}
    timed = [r for r in records["records"] if r[1] >= 0]
    return {
        "name": name, "limit": limit, "budget": budget, "warm_s": warm_s, "idle_rss": idle_rss, "peak_rss": peak,
        "costs": costs, "most_accounted": monitor.most_accounted, "cpu": cpu, "client_cpu": me, "wall": wall,
        "background": bg, "ended": ended,
        "models": after, "deltas": deltas, "alerts": alerts,
        "refusals": {k: v - refused0.get(k, 0) for k, v in refused1.items() if v - refused0.get(k, 0)},
        "most_resident": monitor.most_resident, "records": timed, "schedule": schedule,
        # Heavy work in flight includes the pre-roll's, still running as the timed part starts.
        "heavy": heavy_intervals(records["records"], tasks),
        "late": records["late"], "unfinished": records["unfinished"],
    }


def write_trace(trace_dir, name, log_path, records):
    """`--trace`: the run's server log and every request (task, scheduled s, sent, done as
    seconds since the Unix epoch, status, problem), to line latencies up with the log."""
    os.makedirs(trace_dir, exist_ok=True)
    shutil.copy(log_path, os.path.join(trace_dir, f"{name}.log"))
    e = records["start_epoch"]
    with open(os.path.join(trace_dir, f"{name}.requests.jsonl"), "w") as f:
        for task, t, sent, done, status, problem in records["records"]:
            f.write(json.dumps({"task": task, "t": t, "sent": e + sent, "done": e + done,
                                "status": status, "problem": problem}) + "\n")


def send_open_loop(server, schedule, args, at_zero):
    """Sends each (t, task, request) at start + t from a pool of threads; `at_zero()` is
    called just before the first request with t >= 0 (the timed part) goes out. Lateness
    and the wall time are the timed part's."""
    sender = Sender(server.host)
    records, lock, lates = [], threading.Lock(), []
    pool = ThreadPoolExecutor(max_workers=args.workers)
    start = time.perf_counter() + 0.5 - min([0.0] + [t for t, _, _ in schedule])
    start_epoch = time.time() + (start - time.perf_counter())
    timed = 0

    def one(t, task, req):
        sent = time.perf_counter()
        status, problem = None, None
        try:
            status, body = sender.send(req.path, req.body, req.content_type)
            if status == 200:
                problem = req.check(body)
        except (OSError, http.client.HTTPException) as e:
            problem = f"transport: {e}"
        done = time.perf_counter()
        with lock:
            records.append((task.name, t, sent - start, done - start, status, problem))

    futures = []
    for t, task, req in schedule:
        delay = start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if t >= 0:
            if not timed:
                at_zero()
            timed += 1
            lates.append(time.perf_counter() - start - t)
        futures.append(pool.submit(one, t, task, req))
    if not timed:
        at_zero()
    deadline = time.perf_counter() + args.drain
    for f in futures:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            f.result(timeout=left)
        except Exception:  # a worker's own failure is recorded; a timeout leaves it unfinished
            pass
    wall = time.perf_counter() - start
    with lock:
        finished = sum(1 for r in records if r[1] >= 0)
        out = list(records)
    pool.shutdown(wait=False, cancel_futures=True)
    return {"records": out, "late": lates, "unfinished": timed - finished, "__wall__": wall,
            "start_epoch": start_epoch}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120, help="arrivals for this long per run (default 120)")
    ap.add_argument("--preroll", type=float, default=20,
                    help="seconds of the same mix (other arrivals) sent before the timed part, untimed (default 20)")
    ap.add_argument("--seed", type=int, default=20261202, help="seed of the arrivals and payloads")
    ap.add_argument("--rate", action="append", default=[], metavar="TASK=PER_S",
                    help="change a task's rate (e.g. --rate transcribe=0.1); 0 leaves the task out")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every task's rate (default 1)")
    ap.add_argument("--big-models", type=int, default=3, help="k: mlp-100m-1..k share the mlp-100m rate (default 3)")
    ap.add_argument("--limit", help="host_memory_limit of the limited run (default: half the baseline's idle RSS)")
    ap.add_argument("--runs", default="baseline,limited", help="baseline, limited or both (default)")
    ap.add_argument("--server-args", default=os.environ.get("SNOOZE_BENCH_SERVER_ARGS", ""),
                    help="more `snooze serve` flags for both runs (e.g. '--intra-op-threads 1')")
    ap.add_argument("--limited-args", default="", help="more `snooze serve` flags for the limited run only")
    ap.add_argument("--state-dir", help="the servers' state dir, kept (default: a fresh one under the work dir)")
    ap.add_argument("--trace", metavar="DIR",
                    help="keep each run's server log and every request's times in DIR (to line them up)")
    ap.add_argument("--workers", type=int, default=128, help="sender threads (default 128)")
    ap.add_argument("--drain", type=float, default=120, help="seconds to wait for answers after the last send")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if runs == ["both"]:
        runs = ["baseline", "limited"]
    if not runs or any(r not in ("baseline", "limited") for r in runs):
        sys.exit("--runs takes baseline, limited or both")
    if "limited" in runs and "baseline" not in runs and not args.limit:
        sys.exit("a limited run alone needs --limit")
    if not os.path.exists(BINARY):
        sys.exit(f"{BINARY} missing: cargo build --release --bin snooze (or set SNOOZE_BIN)")
    rates = {}
    for item in args.rate:
        name, _, value = item.partition("=")
        rates[name.strip()] = float(value)
    t_begin = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="snooze-mix-")
    state_dir = os.path.abspath(args.state_dir) if args.state_dir else os.path.join(workdir, "state")
    tasks = build_tasks(workdir, rates, args.big_models, args.scale)
    schedule = Task.schedule(tasks, args.seconds, args.seed)
    # The same mix, other arrivals, for --preroll seconds before the timed part: the run is
    # measured in its steady state, not in the loads and evictions that follow the warm-up.
    preroll = [(t - args.preroll, task, req) for t, task, req in Task.schedule(tasks, args.preroll, args.seed ^ 0x5EED)]
    ncores = len(os.sched_getaffinity(0))
    print(machine_info())
    print(f"server: {BINARY}; ORT_DYLIB_PATH={os.path.basename(ort_dylib() or 'unset')}; "
          f"flags: {args.server_args or '-'} (limited run also: {args.limited_args or '-'})")
    print(f"open loop, seeded Poisson arrivals (seed {args.seed}) for {args.seconds:.0f} s per run, "
          f"{len(schedule)} requests, after an untimed pre-roll of {args.preroll:.0f} s ({len(preroll)} requests); "
          f"{loadavg()}")
    for task in tasks:
        print(f"  {task.name:<12}{task.rate:>6.2f}/s  {task.describe}")
    print(f"weights prepared (snooze prepare, both forms) in {prepare(workdir, state_dir, args.big_models):.1f} s")
    extra = args.server_args.split()
    results = {}
    if "baseline" in runs:
        results["baseline"] = run("baseline", workdir, state_dir, tasks, schedule, args, None, extra, preroll)
    if "limited" in runs:
        limit = args.limit or f"{results['baseline']['idle_rss'] // 2 // MIB}MiB"
        print(f"\nlimited run: host_memory_limit = {limit}"
              + (f" (half of the baseline's idle RSS {results['baseline']['idle_rss'] / MIB:.0f} MiB)"
                 if not args.limit else ""))
        results["limited"] = run("limited", workdir, state_dir, tasks, schedule, args, limit,
                                 extra + args.limited_args.split(), preroll)
    print_footprints(results)
    stats = {name: print_run(res, tasks, args.seconds, ncores) for name, res in results.items()}
    if len(stats) == 2:
        misses = print_comparison(tasks, stats["baseline"], stats["limited"], results["baseline"],
                                  results["limited"])
        print(f"\n{misses} target(s) missed")
    # The models' copies in a state dir of our own are gigabytes: gone with the run (the
    # configs, clips and server logs stay for a look); `--state-dir` keeps them.
    if not args.state_dir:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(f"\n(total bench time {time.perf_counter() - t_begin:.0f} s; {loadavg()}; "
          f"work dir {workdir}: configs, clips, server logs)")


if __name__ == "__main__":
    main()
