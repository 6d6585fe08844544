//! The order loads go in (rule 3), and backfilling, its exception for quick models.
//! Loads on a device go one at a time, in order, and the first in line may have to wait:
//! for the room a running job's working set holds, for a busy model's swap delay, for a
//! drain. A model behind it that reloads quickly and can load now, in what is free or by
//! evicting idle models, does not wait behind it. In a trace of the mix at half memory,
//! `mlp-10m` (14 MiB, twenty requests a second) waited 1.6 s while Whisper, first in
//! line, waited for an OCR page's detector pass (~450 MiB) to end, and an idle 100 MiB
//! model stayed resident the whole time.
//!
//! The model in front loses nothing it could use: it loads only when it fits, and what a
//! backfilled model takes it can evict again (the backfilled model is quick to bring
//! back, and serves what waited for it first). A model whose reload is slow waits its
//! turn: it would hold the device, and its room, when the turn of the one in front comes.

use std::{cmp::Reverse, time::Instant};

use super::{plan::Plan, Action, Device, ModelId, ModelSlot, Priority, Scheduler, SlotState, UnloadReason};

/// What loads first: priority, models evicted for it, longest waiting (see `waiting_to_load`).
type LoadKey = (Option<Priority>, bool, Reverse<Option<Instant>>);

impl Scheduler {
    /// The waiting models among `which` on `device`, each with the key it loads by:
    /// highest priority, then one that models were evicted for (the room is its: the model
    /// evicted for it, whose queue may be older, would take it back and starve it), then
    /// longest waiting.
    fn waiting_to_load<'a>(
        &'a self,
        device: &'a Device,
        which: impl Fn(&ModelSlot) -> bool + 'a,
    ) -> impl Iterator<Item = (LoadKey, ModelId)> + 'a {
        self.slots
            .iter()
            .enumerate()
            .filter(move |(_, s)| {
                matches!(s.state, SlotState::Unloaded)
                    && s.wants_load()
                    && s.device() == Some(device)
                    && which(s)
            })
            .map(|(id, s)| {
                let loads = (!s.load_waiters.is_empty()).then_some(Priority::Normal);
                let top = s.queue.top().max(loads);
                ((top, s.evicted_for > 0, Reverse(self.waiting_since(s))), id)
            })
    }

    /// The waiting model among `which` that loads next on `device`. One pass: this runs
    /// at every scheduling step.
    pub(super) fn next_to_load(
        &self,
        device: &Device,
        which: impl Fn(&ModelSlot) -> bool,
    ) -> Option<ModelId> {
        self.waiting_to_load(device, which).max_by_key(|(key, _)| *key).map(|(_, id)| id)
    }

    /// The waiting models among `which` on `device`, in the order they load: the first
    /// is `next_to_load`'s.
    fn load_order(&self, device: &Device, which: impl Fn(&ModelSlot) -> bool) -> Vec<ModelId> {
        let mut waiting: Vec<_> = self.waiting_to_load(device, which).collect();
        // Stable, then reversed: of equal keys the last model comes first (as `max_by_key`).
        waiting.sort_by_key(|(key, _)| *key);
        waiting.into_iter().rev().map(|(_, id)| id).collect()
    }

    /// Starts what `plan` (a `Load` or `Evict` of `model` on `device`) says.
    pub(super) fn start_load(&mut self, model: ModelId, device: &Device, plan: Plan, now: Instant) {
        match plan {
            Plan::Load => {
                let reserved = self.slots[model].admission_bytes().unwrap_or(0);
                self.slots[model].state = SlotState::Loading { device: device.clone(), reserved };
                self.push(Action::StartLoad { model, device: device.clone() });
            }
            Plan::Evict(victims) => {
                for v in victims {
                    tracing::debug!(
                        model = self.slots[v].name(),
                        load = self.slots[model].name(),
                        "evicted: to make room for a load"
                    );
                    // Made room, not recovered from an out-of-memory error: it may come
                    // back when the room is free again (see `preload`).
                    self.slots[v].evicted_at = Some(now);
                    self.slots[model].evicted_for += self.slots[v].resident_bytes();
                    self.begin_unload(v, UnloadReason::Evicted);
                }
            }
            Plan::Wait(_) | Plan::Refuse(_) => debug_assert!(false, "not a load"),
        }
    }

    /// `head`, first in line on `device`, waits (not for a preparation it stopped: that
    /// gives it its room in a moment): the next model in line that reloads quickly and can
    /// load now goes ahead of it.
    pub(super) fn backfill(&mut self, device: &Device, head: ModelId, now: Instant) {
        // Models were evicted for it: the room is its. One going ahead would take that
        // room, the head evict it again, and the two take turns (the memory an eviction
        // returns is often less than the model was accounted at: the head, still short,
        // waits, and a quick model loads into what it freed, over and over).
        if self.slots[head].evicted_for > 0 {
            return;
        }
        let behind = self.load_order(device, |s| s.quick_reload()).into_iter().filter(|m| *m != head);
        for model in behind {
            // Only what is free, or idle models with nothing queued: a model behind the
            // head that waited past its swap delay could otherwise drain a busy one that
            // the head, of higher priority, still lets serve.
            let plan = self.plan(model, device, now);
            let ahead = match &plan {
                Plan::Load => true,
                Plan::Evict(victims) => victims.iter().all(|v| self.slots[*v].queue.is_empty()),
                Plan::Wait(_) | Plan::Refuse(_) => false,
            };
            if ahead {
                tracing::debug!(
                    model = self.slots[model].name(),
                    waiting = self.slots[head].name(),
                    "loading ahead of a model that waits: it reloads quickly and fits now"
                );
                self.start_load(model, device, plan, now);
                return;
            }
        }
    }
}
