//! Who may call what.
//!
//! Two separate secrets, compared in constant time:
//! - **API keys** (`api_keys`, `api_keys_file`): when any is set, every inference
//!   endpoint — KServe REST and gRPC (metadata, inference, the repository index), the
//!   OpenAI routes — needs `Authorization: Bearer <key>` (what the OpenAI SDK sends
//!   for its `api_key`; tritonclient sends it as a header / gRPC metadata). Health and
//!   readiness stay open, for probes and load balancers. The file is re-read on SIGHUP,
//!   so keys rotate without a restart.
//! - **The admin token** (`admin_token`): when set, every endpoint that changes what is
//!   loaded (repository load/unload, gc) and every admin read that reveals internals
//!   (`/admin/*`: file paths, `/proc` figures, the memory dump; `/metrics`) needs it.
//!
//! Without them the endpoints are open, which is only safe on a loopback address: the
//! server says so at start and in `/admin/memory/stats` when it listens anywhere else.
//! The checks take the `Authorization` value as text, whichever transport carried it.

use std::{path::PathBuf, sync::RwLock};

use snooze_core::{ErrorKind, SnoozeError};

use crate::config::ServerSettings;

/// `Ok` when no admin token is set or `authorization` carries it.
pub fn check_admin(token: Option<&str>, authorization: Option<&str>) -> Result<(), SnoozeError> {
    let Some(token) = token else { return Ok(()) };
    match authorization.and_then(bearer) {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(SnoozeError::new(ErrorKind::Unauthorized, "the admin token is wrong")),
        None => Err(SnoozeError::new(
            ErrorKind::Unauthorized,
            "this admin endpoint needs 'Authorization: Bearer <admin_token>'",
        )),
    }
}

/// The API keys in force: from `api_keys` and `api_keys_file` (re-read by [`ApiKeys::reload`]).
#[derive(Debug)]
pub struct ApiKeys {
    inline: Vec<String>,
    file: Option<PathBuf>,
    keys: RwLock<Vec<String>>,
}

impl ApiKeys {
    /// The keys of `api_keys` and `api_keys_file` (read now; `snooze check` and the
    /// start validate that it can be read).
    pub fn from_settings(s: &ServerSettings) -> ApiKeys {
        let inline = s.api_keys.as_deref().map(split_keys).unwrap_or_default();
        let keys = ApiKeys { inline, file: s.api_keys_file.clone(), keys: RwLock::new(Vec::new()) };
        if let Err(e) = keys.reload() {
            tracing::error!("{e}");
        }
        keys
    }

    /// Whether any key is required.
    pub fn enabled(&self) -> bool {
        self.file.is_some() || !self.inline.is_empty()
    }

    /// Reads `api_keys_file` again; on an error the keys in force stay as they were.
    /// Returns how many keys are in force.
    pub fn reload(&self) -> Result<usize, String> {
        let mut keys = self.inline.clone();
        if let Some(path) = &self.file {
            keys.extend(read_keys_file(path)?);
        }
        let n = keys.len();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        Ok(n)
    }

    /// `Ok` when no key is required or `authorization` carries one of them. Every key is
    /// compared, each in time that depends only on the given value's length.
    pub fn check(&self, authorization: Option<&str>) -> Result<(), SnoozeError> {
        if !self.enabled() {
            return Ok(());
        }
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        match authorization.and_then(bearer) {
            Some(given) => {
                let ok = keys.iter().fold(false, |ok, k| ok | same_secret(given.as_bytes(), k.as_bytes()));
                if ok {
                    Ok(())
                } else {
                    Err(SnoozeError::new(ErrorKind::Unauthorized, "the API key is wrong"))
                }
            }
            None => Err(SnoozeError::new(
                ErrorKind::Unauthorized,
                "this endpoint needs an API key: 'Authorization: Bearer <key>' (api_keys)",
            )),
        }
    }
}

/// Keys of `api_keys`: comma-separated, spaces around them ignored.
fn split_keys(text: &str) -> Vec<String> {
    text.split(',').map(str::trim).filter(|k| !k.is_empty()).map(String::from).collect()
}

/// One key per line; blank lines and `#` comments ignored. A file that names no key
/// is an error: it would lock every client out, which is never what was meant.
pub fn read_keys_file(path: &std::path::Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read api_keys_file {}: {e}", path.display()))?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    if keys.is_empty() {
        return Err(format!("api_keys_file {} holds no key (one per line)", path.display()));
    }
    Ok(keys)
}

/// The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 7235).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim()).filter(|t| !t.is_empty())
}

/// Compares in time that depends only on the length of `given`, which the caller
/// knows anyway: neither the secret's bytes nor its length leak through timing.
fn same_secret(given: &[u8], secret: &[u8]) -> bool {
    if secret.is_empty() {
        return false;
    }
    let mut diff = u64::from(given.len() != secret.len());
    for (i, g) in given.iter().enumerate() {
        diff |= u64::from(g ^ secret[i % secret.len()]);
    }
    diff == 0
}

/// Whether `address` can only be reached from this machine.
pub fn is_loopback(address: &str) -> bool {
    address.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_loopback())
}

/// The warnings of [`exposure_warning`] for each listener: HTTP, and gRPC unless `off`
/// (its repository and inference calls take the same tokens).
pub fn exposure_warnings(http: &str, grpc: &str, admin_token: bool, api_keys: bool) -> Vec<String> {
    let listeners = [Some(http), (grpc != "off").then_some(grpc)];
    listeners.into_iter().flatten().filter_map(|a| exposure_warning(a, admin_token, api_keys)).collect()
}

