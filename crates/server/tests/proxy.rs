//! Three SnoozeML nodes behind nginx with `deploy/nginx/snooze.conf`: each node has a
//! budget for two of six 100 MB models (`max_loaded_models = 2`), and a Zipf mix goes
//! through nginx. What it shows:
//!
//! 1. routing: every model is loaded on one node only (each node's `/admin/models`);
//! 2. capacity: goodput through nginx beside one node that holds all six (printed, with
//!    each node's loads and evictions: figures for `deploy/README.md`, not assertions);
//! 3. a node that answers 503 (a fourth node where no model fits) fails over to the
//!    next node of the ring: nothing fails, and nginx's log shows the `503, 200` tries;
//! 4. a node killed (SIGKILL) mid-run loses no request a retry can serve.
//!
//! Debian's nginx is installed by `make test` (`make system-packages`); where it cannot
//! be, the test fails, saying so, unless `SNOOZE_ALLOW_SKIP=proxy` lets it skip.
#![allow(clippy::unwrap_used)]

#[path = "common/closed_loop.rs"]
mod closed_loop;
mod common;

use std::{
    collections::BTreeMap,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use closed_loop::{run_client, Stats, Stop, Target, Zipf};
use common::{client, models_dir, repo_root, skip, Server};
use serde_json::json;

const CLIENTS: usize = 6;
const MODELS: usize = 6;

fn nginx_binary() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// nginx on loopback with its own prefix directory, configured by the project's file.
struct Nginx {
    child: Child,
    base: String,
    dir: PathBuf,
}

impl Nginx {
    fn start(binary: &Path, tag: &str, nodes: &[&str]) -> Nginx {
        let dir = std::env::temp_dir().join(format!("snooze-nginx-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let servers: String = nodes.iter().map(|n| format!("    server {n} max_fails=0;\n")).collect();
        let ours = std::fs::read_to_string(repo_root().join("deploy/nginx/snooze.conf")).unwrap();
        // The file as shipped, with the test's node list and port.
        let ours = ours
            .replace("    include /etc/nginx/snooze-nodes.conf;\n", &servers)
            .replace("    listen 8080;", &format!("    listen 127.0.0.1:{port};"));
        assert!(
            ours.contains(&servers) && ours.contains(&format!(":{port};")),
            "the shipped file changed shape"
        );
        let d = dir.display();
        let conf = format!(
            "worker_processes 1;\ndaemon off;\nerror_log {d}/error.log warn;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n  client_body_temp_path {d}/tmp/body;\n  proxy_temp_path {d}/tmp/proxy;\n\
             fastcgi_temp_path {d}/tmp/fcgi;\n  uwsgi_temp_path {d}/tmp/uwsgi;\n  scgi_temp_path {d}/tmp/scgi;\n\
             log_format tries '$snooze_model $status upstream=$upstream_addr statuses=$upstream_status';\n\
             access_log {d}/access.log tries;\n{ours}\n}}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new(binary)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nginx did not start: {:?}",
                std::fs::read_to_string(dir.join("error.log"))
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Nginx { child, base, dir }
    }

    fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    /// SIGTERM: the master stops its workers and exits after the last one. A SIGKILL
    /// would leave the workers running, orphaned (three after one `make test`); they are
    /// killed by pid only if the master does not stop in time. Runs on a panic too.
    fn drop(&mut self) {
        let master = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(master, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let workers = std::fs::read_to_string(format!("/proc/{master}/task/{master}/children"))
                    .unwrap_or_default();
                for pid in workers.split_whitespace().filter_map(|p| p.parse::<i32>().ok()).chain([master]) {
                    // SAFETY: kill(2) on our child and the workers it forked.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Six models m1..m6 (`mlp-100m-1..6`) held `mapped`; `extra` under `[server]`, `model`
/// in every model.
fn config(extra: &str, model: &str) -> String {
    let mut c = format!("[server]\nkeep_alive = \"-1\"\n{extra}");
    for i in 1..=MODELS {
        c += &format!(
            "[models.m{i}]\npath = \"{}/mlp-100m-{i}\"\nweights = \"mapped\"\n{model}",
            models_dir().display()
        );
    }
    c
}

/// Hard-links a warm state folder (its ORT-format copies) for one node: nodes share the
/// read-only conversions but each keeps its own footprints file.
fn state_for(warm: &Path, node: &str) -> PathBuf {
    let dir = warm.with_file_name(format!("{}-{node}", warm.file_name().unwrap().to_string_lossy()));
    let _ = std::fs::remove_dir_all(&dir);
    link_tree(warm, &dir);
    let _ = std::fs::remove_file(dir.join("footprints.json"));
    dir
}

fn link_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if src.is_dir() {
            link_tree(&src, &dst);
        } else {
            std::fs::hard_link(&src, &dst).unwrap();
        }
    }
}

fn node(tag: &str, toml: &str, state: &Path) -> Server {
    Server::start(tag, toml, &["--state-dir", state.to_str().unwrap(), "--grpc-address", "off"])
}

fn addr(s: &Server) -> &str {
    s.base.trim_start_matches("http://")
}

/// Per model, (loads, evictions) on one node.
type Counts = BTreeMap<String, (u64, u64)>;

/// Per model, (loads, evictions) on node `s`.
fn per_model(s: &Server) -> Counts {
    let (_, v) = s.get("/admin/models");
    v["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let n = |k: &str| m[k].as_u64().unwrap_or(0);
            (m["name"].as_str().unwrap().to_string(), (n("loads"), n("evictions")))
        })
        .collect()
}

/// `CLIENTS` closed-loop clients over the Zipf(1.1) mix of m1..m6 at `base`, `per_client`
/// requests each (Retry-After honoured, outputs checked); served/s and the stats.
fn drive(base: &str, per_client: usize, seed: u64) -> (f64, Stats) {
    let targets: Vec<Target> =
        (1..=MODELS).map(|i| Target::new(base, &format!("m{i}"), &format!("mlp-100m-{i}"))).collect();
    let zipf = Zipf::new(MODELS, 1.1);
    let started = Instant::now();
    let stats = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (targets, zipf) = (&targets, &zipf);
                scope.spawn(move || {
                    let http = client();
                    let stop = Stop { count: Some(per_client), at: None };
                    run_client(
                        &http,
                        targets,
                        zipf,
                        seed + c as u64,
                        stop,
                        Some(Instant::now() + Duration::from_secs(120)),
                    )
                })
            })
            .collect();
        let mut all = Stats::default();
        for h in handles {
            all.merge(h.join().unwrap());
        }
        all
    });
    (stats.served() as f64 / started.elapsed().as_secs_f64(), stats)
}

/// "n0 [models], n1 [...]" of a ring.
fn placement(ring: &[Vec<String>]) -> String {
    ring.iter().enumerate().map(|(n, mine)| format!("n{n} {mine:?}")).collect::<Vec<_>>().join(", ")
}

/// The node of `ring` that holds `model`.
fn owner(ring: &[Vec<String>], model: &str) -> usize {
    ring.iter().position(|mine| mine.iter().any(|m| m == model)).unwrap()
}

/// Warm-up, then a timed Zipf run through `proxy`: (served, loads in the timed part,
/// per node and model (loads, evictions) after it); prints each node's share.
fn timed_run(proxy: &Nginx, nodes: &[Server]) -> (usize, u64, Vec<Counts>) {
    drive(&proxy.base, 5, 1);
    let before: Vec<_> = nodes.iter().map(per_model).collect();
    let (goodput, stats) = drive(&proxy.base, 60, 100);
    assert_no_failures("through nginx", &stats);
    let after: Vec<_> = nodes.iter().map(per_model).collect();
    let mut all_loads = 0;
    for (n, s) in nodes.iter().enumerate() {
        let loads: u64 = after[n].iter().map(|(k, v)| v.0 - before[n][k].0).sum();
        let evictions: u64 = after[n].iter().map(|(k, v)| v.1 - before[n][k].1).sum();
        all_loads += loads;
        println!("  node {n} ({}): timed part {loads} loads, {evictions} evictions", addr(s));
    }
    println!("  {goodput:.1} req/s, p99 {:?}", stats.percentile(99.0));
    (stats.served(), all_loads, after)
}

/// deploy/capacity.py on `nodes` for m1..m6 of `footprint` bytes each, Zipf(1.1) rates
/// and a budget of two of them (`max_loaded_models = 2`): its miss estimate, and the
/// models nginx's consistent-hash ring gives each node. The script computes nginx's
/// ketama ring (160 CRC-32 points per node); the routing check holds it to what nginx did.
fn capacity(nodes: &[&str], footprint: u64) -> (f64, Vec<Vec<String>>) {
    let zipf = Zipf::new(MODELS, 1.1);
    let models: Vec<_> = (1..=MODELS)
        .map(|i| json!({"name": format!("m{i}"), "rate": zipf.probability(i - 1), "footprint_bytes": footprint}))
        .collect();
    let mix = std::env::temp_dir().join(format!("snooze-proxy-mix-{}.json", std::process::id()));
    std::fs::write(&mix, json!({ "models": models }).to_string()).unwrap();
    let out = Command::new("python3")
        .arg(repo_root().join("deploy/capacity.py"))
        .arg("--mix")
        .arg(&mix)
        .args(["--node-memory", &format!("{}", (2 * footprint + 1) as f64 / f64::from(1 << 30))])
        .args(["--addresses", &nodes.join(","), "--json"])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&mix);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ring = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["models"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_string()).collect())
        .collect();
    (v["miss_percent"].as_f64().unwrap() / 100.0, ring)
}

