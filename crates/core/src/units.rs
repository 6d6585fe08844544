//! Human sizes (`"512MiB"`, `"6GiB"`, `"80%"`) and durations (`"500ms"`, `"5m"`, `"-1"`).

use std::{fmt, time::Duration};

/// A memory size as a user writes it: absolute bytes or a share of what exists.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemorySize {
    Bytes(u64),
    /// Percent of the total the probe reports (0 < p <= 100).
    Percent(f64),
}

impl MemorySize {
    /// Resolves against `total` bytes.
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            MemorySize::Bytes(b) => b,
            MemorySize::Percent(p) => (total as f64 * p / 100.0) as u64,
        }
    }

    pub fn parse(s: &str) -> Result<MemorySize, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| format!("'{s}' is not a percentage"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!("'{s}' must be a percentage above 0 and at most 100"));
            }
            return Ok(MemorySize::Percent(p));
        }
        parse_bytes(t).map(MemorySize::Bytes)
    }
}

/// Parses `"123"`, `"512MiB"`, `"1.5GB"`, `"64k"`; binary (`KiB`) and decimal (`KB`) units.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("'{s}' is not a size: expected a number with an optional unit like \"512MiB\""));
    }
    let value: f64 = num.parse().map_err(|_| format!("'{s}' is not a size"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "kb" => 1_000,
        "m" | "mib" => 1 << 20,
        "mb" => 1_000_000,
        "g" | "gib" => 1 << 30,
        "gb" => 1_000_000_000,
        "t" | "tib" => 1 << 40,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "'{s}' has an unknown unit '{other}' (use B, KiB, MiB, GiB, TiB, KB, MB, GB)"
            ))
        }
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(format!("'{s}' is too large"));
    }
    Ok(bytes as u64)
}

/// How long an idle model stays loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepAlive {
    /// `-1`: never unload for idleness.
    Forever,
    /// Unload this long after the last request completed (`0` = right after it).
    For(Duration),
}

impl KeepAlive {
    pub fn parse(s: &str) -> Result<KeepAlive, String> {
        if s.trim() == "-1" {
            return Ok(KeepAlive::Forever);
        }
        parse_duration(s).map(KeepAlive::For)
    }
}

impl fmt::Display for KeepAlive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeepAlive::Forever => f.write_str("-1"),
            KeepAlive::For(d) => write!(f, "{}", format_duration(*d)),
        }
    }
}

/// Parses `"0"`, `"500ms"`, `"30s"`, `"5m"`, `"2h"`, `"1m30s"`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("an empty string is not a duration".into());
    }
    if t.starts_with('-') {
        return Err(format!("'{s}' is negative: durations must be 0 or more"));
    }
    if let Ok(secs) = t.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).map_err(|_| format!("'{s}' is not a duration"));
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let n_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (num, tail) = rest.split_at(n_end);
        let u_end = tail.find(|c: char| c.is_ascii_digit()).unwrap_or(tail.len());
        let (unit, next) = tail.split_at(u_end);
        let value: f64 =
            num.parse().map_err(|_| format!("'{s}' is not a duration (e.g. \"500ms\", \"30s\", \"5m\")"))?;
        let secs = match unit {
            "ms" => value / 1000.0,
            "s" => value,
            "m" => value * 60.0,
            "h" => value * 3600.0,
            "d" => value * 86400.0,
            _ => return Err(format!("'{s}' has an unknown unit '{unit}' (use ms, s, m, h, d)")),
        };
        total += Duration::try_from_secs_f64(secs).map_err(|_| format!("'{s}' is not a duration"))?;
        rest = next;
    }
    Ok(total)
}

pub fn format_duration(d: Duration) -> String {
    if d.subsec_millis() != 0 || d.is_zero() {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs())
    }
}

/// `1.5 GiB`-style rendering for messages.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let cases: &[(&str, Result<MemorySize, ()>)] = &[
            ("512MiB", Ok(MemorySize::Bytes(512 << 20))),
            ("6GiB", Ok(MemorySize::Bytes(6 << 30))),
            ("1GB", Ok(MemorySize::Bytes(1_000_000_000))),
            ("1.5k", Ok(MemorySize::Bytes(1536))),
            ("4096", Ok(MemorySize::Bytes(4096))),
            ("80%", Ok(MemorySize::Percent(80.0))),
            ("0%", Err(())),
            ("120%", Err(())),
            ("-5MiB", Err(())),
            ("12 parsecs", Err(())),
            ("", Err(())),
        ];
        for (input, want) in cases {
            assert_eq!(MemorySize::parse(input).map_err(|_| ()), *want, "{input}");
        }
        assert_eq!(MemorySize::Percent(50.0).resolve(1000), 500);
    }

    #[test]
    fn durations() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("0", Some(Duration::ZERO)),
            ("500ms", Some(Duration::from_millis(500))),
            ("30s", Some(Duration::from_secs(30))),
            ("5m", Some(Duration::from_secs(300))),
            ("1m30s", Some(Duration::from_secs(90))),
            ("2h", Some(Duration::from_secs(7200))),
            ("1.5", Some(Duration::from_millis(1500))),
            ("-3s", None),
            ("5 minutes", None),
            ("", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_duration(input).ok(), *want, "{input}");
        }
        assert_eq!(KeepAlive::parse("-1"), Ok(KeepAlive::Forever));
        assert_eq!(KeepAlive::parse("0"), Ok(KeepAlive::For(Duration::ZERO)));
        assert!(KeepAlive::parse("-2").is_err());
    }

    #[test]
    fn byte_formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(100 << 20), "100.0 MiB");
    }
}