/// The warning for endpoints left open on a reachable address, if it applies: naming
/// what is open (the admin API without `admin_token`, inference without `api_keys`).
pub fn exposure_warning(address: &str, admin_token: bool, api_keys: bool) -> Option<String> {
    if is_loopback(address) || (admin_token && api_keys) {
        return None;
    }
    let mut open = Vec::new();
    if !admin_token {
        open.push(
            "the admin API is open (anyone who can reach it can load, unload and garbage-collect models and \
             read /admin/*: file paths, memory figures): set admin_token (or SNOOZE_ADMIN_TOKEN)",
        );
    }
    if !api_keys {
        open.push(
            "inference is open (anyone who can reach it can run every model): set api_keys (or \
             SNOOZE_API_KEYS, or api_keys_file)",
        );
    }
    Some(format!("the server listens on {address}, beyond loopback: {}", open.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let t = Some("s3cret");
        assert!(check_admin(t, Some("Bearer s3cret")).is_ok());
        assert!(check_admin(t, Some("bearer s3cret")).is_ok());
        assert!(check_admin(t, Some("BEARER   s3cret ")).is_ok());
        for bad in ["Bearer s3cre", "Bearer s3cret!", "Bearer S3CRET", "Basic s3cret", "s3cret", "Bearer", ""]
        {
            let e = check_admin(t, Some(bad)).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unauthorized, "{bad:?}");
        }
        assert!(check_admin(t, None).is_err());
        assert!(check_admin(None, None).is_ok(), "no token set: open");
    }

    #[test]
    fn secrets_compare_by_content_and_length() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abcabc", b"abc"), "a repeated secret is not the secret");
        assert!(!same_secret(b"ab", b"abc"));
        assert!(!same_secret(b"", b"abc"));
        assert!(!same_secret(b"", b""));
    }

    fn keys(inline: &[&str]) -> ApiKeys {
        let inline: Vec<String> = inline.iter().map(|k| k.to_string()).collect();
        ApiKeys { keys: RwLock::new(inline.clone()), inline, file: None }
    }

    #[test]
    fn any_configured_key_opens_and_nothing_else_does() {
        let k = keys(&["k1", "second-key"]);
        assert!(k.check(Some("Bearer k1")).is_ok());
        assert!(k.check(Some("Bearer second-key")).is_ok());
        for bad in [Some("Bearer k2"), Some("Bearer k1x"), Some("k1"), Some("Bearer "), None] {
            let e = k.check(bad).map(|_| "open").unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unauthorized, "{bad:?}");
        }
        assert!(keys(&[]).check(None).is_ok(), "no key configured: open");
        assert_eq!(split_keys(" a, b ,,c "), ["a", "b", "c"]);
    }

    #[test]
    fn a_keys_file_is_read_again_on_reload_and_a_bad_one_keeps_the_old_keys() {
        let dir = std::env::temp_dir().join(format!("snooze-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys");
        std::fs::write(&path, "# rotated weekly\nold-key\n").unwrap();
        let k =
            ApiKeys { inline: vec!["inline".into()], file: Some(path.clone()), keys: RwLock::new(vec![]) };
        assert_eq!(k.reload(), Ok(2));
        assert!(k.check(Some("Bearer old-key")).is_ok() && k.check(Some("Bearer inline")).is_ok());
        std::fs::write(&path, "new-key\n").unwrap();
        assert_eq!(k.reload(), Ok(2));
        assert!(k.check(Some("Bearer old-key")).is_err(), "rotated out");
        assert!(k.check(Some("Bearer new-key")).is_ok());
        std::fs::write(&path, "\n# nothing\n").unwrap();
        assert!(k.reload().unwrap_err().contains("holds no key"));
        assert!(k.check(Some("Bearer new-key")).is_ok(), "a bad file keeps the keys in force");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_what_is_open_beyond_loopback_is_named() {
        assert!(exposure_warning("127.0.0.1:8080", false, false).is_none());
        assert!(exposure_warning("[::1]:8080", false, false).is_none());
        assert!(exposure_warning("0.0.0.0:8080", true, true).is_none());
        // gRPC beyond loopback is as open as HTTP; `off` listens nowhere.
        let w = exposure_warnings("127.0.0.1:8080", "0.0.0.0:8081", false, false);
        assert!(w.len() == 1 && w[0].contains("0.0.0.0:8081"), "{w:?}");
        assert!(exposure_warnings("127.0.0.1:8080", "off", false, false).is_empty());
        assert_eq!(exposure_warnings("0.0.0.0:8080", "0.0.0.0:8081", false, true).len(), 2);
        let w = exposure_warning("0.0.0.0:8080", false, true).unwrap_or_default();
        assert!(w.contains("0.0.0.0:8080") && w.contains("admin_token") && !w.contains("api_keys"), "{w}");
        let w = exposure_warning("0.0.0.0:8080", true, false).unwrap_or_default();
        assert!(w.contains("api_keys") && !w.contains("admin_token"), "{w}");
        let w = exposure_warning("0.0.0.0:8080", false, false).unwrap_or_default();
        assert!(w.contains("api_keys") && w.contains("admin_token"), "{w}");
    }
}
