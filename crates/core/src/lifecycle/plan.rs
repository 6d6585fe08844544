//! Loads (rules 3–5 and 10): which waiting model loads next on a device, whether it
//! fits, whom to evict for it — or what to wait for. A decision is typed first; only a
//! refusal is turned into a sentence (`refusal`).
//!
//! Order of loads: highest priority waiting first, then longest waiting. Eviction
//! candidates, from first to last resort: idle models with nothing queued (least
//! recently used first); models with queued work, once the waiting model has waited
//! its swap delay (4x its measured swap cost, at most `max_swap_delay`: then a swap is
//! due: they stop taking work and are evicted when their
//! runs end). Never evicted: pinned models, models still serving the requests that
//! waited for their load, models younger than their `min_residency`.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use crate::{backend::Device, pressure::PressureLevel};

use super::{refusal, Action, ModelId, Scheduler, SlotState};

/// A lean model is promoted only after it stayed this long ...
const PROMOTE_AFTER: std::time::Duration = std::time::Duration::from_millis(500);
/// ... and ran this many batches of several rows.
const PROMOTE_AFTER_BATCHES: u32 = 8;

/// The shortest wait before a swap is due, however cheap the swap.
const MIN_SWAP_DELAY: std::time::Duration = std::time::Duration::from_millis(10);

/// A reload that took at most this long last time is quick: only such models are
/// preloaded, and they may load beside a slow load or a promotion (see `plan_device`).
pub(super) const QUICK_LOAD: std::time::Duration = std::time::Duration::from_millis(100);

pub(super) enum Plan {
    Load,
    /// Unload these first; the model keeps its turn meanwhile.
    Evict(Vec<ModelId>),
    Wait(Wait),
    Refuse(crate::error::SnoozeError),
}

/// What a load that cannot start yet waits for.
pub(super) enum Wait {
    /// These models stop taking work; once their runs end they are evicted.
    Drain(Vec<ModelId>),
    /// Something changes by itself at this instant (a queue's protection ends, a model
    /// grows old enough to evict).
    Until(Instant),
    /// A run, a load or the memory picture must change first.
    Events,
    /// The memory the background preparation holds: it is stopped for the load.
    Preparation,
}

/// How a resident model stands as an eviction candidate.
enum Standing {
    Evictable,
    /// Running now; can be drained.
    Running,
    /// Not before this instant.
    Until(Instant),
    /// Serving the requests that waited for its load.
    Owed,
}

/// The memory picture of a device for one waiting model.
struct Room {
    need: Option<u64>,
    headroom: u64,
    budget_free: u64,
    probe_free: u64,
    resident: usize,
    cap: usize,
    critical: bool,
    already_paid: u64,
}

impl Room {
    /// Whether the model fits once `freed` bytes of `evicted` models are gone.
    fn fits(&self, freed: u64, evicted: usize) -> bool {
        let paid = !self.critical || self.need.is_none_or(|n| freed + self.already_paid >= n);
        let count_ok = self.cap == 0 || self.resident.saturating_sub(evicted) < self.cap;
        let mem_ok = self.need.is_none_or(|n| {
            let n = n.saturating_add(self.headroom);
            n <= self.budget_free.saturating_add(freed) && n <= self.probe_free.saturating_add(freed)
        });
        paid && count_ok && mem_ok
    }
}

impl Scheduler {
    /// Per device: if it is quiet, the next waiting model loads, evicts, or waits; one
    /// that can never fit is refused (or moves to its next device).
    pub(super) fn plan_loads(&mut self, now: Instant) {
        for s in &mut self.slots {
            s.draining = false;
        }
        loop {
            let devices: BTreeSet<Device> = self
                .slots
                .iter()
                .filter(|s| matches!(s.state, SlotState::Unloaded) && s.wants_load())
                .filter_map(|s| s.device().cloned())
                .collect();
            let mut moved = false;
            for device in &devices {
                moved |= self.plan_device(now, device);
            }
            if !moved {
                // Devices nobody waits for may take back a model evicted earlier.
                let idle: Vec<Device> =
                    self.config.budgets.keys().filter(|d| !devices.contains(d)).cloned().collect();
                for device in idle {
                    if !self.slots.iter().any(|s| s.busy_on(&device)) && !self.promote(&device, now) {
                        self.preload(&device);
                    }
                }
                return;
            }
        }
    }