/// The ring of `nodes` (the footprint plays no part in it).
fn ring(nodes: &[&str]) -> Vec<Vec<String>> {
    capacity(nodes, 1 << 20).1
}

/// The largest footprint any of `nodes` measured (the six models are the same size; a
/// node the ring gave no model measured none).
fn measured_footprint(nodes: &[Server]) -> u64 {
    nodes
        .iter()
        .flat_map(|node| {
            let (_, v) = node.get("/admin/models");
            v["models"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["footprint_measured_bytes"].as_u64())
                .collect::<Vec<_>>()
        })
        .max()
        .expect("a node measured a footprint")
}

fn assert_no_failures(what: &str, stats: &Stats) {
    assert_eq!(stats.failures, 0, "{what}: {:?} {:?}", stats.failures_by_kind, stats.failure_messages);
}

#[test]
fn three_two_model_nodes_behind_nginx() {
    let Some(nginx) = nginx_binary() else {
        skip("proxy", "nginx is not installed (`make test` installs Debian's nginx where it can)");
        return;
    };
    // The one-time conversions first (a node's earlier start would have done them).
    let warm_state = std::env::temp_dir().join(format!("snooze-proxy-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&warm_state);
    let _cleanup = StateDirs(warm_state.clone());
    {
        let warm = node("proxy-warm", &config("host_memory_limit = \"2GiB\"\n", ""), &warm_state);
        for i in 1..=MODELS {
            let (status, body, _) = warm.post(&format!("/v2/repository/models/m{i}/load"), &json!({}));
            assert_eq!(status, 200, "m{i}: {body}");
        }
    }

    // 1: three nodes with a budget for two models each, on the ring their ports make.
    let two = config("max_loaded_models = 2\n", "");
    let starts = std::cell::Cell::new(0);
    let start_node = |n: usize| {
        starts.set(starts.get() + 1);
        let tag = format!("n{n}-{}", starts.get());
        node(&format!("proxy-{tag}"), &two, &state_for(&warm_state, &tag))
    };
    let mut nodes: Vec<Server> = (0..3).map(start_node).collect();
    let (routing_miss, predicted_miss) = {
        let three: Vec<&str> = nodes.iter().map(addr).collect();
        let proxy = Nginx::start(&nginx, "three", &three);
        let (served, loads, after) = timed_run(&proxy, &nodes);
        let (predicted, placed) = capacity(&three, measured_footprint(&nodes));
        for i in 1..=MODELS {
            let m = format!("m{i}");
            let homes: Vec<usize> = (0..3).filter(|&n| after[n][&m].0 > 0).collect();
            // One node, and the one nginx's consistent-hash ring names.
            assert_eq!(homes, vec![owner(&placed, &m)], "{m} was loaded on nodes {homes:?}: {after:?}");
        }
        let measured = loads as f64 / served as f64;
        println!(
            "ring as the ports fell: {}; misses {loads} of {served} = {:.1}%, deploy/capacity.py estimates {:.1}%",
            placement(&placed),
            100.0 * measured,
            100.0 * predicted
        );
        (measured, predicted)
    };
    // SnoozeML serves a resident model's queued requests before it swaps, so it misses
    // less than the per-request LRU model says; never much more.
    assert!(
        routing_miss <= predicted_miss + 0.05,
        "measured {routing_miss:.3} vs estimated {predicted_miss:.3}"
    );

    // 2: capacity with the six models spread two per node (a node is restarted on another
    // port until the ring spreads them so): beside one node that holds all six.
    for _ in 0..60 {
        let three: Vec<&str> = nodes.iter().map(addr).collect();
        let Some(crowded) = ring(&three).iter().position(|mine| mine.len() > 2) else { break };
        nodes[crowded] = start_node(crowded);
    }
    let three: Vec<&str> = nodes.iter().map(addr).collect();
    let proxy = Nginx::start(&nginx, "even", &three);
    drive(&proxy.base, 5, 1);
    let (goodput, stats) = drive(&proxy.base, 60, 100);
    assert_no_failures("through nginx, two models per node", &stats);
    println!(
        "two models per node ({}), through nginx: {goodput:.1} req/s, p99 {:?}",
        placement(&ring(&three)),
        stats.percentile(99.0)
    );
    drop(proxy);
    // The same mix on one node that holds all six.
    let one = node("proxy-all", &config("", ""), &state_for(&warm_state, "all"));
    drive(&one.base, 5, 1);
    let (alone, stats) = drive(&one.base, 60, 100);
    assert_no_failures("one node, all resident", &stats);
    println!(
        "one node, all six resident, direct: {alone:.1} req/s; three nodes / one = {:.2}",
        goodput / alone
    );
    drop(one);

    // 3: a fourth node on which no model ever fits answers 503 at once; nginx tries the
    // next node of the ring.
    // Its port decides its place on the ring: restarted until it comes first for a model.
    let refusing_config = config("host_memory_limit = \"256MiB\"\n", "memory = \"100GiB\"\n");
    let refusing_state = state_for(&warm_state, "refusing");
    let owns_one = |s: &Server| {
        let four: Vec<&str> = nodes.iter().map(addr).chain([addr(s)]).collect();
        !ring(&four)[3].is_empty()
    };
    let mut refusing = node("proxy-refusing", &refusing_config, &refusing_state);
    for _ in 0..30 {
        if owns_one(&refusing) {
            break;
        }
        drop(refusing);
        refusing = node("proxy-refusing", &refusing_config, &refusing_state);
    }
    assert!(owns_one(&refusing), "no port put the refusing node first for any model");
    let four: Vec<&str> = nodes.iter().map(addr).chain([addr(&refusing)]).collect();
    let proxy4 = Nginx::start(&nginx, "four", &four);
    let (_, stats) = drive(&proxy4.base, 20, 7);
    assert_no_failures("with a refusing node", &stats);
    let log = proxy4.access_log();
    let failed_over = log
        .lines()
        .filter(|l| l.contains(&format!("{}, ", addr(&refusing))) && l.contains("503, 200"))
        .count();
    assert!(failed_over > 0, "no request went past the refusing node:\n{log}");
    assert!(per_model(&refusing).values().all(|v| v.0 == 0), "nothing loads on the refusing node");
    println!("a node answering 503: {failed_over} requests failed over (nginx log: statuses=503, 200)");

    // 4: SIGKILL a node mid-run, once a sixth of the run is served: its requests go to
    // the next node of the ring; none is lost. The victim is the owner of the hottest
    // model the three nodes hold (not the refusing node), so requests come for it after.
    let four_ring = ring(&four);
    let victim = (1..=MODELS)
        .map(|i| owner(&four_ring, &format!("m{i}")))
        .find(|&n| n < nodes.len())
        .expect("one of the three nodes owns a model");
    let victim_addr = addr(&nodes[victim]).to_string();
    let victim_pid = nodes[victim].child.id();
    const PER_CLIENT: usize = 60;
    let total = CLIENTS * PER_CLIENT;
    let log_path = proxy4.dir.join("access.log");
    let logged = move || std::fs::read_to_string(&log_path).unwrap_or_default().lines().count();
    let before = logged();
    let killer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        while logged() - before < total / 6 {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: kill(2) on a child process of this test.
        unsafe { libc::kill(victim_pid as i32, libc::SIGKILL) };
        Some(logged() - before)
    });
    let (goodput, stats) = drive(&proxy4.base, PER_CLIENT, 300);
    let answered_at_kill =
        killer.join().unwrap().expect("the kill never came: a sixth of the run was not served");
    assert_no_failures("a node killed mid-run", &stats);
    let status = nodes[victim].child.try_wait().unwrap();
    assert_eq!(
        status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)),
        Some(libc::SIGKILL),
        "node {victim} was not killed"
    );
    let log = proxy4.access_log();
    let run: Vec<&str> = log.lines().skip(before).collect();
    assert!(
        run.len() - answered_at_kill >= total / 2,
        "the kill landed late: {answered_at_kill} of {} requests were answered before it",
        run.len()
    );
    let around = format!("upstream={victim_addr}, ");
    let rerouted =
        run[answered_at_kill..].iter().filter(|l| l.contains(&around) && l.ends_with(", 200")).count();
    assert!(
        rerouted > 0,
        "no request after the kill went past the dead node {victim_addr} to another:\n{}",
        run[answered_at_kill..].join("\n")
    );
    println!(
        "node {victim} killed after {answered_at_kill} of {} requests: 0 failures, {rerouted} went past it, \
         {goodput:.1} req/s",
        stats.started
    );
}

/// Removes the warm state folder and every node's folder made from it (`<warm>-<tag>`),
/// when the test ends or panics.
struct StateDirs(PathBuf);

impl Drop for StateDirs {
    fn drop(&mut self) {
        let prefix = self.0.file_name().unwrap().to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == prefix || name.starts_with(&format!("{prefix}-")) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}
