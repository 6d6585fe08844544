"""What bench/mix.py prints: each run's table, the footprints, and the limited run against the
baseline and the targets."""

from mix_tasks import fairness, percentile, summarise

MIB = 1 << 20


def fmt_ms(x):
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 1 else f"{x * 1000:.1f}"


def fmt_counts(d):
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items())) or "none"


def ratio(a, b):
    return None if a is None or not b else a / b


def fmt_x(r):
    return "-" if r is None else f"{r:.2f}x"


def print_run(res, tasks, seconds, ncores):
    print(f"\n== {res['name']}: budget {res['budget'] / MIB:.0f} MiB"
          f"{' (host_memory_limit ' + res['limit'] + ')' if res['limit'] else ' (auto: the machine)'}; "
          f"warm-up {res['warm_s']:.1f} s; idle RSS after warm-up {res['idle_rss'] / MIB:.0f} MiB")
    if res["costs"]:
        print("cost of each task alone (requests one after another, after the warm-up): server CPU s / request, "
              "wall ms / request, offered CPU = rate x CPU")
        total = 0.0
        for task in tasks:
            cpu, wall = res["costs"][task.name]
            total += task.rate * cpu
            print(f"  {task.name:<12}{cpu:>8.3f} s{wall * 1000:>9.1f} ms{task.rate * cpu:>7.2f} cores")
        print(f"  offered in all: {total:.2f} cores = {100 * total / ncores:.0f}% of {ncores}")
    print(f"{'task':<12}{'offered/s':>10}{'reqs':>6}{'ok':>6}{'goodput/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}  errors by status")
    stats = summarise(res["records"], res["schedule"], tasks, seconds)
    for task in tasks:
        s = stats[task.name]
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "-"
        print(f"{task.name:<12}{task.rate:>10.2f}{s['requests']:>6}{s['ok']:>6}{s['goodput']:>10.2f}"
              f"{fmt_ms(s['p50']):>9}{fmt_ms(s['p99']):>9}{fmt_ms(s['max']):>9}  {errs}")
    loads = sum(d[0] for d in res["deltas"].values())
    evictions = sum(d[1] for d in res["deltas"].values())
    refusals = sum(1 for r in res["records"] if r[4] in (429, 503))
    per_model = ", ".join(f"{n} {d[0]}/{d[1]}" for n, d in sorted(res["deltas"].items()) if d != (0, 0)) or "none"
    lates = sorted(res["late"])
    print(f"loads {loads}, evictions {evictions} (per model loads/evictions: {per_model}); refusals (429/503) "
          f"{refusals} (server's reasons: {fmt_counts(res['refusals'])}); memory alerts {fmt_counts(res['alerts'])}; "
          f"unfinished after the drain {res['unfinished']}; most models resident at once {res['most_resident']} "
          f"(their footprints {res['most_accounted'] / MIB:.0f} MiB; /admin/models polled every second)")
    print(f"server: peak RSS {res['peak_rss'] / MIB:.0f} MiB (sampled every 50 ms); CPU {res['cpu']:.1f} s = "
          f"{res['cpu'] / res['wall']:.2f} cores "
          f"({100 * res['cpu'] / res['wall'] / ncores:.0f}% of {ncores}) over {res['wall']:.0f} s; this client "
          f"{res['client_cpu'] / res['wall']:.2f} cores; {res['background']}")
    print(f"sends: p99 {percentile(lates, 99) * 1000:.1f} ms, max {lates[-1] * 1000:.1f} ms after their scheduled "
          f"time; server {res['ended']}")
    heavy = res["heavy"]
    for task in tasks:
        if task.light_target:
            during, quiet = fairness(res["records"], task.name, heavy)
            print(f"fairness {task.name}: while a transcription or OCR page was in flight n={len(during)} "
                  f"p50 {fmt_ms(percentile(during, 50))} p99 {fmt_ms(percentile(during, 99))} max "
                  f"{fmt_ms(max(during, default=None))} ms; with none in flight n={len(quiet)} "
                  f"p50 {fmt_ms(percentile(quiet, 50))} p99 {fmt_ms(percentile(quiet, 99))} ms")
    return stats


def print_footprints(results):
    """Per model, per run: weights form, measured footprint, load-time peak (after the run)."""
    runs = list(results)
    print("\nfootprints from /admin/models after each run, MiB (estimated from the files; per run: weights form, "
          "measured resident, measured load peak)")
    print(f"  {'model':<18}{'est.':>6}" + "".join(f"  {r:>28}" for r in runs))
    totals = dict.fromkeys(runs, 0)
    for name in sorted(results[runs[0]]["models"]):
        row = f"  {name:<18}{results[runs[0]]['models'][name]['footprint_estimated_bytes'] / MIB:>6.0f}"
        for r in runs:
            m = results[r]["models"].get(name, {})
            measured, peak = m.get("footprint_measured_bytes") or 0, m.get("footprint_peak_measured_bytes") or 0
            totals[r] += measured
            row += f"  {str(m.get('weights')):>12}{measured / MIB:>8.0f}{peak / MIB:>8.0f}"
        print(row)
    print(f"  {'sum of measured':<24}" + "".join(f"  {'':>12}{totals[r] / MIB:>8.0f}{'':>8}" for r in runs))


def print_comparison(tasks, base, lim, base_res, lim_res):
    print("\n== limited vs baseline, against the targets")
    print(f"{'task':<12}{'goodput ratio':>14}{'  >=0.7x':<9}{'p99 ratio':>10}{'  <=3x':<7}")
    misses = 0
    for task in tasks:
        g = ratio(lim[task.name]["goodput"], base[task.name]["goodput"])
        p = ratio(lim[task.name]["p99"], base[task.name]["p99"])
        g_ok = g is not None and g >= 0.7
        p_ok = p is not None and p <= 3.0
        misses += (not g_ok) + (not p_ok)
        print(f"{task.name:<12}{fmt_x(g):>14}  {'meets' if g_ok else 'MISSES':<7}{fmt_x(p):>10}  "
              f"{'meets' if p_ok else 'MISSES'}")
    for res in (base_res, lim_res):
        heavy = res["heavy"]
        for task in tasks:
            if task.light_target:
                during, _ = fairness(res["records"], task.name, heavy)
                p99 = percentile(during, 99)
                ok = p99 is not None and p99 <= task.light_target
                misses += not ok
                print(f"{res['name']:<9}{task.name:<12} p99 while transcriptions/OCR run {fmt_ms(p99):>7} ms "
                      f"(target <= {task.light_target * 1000:.0f} ms: {'meets' if ok else 'MISSES'})")
    return misses