    /// Returns true if a model moved to another device.
    ///
    /// Loads on a device run one at a time, with one exception: a slow load (or a
    /// promotion) does not hold the device for a quick reload. A 7 ms model asked for
    /// while Whisper loads for a second would otherwise wait that second for its turn —
    /// the head-of-line blocking of the mix. Beside a slow load, only a model that
    /// reloaded within `QUICK_LOAD` and whose footprint is known loads, or evicts to load;
    /// anything else it would have to wait for waits for the slow load to end. And while
    /// the first in line waits for room, a quick model behind it may load (`backfill`).
    fn plan_device(&mut self, now: Instant, device: &Device) -> bool {
        loop {
            if self.slots.iter().any(|s| s.busy_on(device) && s.holds_every_load()) {
                return false;
            }
            let beside_slow = self.slots.iter().any(|s| s.busy_on(device));
            let Some(model) = self.next_to_load(device, |s| !beside_slow || s.quick_reload()) else {
                if !beside_slow && !self.promote(device, now) {
                    self.preload(device);
                }
                return false;
            };
            let plan = self.plan(model, device, now);
            match plan {
                Plan::Load | Plan::Evict(_) => {
                    self.start_load(model, device, plan, now);
                    return false;
                }
                Plan::Wait(Wait::Preparation) | Plan::Refuse(_) if beside_slow => return false,
                Plan::Wait(_) if beside_slow => {
                    self.backfill(device, model, now);
                    return false;
                }
                Plan::Wait(wait) => {
                    // What cannot start here now may start on the next device at once.
                    let next = self.device_index(model, device) + 1;
                    let s = &mut self.slots[model];
                    if next < s.policy.devices.len() && s.policy.cpu_fallback {
                        tracing::info!(model = %s.policy.name, from = %device, to = %s.policy.devices[next], "no room now: falling back to the next device");
                        s.device_index = next;
                        return true;
                    }
                    let backfill = !matches!(wait, Wait::Preparation);
                    match wait {
                        Wait::Drain(models) => models.into_iter().for_each(|m| self.slots[m].draining = true),
                        Wait::Until(t) => self.wake_by(t),
                        Wait::Events => {}
                        Wait::Preparation => self.stop_preparation(),
                    }
                    if backfill {
                        self.backfill(device, model, now);
                    }
                    return false;
                }
                Plan::Refuse(err) => {
                    let next = self.device_index(model, device) + 1;
                    let s = &mut self.slots[model];
                    if next < s.policy.devices.len() && s.policy.cpu_fallback {
                        tracing::info!(model = %s.policy.name, from = %device, to = %s.policy.devices[next], reason = %err, "falling back to the next device");
                        s.device_index = next;
                        return true;
                    }
                    s.last_error = Some(err.message.clone());
                    s.evicted_for = 0;
                    self.fail_all(model, err);
                }
            }
        }
    }

