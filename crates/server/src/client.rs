//! `snooze` as a client of a running server: `ps`, `load`, `unload`, `gc`, `stats`,
//! `top`. Everything comes from the admin API, so what the CLI shows is what the
//! dashboard and `/metrics` show.

use std::{
    fmt::Write as _,
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context};
use serde_json::Value;
use snooze_core::units::format_bytes;

/// Where the server is and how to authenticate.
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::blocking::Client,
}

impl Client {
    pub fn new(url: &str, token: Option<String>) -> anyhow::Result<Client> {
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(150)).build()?;
        Ok(Client {
            base: url.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.is_empty()),
            http,
        })
    }

    fn send(&self, req: reqwest::blocking::RequestBuilder) -> anyhow::Result<Value> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let resp = req.send().map_err(|e| {
            let why = if e.is_connect() { "connection refused".to_string() } else { e.to_string() };
            anyhow::anyhow!(
                "cannot reach the server at {}: {why} (is `snooze serve` running? set --url or SNOOZE_URL)",
                self.base
            )
        })?;
        let status = resp.status();
        let body: Value = resp.json().unwrap_or(Value::Null);
        if status.as_u16() == 401 {
            match self.token {
                None => bail!("the server needs its admin token: pass --token or set SNOOZE_ADMIN_TOKEN"),
                Some(_) => bail!(
                    "the server refused the token (--token / SNOOZE_ADMIN_TOKEN): it is not the server's \
                     admin_token (an API key does not open the admin API)"
                ),
            }
        }
        if !status.is_success() {
            let msg = body["error"].as_str().map_or_else(|| body.to_string(), str::to_string);
            bail!("the server answered {status}: {msg}");
        }
        Ok(body)
    }

    pub fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.send(self.http.get(format!("{}{path}", self.base)))
    }

    pub fn post(&self, path: &str) -> anyhow::Result<Value> {
        self.send(
            self.http
                .post(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .body("{}"),
        )
    }
}

/// `2026-11-29T11:12:13.456Z` (what the admin API writes) → whole seconds from `now`
/// (negative: in the past).
fn seconds_from_now(stamp: &str, now: SystemTime) -> Option<i64> {
    let then = humantime::parse_rfc3339(stamp).ok()?;
    match then.duration_since(now) {
        Ok(ahead) => i64::try_from(ahead.as_secs()).ok(),
        Err(behind) => i64::try_from(behind.duration().as_secs()).ok().map(|s| -s),
    }
}

fn human(secs: i64) -> String {
    let s = secs.unsigned_abs();
    let text = match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    };
    if secs < 0 {
        format!("{text} ago")
    } else {
        format!("in {text}")
    }
}

fn bytes(v: &Value) -> String {
    v.as_u64().map_or("-".into(), format_bytes)
}

/// The `ps` table: one line per model, like `ollama ps`.
pub fn ps_table(models: &Value, now: SystemTime) -> String {
    let mut rows = vec![[
        "NAME".to_string(),
        "STATE".into(),
        "DEVICE".into(),
        "MEMORY (est/measured)".into(),
        "LEASES".into(),
        "QUEUED".into(),
        "UNTIL".into(),
    ]];
    for m in models["models"].as_array().into_iter().flatten() {
        let queued: u64 =
            ["high", "normal", "low"].iter().map(|k| m["queued"][k].as_u64().unwrap_or(0)).sum();
        let until = match (m["state"].as_str(), m["unload_at"].as_str()) {
            (Some("ready"), Some(t)) => seconds_from_now(t, now).map_or("-".into(), human),
            // No unload time: pinned, busy (the idle clock starts when its work ends), or
            // kept forever.
            (Some("ready"), None) => {
                if m["pinned"] == true {
                    "pinned".into()
                } else if m["leases"].as_u64().unwrap_or(0) > 0 || queued > 0 {
                    "in use".into()
                } else {
                    "forever".into()
                }
            }
            _ => "-".into(),
        };
        rows.push([
            m["name"].as_str().unwrap_or("?").to_string(),
            m["state"].as_str().unwrap_or("?").to_string(),
            m["device"].as_str().unwrap_or("-").to_string(),
            format!("{} / {}", bytes(&m["footprint_estimated_bytes"]), bytes(&m["footprint_measured_bytes"])),
            m["leases"].as_u64().unwrap_or(0).to_string(),
            queued.to_string(),
            until,
        ]);
    }
    let widths: Vec<usize> =
        (0..7).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

/// The memory summary of `stats` and `top`.
pub fn stats_text(stats: &Value) -> String {
    let mut out = String::new();
    for d in stats["devices"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{}: budget {}, process {}, accounted {}, available {}, level {}",
            d["device"].as_str().unwrap_or("?"),
            bytes(&d["budget_bytes"]),
            bytes(&d["process_bytes"]),
            bytes(&d["accounted_bytes"]),
            bytes(&d["available_bytes"]),
            d["level"].as_str().unwrap_or("-"),
        );
    }
    let inflight = &stats["requests_in_flight"];
    if inflight.is_object() {
        let _ = writeln!(
            out,
            "requests in flight: {} of {}",
            bytes(&inflight["bytes"]),
            bytes(&inflight["limit_bytes"])
        );
    }
    for a in stats["alerts"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "alert: {}", a["message"].as_str().unwrap_or("?"));
    }
    for r in stats["recommendations"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "advice: {}", r.as_str().unwrap_or("?"));
    }
    out
}

