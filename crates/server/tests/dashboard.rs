//! The dashboard at `/`, opened in headless Chromium against the real server: the models
//! table lists every model in its state, the memory timeline carries an eviction marker,
//! its legend names every model without two names running into each other, and the page
//! asks for the admin token when it has none. Saves a screenshot
//! (`SNOOZE_BLESS=1` copies it to docs/dashboard.png for the README).
//!
//! Where no Chromium can be found (`make test` installs Debian's `chromium` where it
//! can) it fails, saying so, unless `SNOOZE_ALLOW_SKIP=dashboard` lets it skip.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use serde_json::json;

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SNOOZE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.is_file())
    })
}

/// Runs headless Chromium on `url` with a fresh profile; its stdout.
fn headless(browser: &Path, profile: &Path, args: &[&str], url: &str) -> String {
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.display()))
        // Timers run on virtual time; network fetches hold it, so the page sees its data.
        .arg("--virtual-time-budget=3000")
        .args(args)
        .arg(url)
        .current_dir(profile)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().expect("reader")
}

#[test]
fn dashboard_shows_models_and_evictions_in_chromium() {
    let Some(browser) = chromium() else {
        skip("dashboard", "no chromium found (install Debian's `chromium`, or set SNOOZE_CHROMIUM)");
        return;
    };
    let dir = models_dir();
    let toml = format!(
        r#"[server]
max_loaded_models = 1
host_memory_limit = "1GiB"
admin_token = "s3cret"
memory_check_interval = "100ms"

[models.m1]
path = "{0}/mlp-100m-1"
weights = "compact"

[models.m2]
path = "{0}/mlp-100m-2"
weights = "compact"

[models.small]
path = "{0}/mlp-10m"

[models.all-minilm-l6-v2-onnx-int8]
path = "{0}/minilm-onnx-int8"

[models.ppocr-text-direction-cls]
path = "{0}/ocr-cls"
"#,
        dir.display()
    );
    let s = Server::start("dashboard", &toml, &[]).with_token("s3cret");

    // The page itself is public and self-contained: no external script or style.
    let page = client().get(s.url("/")).send().expect("GET /");
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"].to_str().expect("csp").to_string();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = page.text().expect("html");
    assert!(
        !html.contains("src=\"http") && !html.contains("href=\"http"),
        "nothing is fetched from elsewhere"
    );

    // m1 loads and serves, then each load evicts the model before it: m2, two with long
    // names (the old legend, drawn at fixed places 110 units apart in the chart, ran
    // `minilm-onnx-int8` into `ocr-cls`; these run over their neighbours by far), and
    // small. Each stays resident a few memory readings (100 ms apart), so the timeline
    // and its legend show every one.
    let r = reference("mlp-100m-1");
    assert_eq!(s.post("/v2/models/m1/infer", &infer_body(&r)).0, 200);
    for model in ["m2", "all-minilm-l6-v2-onnx-int8", "ppocr-text-direction-cls", "small"] {
        std::thread::sleep(Duration::from_millis(400));
        let (status, body, _) = s.post(&format!("/v2/repository/models/{model}/load"), &json!({}));
        assert_eq!(status, 200, "{model}: {body}");
    }
    std::thread::sleep(Duration::from_millis(400));

    let profile = s.dir.join("chromium");
    std::fs::create_dir_all(&profile).expect("profile dir");
    let dom = headless(&browser, &profile, &["--dump-dom"], &s.url("/#token=s3cret"));
    let row = |name: &str| {
        let start = dom
            .find(&format!("<tr data-model=\"{name}\""))
            .unwrap_or_else(|| panic!("no row for {name}: {dom}"));
        &dom[start..start + dom[start..].find("</tr>").expect("row end")]
    };
    assert!(row("m1").contains("data-state=\"unloaded\""), "{}", row("m1"));
    assert!(row("m2").contains("data-state=\"unloaded\""), "{}", row("m2"));
    assert!(
        row("small").contains("data-state=\"ready\"") && row("small").contains(">cpu<"),
        "{}",
        row("small")
    );
    // Measured footprints are shown beside the estimates.
    assert!(row("m1").contains(" MiB</td>"), "{}", row("m1"));
    // The timeline: an eviction marker for each evicted model, load markers, a stacked area.
    for model in ["m1", "m2"] {
        assert!(
            dom.contains(&format!("class=\"marker marker-evicted\" data-model=\"{model}\"")),
            "no eviction marker for {model}: {dom}"
        );
    }
    assert!(dom.contains("class=\"marker marker-loaded\" data-model=\"small\""), "{dom}");
    assert!(dom.contains("class=\"area\" data-model=\"small\""), "{dom}");
    assert!(dom.contains("class=\"rss\""), "{dom}");
    assert!(dom.contains("data-reason=\"evicted\""), "the events list: {dom}");
    // The legend: every model that held memory, and (the page measures its own layout)
    // no two items covering each other.
    let start = dom.find("<ul id=\"legend\"").unwrap_or_else(|| panic!("no legend: {dom}"));
    let legend = &dom[start..start + dom[start..].find("</ul>").expect("legend end")];
    for model in ["m1", "m2", "all-minilm-l6-v2-onnx-int8", "ppocr-text-direction-cls", "small"] {
        assert!(
            legend.contains(&format!("data-model=\"{model}\"")),
            "{model} is not in the legend: {legend}"
        );
    }
    assert!(legend.contains("data-overlapping=\"\""), "legend items run into each other: {legend}");

    // The token was kept in the browser: the same profile without #token still reads.
    let again = headless(&browser, &profile, &["--dump-dom"], &s.url("/"));
    assert!(again.contains("<tr data-model=\"m1\""), "{again}");

    // A fresh browser without the token is told what to do, and shows no data.
    let fresh = s.dir.join("chromium-fresh");
    std::fs::create_dir_all(&fresh).expect("profile dir");
    let denied = headless(&browser, &fresh, &["--dump-dom"], &s.url("/"));
    assert!(denied.contains("needs its admin token"), "{denied}");
    assert!(!denied.contains("<tr data-model="), "{denied}");

    // A screenshot, for people (and the README), not for assertions.
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    headless(
        &browser,
        &profile,
        &["--window-size=1280,760", &format!("--screenshot={}", shot.display())],
        &s.url("/"),
    );
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{} bytes", png.len());
    println!("dashboard screenshot: {}", shot.display());
    if std::env::var_os("SNOOZE_BLESS").is_some() {
        std::fs::write(repo_root().join("docs/dashboard.png"), &png).expect("docs/dashboard.png");
    }
}