    /// With nothing waiting to load on a quiet device, reloads a resident lean model in
    /// its fast form while it keeps serving, once it shows it stays and batches: loaded
    /// at least `PROMOTE_AFTER` ago, `PROMOTE_AFTER_BATCHES` runs of several rows since,
    /// and room for a second instance without evicting anything. Returns true if one
    /// started.
    fn promote(&mut self, device: &Device, now: Instant) -> bool {
        if self.shutting_down {
            return false;
        }
        let candidate = self.slots.iter().enumerate().find(|(_, s)| match &s.state {
            SlotState::Ready { device: d, loaded_at, .. } => {
                d == device
                    && s.policy.promotable
                    && !s.promoted
                    && s.promoting.is_none()
                    && !s.closed()
                    && !s.unload_requested // open only to finish the jobs it waits for
                    && *loaded_at + PROMOTE_AFTER <= now
                    && s.batched_runs >= PROMOTE_AFTER_BATCHES
            }
            _ => false,
        });
        let Some((model, s)) = candidate else { return false };
        let extra = s.resident_bytes();
        let room = self.room(model, device);
        let fits = extra.saturating_add(room.headroom) <= room.budget_free.min(room.probe_free);
        if !fits {
            return false;
        }
        tracing::debug!(
            model = s.name(),
            "promoting: it stays and batches, and there is room for a second instance"
        );
        self.slots[model].promoting = Some(extra);
        self.push(Action::StartPromote { model, device: device.clone() });
        true
    }

    /// With nothing waiting to load, brings back the model most recently asked for among
    /// those evicted to make room — only if it fits now without evicting anything, has
    /// been asked for within its keep-alive, and loads cheaply (a preload holds the
    /// device: a slow one would delay a real load).
    fn preload(&mut self, device: &Device) {
        if self.shutting_down {
            return;
        }
        let now = self.now;
        let candidate = self
            .slots
            .iter()
            .enumerate()
            .filter(|(id, s)| matches!(s.state, SlotState::Unloaded) && self.unreadable[*id].is_none())
            .filter(|(_, s)| s.evicted_at.is_some() && s.policy.devices.first() == Some(device))
            .filter(|(_, s)| s.quick_reload())
            .filter(|(_, s)| {
                let recent = match s.policy.keep_alive {
                    crate::units::KeepAlive::For(d) => d,
                    crate::units::KeepAlive::Forever => std::time::Duration::from_secs(300),
                };
                s.last_request.is_some_and(|t| t + recent > now)
            })
            .max_by_key(|(_, s)| s.last_request)
            .map(|(id, _)| id);
        let Some(model) = candidate else { return };
        // Room it would take from runs about to start: their working sets come first.
        let starting: u64 = self
            .slots
            .iter()
            .filter(|s| s.is_ready() && s.running == 0 && !s.queue.is_empty() && s.device() == Some(device))
            .map(|s| s.working_bytes)
            .sum();
        let mut room = self.room(model, device);
        room.budget_free = room.budget_free.saturating_sub(starting);
        room.probe_free = room.probe_free.saturating_sub(starting);
        if self.slots[model].admission_bytes().is_none() || !room.fits(0, 0) {
            return;
        }
        tracing::debug!(model = self.slots[model].name(), "preloading an evicted model: it fits again");
        self.slots[model].evicted_at = None;
        let reserved = self.slots[model].admission_bytes().unwrap_or(0);
        self.slots[model].state = SlotState::Loading { device: device.clone(), reserved };
        self.push(Action::StartLoad { model, device: device.clone() });
    }

    /// How long `model` lets resident models serve their queues before a swap for it is
    /// due: four times what its swap costs (its last load plus its first run after that
    /// load, as measured), at least 10 ms, at most `max_swap_delay`. A swap that costs
    /// milliseconds (`mapped` weights) is not worth making a request wait 200 ms for; one
    /// that costs a third of a second is.
    pub(super) fn swap_delay(&self, model: ModelId) -> std::time::Duration {
        let s = &self.slots[model];
        let cap = self.config.max_swap_delay;
        match (s.last_load, s.first_run) {
            (Some(load), Some(run)) => ((load + run) * 4).clamp(MIN_SWAP_DELAY.min(cap), cap),
            _ => cap,
        }
    }

    pub(super) fn waiting_since(&self, s: &super::ModelSlot) -> Option<Instant> {
        s.queue.oldest().into_iter().chain(s.load_waiters.iter().map(|(_, t)| *t)).min()
    }