pub fn ps(c: &Client, json: bool) -> anyhow::Result<()> {
    let models = c.get("/admin/models")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&models["models"])?);
    } else {
        print!("{}", ps_table(&models, SystemTime::now()));
    }
    Ok(())
}

pub fn load(c: &Client, name: &str) -> anyhow::Result<()> {
    c.post(&format!("/v2/repository/models/{name}/load")).with_context(|| format!("loading '{name}'"))?;
    println!("{name}: loaded");
    Ok(())
}

pub fn unload(c: &Client, name: &str) -> anyhow::Result<()> {
    c.post(&format!("/v2/repository/models/{name}/unload")).with_context(|| format!("unloading '{name}'"))?;
    println!("{name}: unloaded");
    Ok(())
}

pub fn gc(c: &Client) -> anyhow::Result<()> {
    let r = c.post("/admin/memory/gc")?;
    let models: Vec<&str> =
        r["models_unloaded"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    println!(
        "unloaded {} model(s){}{}; {} returned to the OS",
        models.len(),
        if models.is_empty() { "" } else { ": " },
        models.join(", "),
        bytes(&r["freed_bytes"])
    );
    Ok(())
}

pub fn stats(c: &Client, json: bool) -> anyhow::Result<()> {
    let s = c.get("/admin/memory/stats")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", stats_text(&s));
    }
    Ok(())
}

/// Refreshes the memory summary and the models table every second until interrupted.
pub fn top(c: &Client) -> anyhow::Result<()> {
    loop {
        let stats = c.get("/admin/memory/stats")?;
        let models = c.get("/admin/models")?;
        // Clear the screen and go home, then draw.
        print!("\x1b[2J\x1b[H{}\n{}", stats_text(&stats), ps_table(&models, SystemTime::now()));
        use std::io::Write;
        std::io::stdout().flush()?;
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stamps_read_back_as_whole_seconds_from_now() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_950_733); // 2026-11-29T11:12:13Z
        assert_eq!(seconds_from_now("2026-11-29T11:16:13.000Z", now), Some(240));
        assert_eq!(seconds_from_now("2026-11-29T11:11:13.500Z", now), Some(-59));
        assert_eq!(seconds_from_now("2000-02-29T00:00:00.000Z", now), Some(951_782_400 - 1_795_950_733));
        let written = crate::rest::admin::rfc3339(now + Duration::from_millis(90_250));
        assert_eq!(seconds_from_now(&written, now), Some(90), "{written}");
        for bad in ["", "2026-11-29", "2026-13-01T00:00:00Z", "yesterday"] {
            assert_eq!(seconds_from_now(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn ps_lists_every_model_with_its_memory_and_deadline() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_950_733);
        let models = json!({"models": [
            {"name": "a", "state": "ready", "device": "cpu", "footprint_estimated_bytes": 131_072_000u64,
             "footprint_measured_bytes": 104_857_600u64, "leases": 1, "queued": {"high": 0, "normal": 2, "low": 1},
             "unload_at": "2026-11-29T11:16:13.000Z", "pinned": false},
            {"name": "b", "state": "unloaded", "device": null, "footprint_estimated_bytes": 1024, "leases": 0,
             "queued": {"high": 0, "normal": 0, "low": 0}, "unload_at": null},
            // Running, so no unload time yet (the idle clock starts when its work ends).
            {"name": "c", "state": "ready", "device": "cpu", "leases": 1,
             "queued": {"high": 0, "normal": 0, "low": 0}, "unload_at": null, "pinned": false},
            {"name": "d", "state": "ready", "device": "cpu", "leases": 0,
             "queued": {"high": 0, "normal": 0, "low": 0}, "unload_at": null, "pinned": false},
        ]});
        let t = ps_table(&models, now);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAME") && lines[0].contains("UNTIL"), "{t}");
        assert!(
            lines[1].contains("125.0 MiB / 100.0 MiB")
                && lines[1].contains("in 4m00s")
                && lines[1].contains(" 3 "),
            "{t}"
        );
        assert!(lines[2].contains("unloaded") && lines[2].contains("1.0 KiB / -"), "{t}");
        assert!(lines[3].contains("in use") && lines[4].contains("forever"), "{t}");
    }
}
