//! Refusals as sentences a user can act on: what was needed, what there was, and when
//! to come back. The decisions are made elsewhere; only the wording lives here.

use std::time::Duration;

use crate::{
    backend::Device,
    error::{ErrorKind, SnoozeError},
    units::format_bytes as fb,
};

/// Retry-After is sent in whole seconds: never advise less than one.
fn at_least_a_second(d: Duration) -> Duration {
    d.max(Duration::from_secs(1))
}

/// Where a footprint came from, for a refusal to say what to do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FootprintSource {
    /// The model's `memory` setting.
    Configured,
    /// Measured on a load or a run (now or before a restart).
    Measured,
    /// Estimated from the model's files: never loaded, so never measured.
    Estimated,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn never_fits(
    name: &str,
    device: &Device,
    need: u64,
    source: FootprintSource,
    headroom: u64,
    budget: u64,
    baseline: u64,
    pinned: u64,
    retry_after: Duration,
) -> SnoozeError {
    let what = match source {
        FootprintSource::Configured => "footprint, its `memory` setting",
        FootprintSource::Measured => "footprint as measured",
        FootprintSource::Estimated => "footprint estimated from its files",
    };
    // An estimate is all a model never loaded has, and a refusal on it is never lifted
    // by a measurement: the operator who knows better is told how to say so.
    let fix = match source {
        FootprintSource::Estimated => {
            "raise host_memory_limit, or, if the model needs less than estimated, set `memory` in its table"
        }
        FootprintSource::Configured => "raise host_memory_limit or lower the model's `memory`",
        FootprintSource::Measured => "raise host_memory_limit",
    };
    SnoozeError::new(
        ErrorKind::InsufficientMemory,
        format!(
            "model '{name}' needs {} on {device} ({what} {} + headroom {}), more than the budget can ever \
             give it: {} budget - {} server baseline - {} pinned models = {} free at best; {fix}",
            fb(need.saturating_add(headroom)),
            fb(need),
            fb(headroom),
            fb(budget),
            fb(baseline),
            fb(pinned),
            fb(budget.saturating_sub(baseline + pinned)),
        ),
    )
    .retry_after(retry_after)
}

/// `max_loaded_models` is taken by pinned models, which are never evicted.
pub(super) fn no_slot_ever(name: &str, cap: usize, pinned: &[&str], retry_after: Duration) -> SnoozeError {
    SnoozeError::new(
        ErrorKind::InsufficientMemory,
        format!(
            "model '{name}' can never load: max_loaded_models = {cap} is taken by pinned models ({}), \
             which are never evicted; raise max_loaded_models or unpin one",
            pinned.join(", ")
        ),
    )
    .retry_after(retry_after)
}

pub(super) fn queue_full(name: &str, max_queue: usize, wait: Duration) -> SnoozeError {
    SnoozeError::new(
        ErrorKind::QueueFull,
        format!(
            "model '{name}' has {max_queue} requests waiting (max_queue); retry in about {:.1}s",
            wait.as_secs_f64()
        ),
    )
    .retry_after(at_least_a_second(wait))
}

pub(super) fn queue_timeout(name: &str, timeout: Duration, wait: Duration) -> SnoozeError {
    SnoozeError::new(
        ErrorKind::Overloaded,
        format!(
            "the request for model '{name}' waited queue_timeout ({}) without running (the model was \
             waiting for memory or busy); retry in about {:.1}s",
            crate::units::format_duration(timeout),
            wait.as_secs_f64()
        ),
    )
    .retry_after(at_least_a_second(wait))
}

pub(super) fn low_priority_under_pressure(retry_after: Duration) -> SnoozeError {
    SnoozeError::new(
        ErrorKind::InsufficientMemory,
        "memory pressure is critical: low-priority requests are refused until it eases",
    )
    .retry_after(retry_after)
}

pub(super) fn out_of_memory(name: &str, why: &str, msg: &str, retry_after: Duration) -> SnoozeError {
    SnoozeError::new(
        ErrorKind::InsufficientMemory,
        format!("model '{name}' ran out of memory during inference {why}: {msg}"),
    )
    .retry_after(retry_after)
}