    fn room(&self, model: ModelId, device: &Device) -> Room {
        let resident = self
            .slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Loading { .. } | SlotState::Ready { .. }))
            .count();
        // Loaded for requests, it runs at once: room for its working set too, as far as
        // the budget can ever give it (a working set larger than that still runs).
        let s = &self.slots[model];
        let best = self.best_room(device).saturating_sub(self.config.headroom);
        let need = s.admission_bytes().map(|load| {
            let running = s.resident_bytes().saturating_add(s.working_bytes).min(best);
            load.max(running)
        });
        Room {
            need,
            headroom: self.config.headroom,
            budget_free: self.budget(device).saturating_sub(self.accounted(device)),
            probe_free: self.probe_free(device),
            resident,
            cap: self.config.max_loaded_models,
            critical: self.pressure >= PressureLevel::Critical,
            already_paid: self.slots[model].evicted_for,
        }
    }

    /// What the budget can give models other than the pinned ones, at most.
    fn best_room(&self, device: &Device) -> u64 {
        let baseline = self.config.baselines.get(device).copied().unwrap_or(0);
        let pinned: u64 =
            self.slots.iter().filter(|s| s.policy.pinned).filter_map(|s| s.held_on(device)).sum();
        self.budget(device).saturating_sub(baseline + pinned)
    }

    pub(super) fn plan(&self, model: ModelId, device: &Device, now: Instant) -> Plan {
        let room = self.room(model, device);
        let cap = self.config.max_loaded_models;
        if cap > 0 {
            let pinned_in: Vec<&str> = self
                .slots
                .iter()
                .enumerate()
                .filter(|(id, s)| *id != model && s.policy.pinned)
                .filter(|(_, s)| matches!(s.state, SlotState::Loading { .. } | SlotState::Ready { .. }))
                .map(|(_, s)| s.name())
                .collect();
            if pinned_in.len() >= cap {
                return Plan::Refuse(refusal::no_slot_ever(
                    self.slots[model].name(),
                    cap,
                    &pinned_in,
                    self.config.retry_after,
                ));
            }
        }
        let baseline = self.config.baselines.get(device).copied().unwrap_or(0);
        let pinned: u64 =
            self.slots.iter().filter(|s| s.policy.pinned).filter_map(|s| s.held_on(device)).sum();
        if let Some(n) = self.slots[model].admission_bytes() {
            let best = self.best_room(device);
            if n.saturating_add(room.headroom) > best {
                let name = self.slots[model].name();
                return Plan::Refuse(refusal::never_fits(
                    name,
                    device,
                    n,
                    self.slots[model].admission_source(),
                    room.headroom,
                    self.budget(device),
                    baseline,
                    pinned,
                    self.config.retry_after,
                ));
            }
        } else if room.fits(0, 0) {
            tracing::warn!(
                model = self.slots[model].name(),
                "footprint cannot be determined: loading without the memory guard"
            );
        }
        if room.fits(0, 0) {
            return Plan::Load;
        }
        let overdue =
            self.waiting_since(&self.slots[model]).is_some_and(|t| t + self.swap_delay(model) <= now);
        let mut freed = 0;
        let mut chosen = Vec::new();
        let mut drain = Vec::new();
        let mut drain_bytes = 0;
        let mut until: Option<Instant> = None;
        for (id, standing) in self.candidates(device, model, now, overdue) {
            let bytes = self.slots[id].resident_bytes();
            match standing {
                Standing::Evictable => {
                    freed += bytes;
                    chosen.push(id);
                    if room.fits(freed, chosen.len()) {
                        let bytes = |id: ModelId| self.slots[id].resident_bytes();
                        Self::spare_the_unneeded(&mut chosen, freed, bytes, |freed, n| room.fits(freed, n));
                        return Plan::Evict(chosen);
                    }
                }
                Standing::Running if overdue => {
                    drain_bytes += bytes;
                    drain.push(id);
                }
                Standing::Running | Standing::Owed => {}
                Standing::Until(t) => until = Some(until.map_or(t, |u| u.min(t))),
            }
        }
        // One-time work never keeps a request waiting: a quiet host's preparation is
        // stopped rather than a busy model drained or the load delayed.
        let yielding = self.yielding_bytes(device);
        if yielding > 0 && room.fits(freed + yielding, chosen.len()) {
            return Plan::Wait(Wait::Preparation);
        }
        if !drain.is_empty() && room.fits(freed + drain_bytes, chosen.len() + drain.len()) {
            // Start freeing what is idle now; the busy ones stop taking work meanwhile.
            return if chosen.is_empty() { Plan::Wait(Wait::Drain(drain)) } else { Plan::Evict(chosen) };
        }
        if let Some(t) = until {
            return Plan::Wait(Wait::Until(t));
        }
        Plan::Wait(Wait::Events)
    }

    /// Takes back from `chosen` (victims in eviction order, `freed` bytes together, which
    /// `covers`) every one the others cover without, the worthiest first. Taken in order,
    /// the last victim is the one that made room, and it may be large enough that an
    /// earlier one was not needed: in the mix, a 14 MiB model asked for ten times a second
    /// went with a 100 MiB one and Whisper for a load the two of those alone made room
    /// for, and its next requests waited for its reload.
    pub(super) fn spare_the_unneeded(
        chosen: &mut Vec<ModelId>,
        mut freed: u64,
        bytes: impl Fn(ModelId) -> u64,
        covers: impl Fn(u64, usize) -> bool,
    ) {
        for i in (0..chosen.len().saturating_sub(1)).rev() {
            let b = bytes(chosen[i]);
            if covers(freed.saturating_sub(b), chosen.len() - 1) {
                freed = freed.saturating_sub(b);
                chosen.remove(i);
            }
        }
    }

    /// The victims among `candidates` (in eviction order) whose `bytes` reach `need`:
    /// taken in order until they do, less those the others cover without
    /// ([`Scheduler::spare_the_unneeded`]); all of them when together they fall short.
    pub(super) fn cover(candidates: Vec<ModelId>, need: u64, bytes: impl Fn(ModelId) -> u64) -> Vec<ModelId> {
        let mut freed = 0u64;
        let mut chosen = Vec::new();
        for v in candidates {
            if freed >= need {
                break;
            }
            freed = freed.saturating_add(bytes(v));
            chosen.push(v);
        }
        if freed >= need {
            Self::spare_the_unneeded(&mut chosen, freed, bytes, |f, _| f >= need);
        }
        chosen
    }

    /// Resident, unpinned models on `device` other than `except`, in eviction order:
    /// evictable ones with nothing queued first, then least recently used.
    fn candidates(
        &self,
        device: &Device,
        except: ModelId,
        now: Instant,
        overdue: bool,
    ) -> Vec<(ModelId, Standing)> {
        let since = self.waiting_since(&self.slots[except]);
        let behind = self.slots[except].last_load.unwrap_or_default();
        let mut v: Vec<(bool, f64, Instant, ModelId, Standing)> = Vec::new();
        for (id, s) in self.slots.iter().enumerate() {
            let SlotState::Ready { device: d, loaded_at, last_used, .. } = &s.state else { continue };
            if id == except || s.policy.pinned || d != device {
                continue;
            }
            // A model with work is swapped out only once the waiting one has waited what
            // the swap costs either of them: a model that loads in 2 ms does not throw out,
            // after 10 ms, one that takes half a second to come back for its job.
            let swap_at = since.map(|t| t + self.swap_delay(except).max(self.swap_delay(id)));
            let overdue = overdue && swap_at.is_some_and(|t| t <= now);
            let old_at = *loaded_at + s.policy.min_residency;
            let standing = if old_at > now {
                Standing::Until(old_at)
            } else if s.owed.min(s.queue.len()) > 0 || s.promoting.is_some() {
                Standing::Owed
            } else if s.running > 0 && overdue {
                Standing::Running
            } else if s.running > 0 {
                Standing::Until(swap_at.unwrap_or(now))
            } else if s.queue.is_empty() || overdue {
                Standing::Evictable
            } else {
                Standing::Until(swap_at.unwrap_or(now))
            };
            v.push((!s.queue.is_empty(), self.keep_value(id, now, behind), *last_used, id, standing));
        }
        v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)));
        v.into_iter().map(|(_, _, _, id, st)| (id, st)).collect()
    }

    /// What keeping a resident model is worth, per byte it holds: how often it is asked
    /// for times what bringing it back would cost (its last load plus the first run
    /// after it; 100 ms until measured) — GreedyDual-Size-Frequency's ratio. The model
    /// worth least is evicted first: a 100 MiB model that reloads in 2 ms before a 14 MiB
    /// one asked for 20 times a second, or a Whisper that takes half a second to come
    /// back. How often: the time since it was last used, or, when shorter, its last two
    /// requests over the time since the first of them — so a model no longer asked for
    /// loses its worth, and among models of equal cost and size the least recently used
    /// goes first.
    ///
    /// `behind`: the load the room is made for, as long as it took last time. A model
    /// asked for more often than that load takes would be asked for again while it runs:
    /// evicting it buys a reload and another eviction in the middle of that load (and,
    /// should its reload not be quick, a wait for the whole load). For that load, a 7 ms
    /// reload of a model asked for ten times a second is priced at Whisper's ~850 ms.
    pub(super) fn keep_value(&self, id: ModelId, now: Instant, behind: Duration) -> f64 {
        let s = &self.slots[id];
        let SlotState::Ready { last_used, .. } = s.state else { return 0.0 };
        let since = |t: Instant| now.saturating_duration_since(t);
        let interval = match s.previous_request {
            Some(p) => (since(p) / 2).min(since(last_used)),
            None => since(last_used),
        };
        let load = s.last_load.map(|l| if interval < behind { l.max(behind) } else { l });
        let interval = interval.as_secs_f64().max(1e-3);
        let cost = match (load, s.first_run) {
            (Some(load), Some(run)) => (load + run).as_secs_f64(),
            (Some(load), None) => load.as_secs_f64(),
            _ => 0.1,
        };
        let mib = (s.resident_bytes() as f64 / 1048576.0).max(1.0);
        cost.max(1e-4) / (interval * mib)
    }

    /// Idle, unpinned models on `device` other than `except`, the one worth least first
    /// (see `keep_value`; for holding the budget and the out-of-memory retry of a load:
    /// of `except`'s, when it is a model). Models younger than their `min_residency`
    /// stay out.
    pub(super) fn idle_by_worth(&self, device: &Device, except: ModelId, now: Instant) -> Vec<ModelId> {
        self.idle_in_worth_order(device, except, now, false)
    }

    /// [`Scheduler::idle_by_worth`], with the models younger than their `min_residency`
    /// too when `young_too` (a memory emergency does not wait for them).
    pub(super) fn idle_in_worth_order(
        &self,
        device: &Device,
        except: ModelId,
        now: Instant,
        young_too: bool,
    ) -> Vec<ModelId> {
        let behind = self.slots.get(except).and_then(|s| s.last_load).unwrap_or_default();
        let mut v: Vec<(f64, Instant, ModelId)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(id, s)| *id != except && !s.policy.pinned && s.device() == Some(device))
            .filter(|(_, s)| match s.state {
                SlotState::Ready { loaded_at, .. } => young_too || loaded_at + s.policy.min_residency <= now,
                _ => false,
            })
            .filter_map(|(id, s)| Some((self.keep_value(id, now, behind), s.idle()?, id)))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        v.into_iter().map(|(_, _, id)| id).collect()
    }
}
