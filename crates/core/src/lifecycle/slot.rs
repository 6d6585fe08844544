//! One model's slot: its policy, where it is in its lifecycle, and its history.

use std::time::{Duration, Instant};

use crate::{backend::Device, units::KeepAlive};

use super::{RequestId, UnloadReason};

/// Per-model settings the scheduler obeys.
#[derive(Debug, Clone)]
pub struct ModelPolicy {
    pub name: String,
    /// Preference order; never empty.
    pub devices: Vec<Device>,
    /// Try the next device when one cannot take the model even after eviction.
    pub cpu_fallback: bool,
    /// The user's word on the footprint; wins over everything measured or estimated.
    pub memory: Option<u64>,
    /// The backend's figures from the files: steady and load-time peak.
    pub estimate_steady: Option<u64>,
    pub estimate_peak: Option<u64>,
    pub keep_alive: KeepAlive,
    pub min_residency: Duration,
    /// Never evicted nor unloaded for idleness.
    pub pinned: bool,
}

impl ModelPolicy {
    /// A CPU model with the server defaults; tests and the shell adjust fields.
    pub fn new(name: impl Into<String>) -> ModelPolicy {
        ModelPolicy {
            name: name.into(),
            devices: vec![Device::Cpu],
            cpu_fallback: true,
            memory: None,
            estimate_steady: None,
            estimate_peak: None,
            keep_alive: KeepAlive::For(Duration::from_secs(300)),
            min_residency: Duration::from_secs(10),
            pinned: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waiter {
    /// Wants a lease.
    Lease(RequestId),
    /// Wants the model loaded, no lease.
    Load(RequestId),
}

impl Waiter {
    pub(super) fn req(self) -> RequestId {
        match self {
            Waiter::Lease(r) | Waiter::Load(r) => r,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum SlotState {
    Unloaded,
    /// Waiting in a device queue for its turn (or for evictions to finish).
    Queued {
        device_index: usize,
    },
    /// `reserved`: bytes held against the budget while the load runs (its peak).
    Loading {
        device: Device,
        reserved: u64,
    },
    Ready {
        device: Device,
        leases: u32,
        last_used: Instant,
        loaded_at: Instant,
        footprint: u64,
    },
    Unloading {
        device: Device,
        footprint: u64,
        reason: UnloadReason,
    },
    /// The last load failed (not for memory); refused until `until`.
    Failed {
        until: Instant,
        error: String,
    },
}

/// The state's name as the admin API shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateName {
    Unloaded,
    Loading,
    Ready,
    Unloading,
    Failed,
}

#[derive(Debug)]
pub struct ModelSlot {
    pub policy: ModelPolicy,
    pub state: SlotState,
    pub(super) waiters: Vec<Waiter>,
    pub(super) unload_waiters: Vec<RequestId>,
    /// An unload was asked for while requests held the model: no new lease is granted
    /// until it is done (new requests wait, then reload it).
    pub(super) unload_requested: bool,
    /// The backend panicked during an inference: no new lease is granted, the model is
    /// unloaded once its leases end and then backs off like a failed load.
    pub(super) poisoned: Option<String>,
    /// Panics since the model last served and left memory normally; sets the backoff.
    pub(super) panics: u32,
    /// Measured on the last load of this process.
    pub measured_bytes: Option<u64>,
    pub measured_peak_bytes: Option<u64>,
    /// Measured on an earlier load (possibly an earlier run); preferred to the estimate.
    pub learned_bytes: Option<u64>,
    pub learned_peak_bytes: Option<u64>,
    pub loads: u64,
    pub evictions: u64,
    pub(super) failures: u32,
    /// Bytes evicted to make room for this model's pending load.
    pub(super) evicted_for: u64,
    pub last_load: Option<Duration>,
    pub last_error: Option<String>,
}

impl ModelSlot {
    pub(super) fn new(policy: ModelPolicy) -> ModelSlot {
        ModelSlot {
            policy,
            state: SlotState::Unloaded,
            waiters: Vec::new(),
            unload_waiters: Vec::new(),
            unload_requested: false,
            poisoned: None,
            panics: 0,
            measured_bytes: None,
            measured_peak_bytes: None,
            learned_bytes: None,
            learned_peak_bytes: None,
            loads: 0,
            evictions: 0,
            failures: 0,
            evicted_for: 0,
            last_load: None,
            last_error: None,
        }
    }

    /// Bytes to find free before loading: the load-time peak when known.
    pub fn admission_bytes(&self) -> Option<u64> {
        // The user's word, else what was measured, else what the files suggest; of a
        // source, the larger of its load peak and its resident figure.
        let larger = |a: Option<u64>, b: Option<u64>| a.max(b);
        self.policy
            .memory
            .or(larger(self.learned_peak_bytes, self.learned_bytes))
            .or(larger(self.policy.estimate_peak, self.policy.estimate_steady))
    }

    /// Bytes the model holds once loaded.
    pub fn resident_bytes(&self) -> u64 {
        self.policy
            .memory
            .or(self.measured_bytes)
            .or(self.learned_bytes)
            .or(self.policy.estimate_steady)
            .unwrap_or(0)
    }

    pub fn name(&self) -> &str {
        &self.policy.name
    }

    pub fn state_name(&self) -> StateName {
        match self.state {
            SlotState::Unloaded => StateName::Unloaded,
            SlotState::Queued { .. } | SlotState::Loading { .. } => StateName::Loading,
            SlotState::Ready { .. } => StateName::Ready,
            SlotState::Unloading { .. } => StateName::Unloading,
            SlotState::Failed { .. } => StateName::Failed,
        }
    }

    /// The device the model is on (or loading to).
    pub fn device(&self) -> Option<&Device> {
        match &self.state {
            SlotState::Loading { device, .. }
            | SlotState::Ready { device, .. }
            | SlotState::Unloading { device, .. } => Some(device),
            SlotState::Queued { device_index } => self.policy.devices.get(*device_index),
            SlotState::Unloaded | SlotState::Failed { .. } => None,
        }
    }

    /// Bytes held against `device`'s budget.
    pub(super) fn held_on(&self, on: &Device) -> Option<u64> {
        match &self.state {
            SlotState::Loading { device, reserved } if device == on => Some(*reserved),
            SlotState::Ready { device, footprint, .. } | SlotState::Unloading { device, footprint, .. }
                if device == on =>
            {
                Some(*footprint)
            }
            _ => None,
        }
    }

    /// Loading or unloading on `device`: the device is not quiet.
    pub(super) fn busy_on(&self, on: &Device) -> bool {
        matches!(&self.state, SlotState::Loading { device, .. } | SlotState::Unloading { device, .. } if device == on)
    }

    /// `Some(last_used)` when ready with no leases.
    pub fn idle(&self) -> Option<Instant> {
        match self.state {
            SlotState::Ready { leases: 0, last_used, .. } => Some(last_used),
            _ => None,
        }
    }

    pub fn leases(&self) -> u32 {
        match self.state {
            SlotState::Ready { leases, .. } => leases,
            _ => 0,
        }
    }

    /// Ready, but a pending unload or a panic means no new lease may be granted.
    pub(super) fn closed_to_new_leases(&self) -> bool {
        self.unload_requested || self.poisoned.is_some()
    }

    /// When keep-alive will unload it, if it is idle, not pinned and keep-alive is finite.
    pub fn idle_deadline(&self) -> Option<Instant> {
        let last_used = self.idle()?;
        match self.policy.keep_alive {
            KeepAlive::For(d) if !self.policy.pinned => Some(last_used + d),
            _ => None,
        }
    }

    pub(super) fn status(&self, now: Instant) -> ModelStatus {
        let (last_used, loaded_at) = match self.state {
            SlotState::Ready { last_used, loaded_at, .. } => (Some(last_used), Some(loaded_at)),
            _ => (None, None),
        };
        let ago = |t: Instant| now.saturating_duration_since(t);
        ModelStatus {
            name: self.policy.name.clone(),
            state: self.state_name(),
            device: self.device().map(|d| d.to_string()),
            footprint_estimated_bytes: self.policy.memory.or(self.policy.estimate_steady),
            footprint_peak_estimated_bytes: self.policy.memory.or(self.policy.estimate_peak),
            footprint_measured_bytes: self.measured_bytes.or(self.learned_bytes),
            footprint_peak_measured_bytes: self.measured_peak_bytes.or(self.learned_peak_bytes),
            leases: self.leases(),
            last_used_ago: last_used.map(ago),
            loaded_ago: loaded_at.map(ago),
            unload_in: self.idle_deadline().map(|d| d.saturating_duration_since(now)),
            loads: self.loads,
            evictions: self.evictions,
            last_load: self.last_load,
            last_error: self.last_error.clone(),
            pinned: self.policy.pinned,
        }
    }
}

/// What the admin view shows of a model (times relative to `now`; the shell turns them
/// into wall-clock stamps).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelStatus {
    pub name: String,
    pub state: StateName,
    pub device: Option<String>,
    pub footprint_estimated_bytes: Option<u64>,
    pub footprint_peak_estimated_bytes: Option<u64>,
    pub footprint_measured_bytes: Option<u64>,
    pub footprint_peak_measured_bytes: Option<u64>,
    pub leases: u32,
    pub last_used_ago: Option<Duration>,
    pub loaded_ago: Option<Duration>,
    pub unload_in: Option<Duration>,
    pub loads: u64,
    pub evictions: u64,
    pub last_load: Option<Duration>,
    pub last_error: Option<String>,
    pub pinned: bool,
}
