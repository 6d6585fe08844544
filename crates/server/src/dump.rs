//! `snooze dump diff A.json B.json`: what grew between two `/admin/memory/dump`s.

use std::collections::BTreeMap;

use serde_json::Value;

/// Every number in `v` by its path; arrays of objects with a `name` are keyed by name
/// so a model keeps its path when others come and go.
pub fn flatten(v: &Value) -> BTreeMap<String, f64> {
    fn walk(path: String, v: &Value, out: &mut BTreeMap<String, f64>) {
        match v {
            Value::Number(n) => {
                if let Some(f) = n.as_f64() {
                    out.insert(path, f);
                }
            }
            Value::Object(map) => {
                for (k, v) in map {
                    walk(if path.is_empty() { k.clone() } else { format!("{path}.{k}") }, v, out);
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let key = item.get("name").and_then(Value::as_str).map_or(i.to_string(), str::to_string);
                    walk(format!("{path}[{key}]"), item, out);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    walk(String::new(), v, &mut out);
    out
}

/// Rows `(path, before, after)` for every number that changed, largest growth first.
pub fn diff(a: &Value, b: &Value) -> Vec<(String, Option<f64>, Option<f64>)> {
    let (fa, fb) = (flatten(a), flatten(b));
    let mut rows: Vec<(String, Option<f64>, Option<f64>)> = fa
        .keys()
        .chain(fb.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|k| !k.starts_with("pressure.history"))
        .map(|k| (k.clone(), fa.get(k).copied(), fb.get(k).copied()))
        .filter(|(_, x, y)| x != y)
        .collect();
    let growth = |r: &(String, Option<f64>, Option<f64>)| r.2.unwrap_or(0.0) - r.1.unwrap_or(0.0);
    rows.sort_by(|x, y| growth(y).total_cmp(&growth(x)));
    rows
}

/// The table `snooze dump diff` prints.
pub fn render(rows: &[(String, Option<f64>, Option<f64>)]) -> String {
    let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v}"));
    let mut out = format!("{:<60} {:>16} {:>16} {:>16}\n", "what", "before", "after", "change");
    for (path, a, b) in rows {
        let delta = b.unwrap_or(0.0) - a.unwrap_or(0.0);
        let human =
            if path.ends_with("bytes") || path.starts_with("process.V") || path.starts_with("process.Rss") {
                format!(
                    " ({}{})",
                    if delta < 0.0 { "-" } else { "+" },
                    snooze_core::units::format_bytes(delta.abs() as u64)
                )
            } else {
                String::new()
            };
        out += &format!("{path:<60} {:>16} {:>16} {:>+16}{human}\n", show(*a), show(*b), delta);
    }
    if rows.is_empty() {
        out += "no differences\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn diff_keys_models_by_name_and_sorts_by_growth() {
        let a = json!({"process": {"VmRSS": 100}, "models": [{"name": "x", "leases": 0}, {"name": "y", "loads": 1}]});
        let b = json!({"process": {"VmRSS": 300}, "models": [{"name": "y", "loads": 2}, {"name": "x", "leases": 0}]});
        let rows = diff(&a, &b);
        assert_eq!(rows[0], ("process.VmRSS".to_string(), Some(100.0), Some(300.0)));
        assert_eq!(rows[1], ("models[y].loads".to_string(), Some(1.0), Some(2.0)));
        assert_eq!(rows.len(), 2, "unchanged x is not listed");
        assert!(render(&rows).contains("+200"));
        assert!(render(&[]).contains("no differences"));
    }
}
