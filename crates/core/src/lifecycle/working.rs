//! Working sets (issue 21's mix): what a run holds at its peak and gives back when it
//! ends — activations, an encoder's attention — is held against the budget while the
//! run is in flight. A model's largest measured run is what is held for work that says
//! nothing of its size; work that does ([`WorkSize`]: a page's pixels, a decoder step's
//! hypotheses) is held at the bytes per unit its class measured, so a transcription's
//! hundred decoder steps do not hold the room of its encoder pass, nor a small page the
//! room of an A4 one.

use super::*;
use slot::ModelSlot;

/// The longest a slice of long work waits for another model's slice to end rather than
/// evict idle models (see [`Scheduler::slice_waits`]): longer than the slowest slice of
/// the mix (a detector pass over a 3-megapixel input: ~1.9 s on 2 cores).
pub(super) const SLICE_WAIT: Duration = Duration::from_millis(2500);

/// A run in flight: what it holds against the budget, and whether it is a slice of long
/// work (a task job's).
#[derive(Debug, Clone, Copy)]
pub(super) struct RunHold {
    pub first: RequestId,
    pub bytes: u64,
    pub slice: bool,
}

impl ModelSlot {
    /// What a run of work of these sizes is expected to hold at its peak: what its
    /// class's measured runs bound it by (until one is measured, the work's own prior
    /// per unit), or the model's largest run when a piece of it says nothing of its size,
    /// or its class was never measured and it has no prior.
    pub(super) fn reservation(&self, sizes: impl IntoIterator<Item = Option<WorkSize>>) -> u64 {
        let mut total = 0u64;
        for size in sizes {
            let Some(size) = size else { return self.working_bytes };
            let measured = self.curve(size.class).map(|c| c.predict(size.units));
            let prior = (size.prior_bytes_per_unit > 0)
                .then(|| (f64::from(size.prior_bytes_per_unit) * size.units as f64).ceil() as u64);
            let Some(bytes) = measured.or(prior) else { return self.working_bytes };
            total = total.saturating_add(bytes);
        }
        total
    }

    fn curve(&self, class: u8) -> Option<&SizeCurve> {
        self.working_curves.iter().find(|(c, _)| *c == class).map(|(_, curve)| curve)
    }

    /// Slices of long work it runs now.
    pub(super) fn slices_running(&self) -> usize {
        self.reserved.iter().filter(|r| r.slice).count()
    }

    /// The run of `reqs` ended: what was held for it is free again.
    pub(super) fn release_reservation(&mut self, reqs: &[RequestId]) {
        if let Some(i) = self.reserved.iter().position(|r| reqs.contains(&r.first)) {
            self.reserved.swap_remove(i);
        }
        if self.running == 0 {
            self.reserved.clear();
        }
    }
}

impl Scheduler {
    /// A run of `model` held `transient` bytes at its peak and gave them back: its
    /// working set, held against the budget while it runs, is the largest such run —
    /// the first one measured replaces what the backend declared (unless the config
    /// fixed its memory). Returns the working set when it changed.
    pub fn learn_transient(&mut self, model: ModelId, transient: u64) -> Option<u64> {
        let s = &mut self.slots[model];
        if s.policy.memory.is_some() || (s.working_measured && transient <= s.working_bytes) {
            return None;
        }
        let before = s.working_bytes;
        s.working_bytes = if s.working_measured { before.max(transient) } else { transient };
        s.working_measured = true;
        (s.working_bytes != before).then_some(s.working_bytes)
    }

    /// The run of `reqs` (still in flight) on `model` held `transient` bytes at its
    /// peak: when all of its work said its size, in one class, that class's curve
    /// learns it ([`SizeCurve`]). Returns the class and the run's bytes per unit when
    /// the curve changed.
    pub fn learn_sized(&mut self, model: ModelId, transient: u64, reqs: &[RequestId]) -> Option<(u8, f64)> {
        if self.slots[model].policy.memory.is_some() {
            return None;
        }
        let mut class = None;
        let mut units = 0u64;
        for r in reqs {
            let (m, _, q) = self.in_flight.get(r)?;
            let size = q.size.filter(|_| *m == model)?;
            if class.is_some_and(|c| c != size.class) {
                return None; // a batch of two kinds says nothing of either
            }
            class = Some(size.class);
            units = units.saturating_add(size.units);
        }
        let (class, units) = (class?, units.max(1));
        let s = &mut self.slots[model];
        let changed = match s.working_curves.iter_mut().find(|(c, _)| *c == class) {
            Some((_, curve)) => curve.learn(units, transient),
            None => {
                let mut curve = SizeCurve::default();
                curve.learn(units, transient);
                s.working_curves.push((class, curve));
                true
            }
        };
        changed.then_some((class, transient as f64 / units as f64))
    }

    /// What a run of `model`'s next work would hold, when it is a run that may wait for
    /// memory at all: the model is resident and runs nothing now, and the working set
    /// expected of the request at the head of its queue is beyond the headroom.
    fn may_wait(&self, model: ModelId) -> Option<(&Device, &Queued, u64)> {
        let s = &self.slots[model];
        let (device, head) = (s.device()?, s.queue.head()?);
        let working = s.reservation([head.size]);
        (s.running == 0 && working > self.config.headroom).then_some((device, head, working))
    }

    /// A run whose working set fits neither in what is free nor in what evicting the
    /// idle models would free waits while another model's working set is in use: the
    /// two run one after the other (as they would share the cores anyway) rather than
    /// side by side at the cost of every idle model. With no other working set in use
    /// it runs; `hold_budgets` then evicts what idle models it must. Nor does a working
    /// set within the headroom wait — the slack the budget keeps for what it does not
    /// account: a classifier's few megabytes would otherwise wait out a whole
    /// transcription whenever the jobs in flight hold the budget, and every light model
    /// with them (the mix's seconds-long stalls of every light task at once). The
    /// working set is the one expected of the request at the head of its queue.
    pub(super) fn waits_for_memory(&self, model: ModelId) -> bool {
        let Some((device, _, working)) = self.may_wait(model) else { return false };
        let others_working =
            self.slots.iter().any(|o| o.working_reserved() > 0 && o.device() == Some(device));
        if !others_working {
            return false;
        }
        let idle: u64 = self
            .slots
            .iter()
            .filter(|o| o.idle().is_some() && !o.policy.pinned)
            .filter_map(|o| o.held_on(device))
            .sum();
        let staying = self.accounted(device).saturating_sub(self.leaving(device) + idle);
        working.saturating_add(self.config.headroom) > self.budget(device).saturating_sub(staying)
    }

    /// A slice of long work (a task job's: a page's detection, an encoder pass) waits
    /// sooner than `waits_for_memory` says: while another model runs a slice, for as long
    /// as its working set does not fit in what is free without evicting anything — at
    /// most [`SLICE_WAIT`] from when it was queued, so long work beside long work is not
    /// starved either. Long jobs side by side only share the cores, and the idle models
    /// their working sets evicted were the light ones asked for between them: in the mix
    /// at half its memory, a page's detector (450 MiB for a small crop read at 736 px)
    /// beside a transcription's encoder pass evicted every model, and each light request
    /// then waited for its model's room until the page ended. When the other slice ends,
    /// this one runs and evicts what it must, the model worth least first. Returns until
    /// when it waits.
    pub(super) fn slice_waits(&self, model: ModelId, now: Instant) -> Option<Instant> {
        let (device, head, working) = self.may_wait(model)?;
        let until = head.since + SLICE_WAIT;
        if head.size.is_none() || now >= until {
            return None;
        }
        let others_slicing = self
            .slots
            .iter()
            .enumerate()
            .any(|(id, o)| id != model && o.slices_running() > 0 && o.device() == Some(device));
        let in_place = self.accounted(device).saturating_sub(self.leaving(device));
        let free = self.budget(device).saturating_sub(in_place);
        (others_slicing && working.saturating_add(self.config.headroom) > free).then_some(until)
    }
}

/// The most runs of one class of work held at their peak, by the size of their work
/// (a page's pixels, a decoder step's hypotheses): measured points kept monotone (more
/// units never hold less) and the highest bytes per unit any run measured. A size is
/// predicted at the smallest of what bounds it from above, on two assumptions that
/// hold for activations (a fixed part plus a part that grows with the input): a larger
/// input never holds less, and holds no more per unit than a smaller one. So a size is
/// bounded by the nearest measured size above it and by the nearest below it scaled
/// up — not by the highest rate times its size, which held a 4128 x 736 detector input
/// at 600 MiB after a letter-size page's 198 B/px when it took 447 MiB (154 B/px), and
/// evicted idle models for the 150 MiB it never used. Below every measured size, the
/// highest rate (what was held before these bounds).
#[derive(Debug, Clone, Default)]
pub(super) struct SizeCurve {
    /// (units, bytes), by units; bytes never fall as units grow.
    points: Vec<(u64, u64)>,
    max_rate: f64,
}

impl SizeCurve {
    /// Points kept: past this the closer of two neighbours (by ratio) goes, its bound
    /// taken by the larger one (a prediction can only grow).
    const POINTS: usize = 16;

    /// Learns that a run of `units` held `bytes`; whether any prediction changed.
    pub(super) fn learn(&mut self, units: u64, bytes: u64) -> bool {
        let units = units.max(1);
        let rate = bytes as f64 / units as f64;
        let mut changed = rate > self.max_rate;
        self.max_rate = self.max_rate.max(rate);
        let at = self.points.partition_point(|&(u, _)| u < units);
        // A smaller size that held more bounds this one from below.
        let floor = self.points[..at].last().map_or(0, |&(_, b)| b);
        let bytes = bytes.max(floor);
        match self.points.get_mut(at) {
            Some((u, b)) if *u == units => {
                if bytes > *b {
                    *b = bytes;
                    changed = true;
                }
            }
            _ => {
                self.points.insert(at, (units, bytes));
                changed = true;
            }
        }
        for (_, b) in &mut self.points[at..] {
            if *b < bytes {
                *b = bytes;
                changed = true;
            }
        }
        if self.points.len() > Self::POINTS {
            let closest = (1..self.points.len())
                .min_by(|&i, &j| {
                    let ratio = |k: usize| self.points[k].0 as f64 / self.points[k - 1].0 as f64;
                    ratio(i).total_cmp(&ratio(j))
                })
                .unwrap_or(1);
            self.points.remove(closest - 1);
        }
        changed
    }

    #[cfg(test)]
    pub(super) fn points(&self) -> &[(u64, u64)] {
        &self.points
    }

    /// What a run of `units` is expected to hold at its peak.
    pub(super) fn predict(&self, units: u64) -> u64 {
        let at = self.points.partition_point(|&(u, _)| u < units);
        let above = self.points.get(at).map(|&(_, b)| b);
        let below = match self.points.get(at) {
            Some(&(u, b)) if u == units => Some(b),
            _ => at.checked_sub(1).map(|i| {
                let (u, b) = self.points[i];
                (b as f64 * units as f64 / u as f64).ceil() as u64
            }),
        };
        let scaled = (self.max_rate * units as f64).ceil() as u64;
        [above, below.or(Some(scaled))].into_iter().flatten().min().unwrap_or(scaled)
    }
}
