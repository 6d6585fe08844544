//! Memory held by requests in flight: bodies, decoded tensors, the copy kept for an
//! out-of-memory retry. No model footprint covers it, so it gets a budget of its own
//! (`max_inflight_request_bytes`): a request is charged as its bytes arrive and as it
//! decodes them, and past the budget it is refused with 503 + Retry-After instead of
//! pushing the process toward the kernel's OOM killer.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use snooze_core::{units::format_bytes as fb, ErrorKind, SnoozeError};

/// Requests finish in milliseconds: a refused client may come back soon.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// A request whose charge reached this gives the heap back when it ends.
const LARGE_REQUEST: u64 = 1 << 20;

/// Trims asked for within this time of each other are one trim, after the last.
const TRIM_DELAY: Duration = Duration::from_millis(200);

static TRIM_PENDING: AtomicBool = AtomicBool::new(false);

/// Gives the heap a large request left behind back to the OS, soon. glibc keeps the
/// small blocks a request freed (a body's frames) in the arena of the thread that freed
/// them: RSS grew 6-8 MiB over 100 bodies cut off at 8 MiB on 16-32 workers, 0.3-0.9
/// MiB with this trim. (What it cannot return: under glibc's default, rising mmap
/// threshold a large block freed into a worker's arena joins the arena's top, which
/// `malloc_trim` shrinks only in the main arena — +35-45 MiB after 100 bodies of 8 MiB
/// on 32 workers. When memory is bounded, `return_large_blocks` fixes the threshold and
/// that case gives back all but ~1 MiB.) Requests asking within [`TRIM_DELAY`] share
/// one trim, so clients sending megabytes cannot keep a core trimming. Does nothing
/// outside a tokio runtime.
fn trim_heap_soon() {
    if tokio::runtime::Handle::try_current().is_ok() {
        once_after(&TRIM_PENDING, TRIM_DELAY, snooze_core::memory::trim_heap);
    }
}

/// Runs `work` on a blocking thread `delay` from now, unless a run is pending already
/// (`pending` says so): calls within `delay` of the first share its run.
fn once_after(pending: &'static AtomicBool, delay: Duration, work: fn()) {
    if pending.swap(true, Ordering::AcqRel) {
        return;
    }
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        // Cleared first: what is freed during the run asks for the next one.
        pending.store(false, Ordering::Release);
        let _ = tokio::task::spawn_blocking(work).await;
    });
}

/// The shared budget.
#[derive(Debug)]
pub struct RequestMemory {
    limit: u64,
    used: AtomicU64,
}

impl RequestMemory {
    pub fn new(limit: u64) -> Arc<RequestMemory> {
        Arc::new(RequestMemory { limit, used: AtomicU64::new(0) })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes charged to requests in flight now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty charge that grows with the request.
    pub fn charge(self: &Arc<Self>) -> Charge {
        Charge { pool: self.clone(), bytes: 0, peak: 0 }
    }
}

/// What one request is charged; given back when dropped, with the heap trimmed soon
/// after if it ever reached [`LARGE_REQUEST`].
#[derive(Debug)]
pub struct Charge {
    pool: Arc<RequestMemory>,
    bytes: u64,
    peak: u64,
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// 413 when `more` bytes on top of this charge could never fit the budget, even
    /// alone; charges nothing.
    pub fn could_fit(&self, more: u64) -> Result<(), SnoozeError> {
        let (limit, mine) = (self.pool.limit, self.bytes.saturating_add(more));
        if mine > limit {
            return Err(SnoozeError::new(
                ErrorKind::PayloadTooLarge,
                format!(
                    "the request needs {} in memory, more than max_inflight_request_bytes ({}) allows any request",
                    fb(mine),
                    fb(limit)
                ),
            ));
        }
        Ok(())
    }

    /// [`could_fit`](Self::could_fit), and 503 + Retry-After when the requests in flight
    /// leave no room for `more` now; charges nothing (a body declared too large for the
    /// room left is refused before it is sent, not after most of it arrived).
    pub fn fits_now(&self, more: u64) -> Result<(), SnoozeError> {
        self.could_fit(more)?;
        let used = self.pool.used.load(Ordering::Acquire);
        match used.checked_add(more).is_some_and(|total| total <= self.pool.limit) {
            true => Ok(()),
            false => Err(self.no_room(used, more)),
        }
    }

    fn no_room(&self, used: u64, more: u64) -> SnoozeError {
        SnoozeError::new(
            ErrorKind::Overloaded,
            format!(
                "requests in flight hold {} of max_inflight_request_bytes ({}); this one needs {} more",
                fb(used),
                fb(self.pool.limit),
                fb(more)
            ),
        )
        .retry_after(RETRY_AFTER)
    }

    /// Charges `more` bytes, or refuses: 413 when the request alone could never fit the
    /// budget, 503 + Retry-After when the requests in flight leave no room now.
    pub fn grow(&mut self, more: u64) -> Result<(), SnoozeError> {
        self.could_fit(more)?;
        let limit = self.pool.limit;
        let mine = self.bytes.saturating_add(more);
        let taken = self.pool.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(more).filter(|total| *total <= limit)
        });
        match taken {
            Ok(_) => {
                self.bytes = mine;
                self.peak = self.peak.max(mine);
                Ok(())
            }
            Err(used) => Err(self.no_room(used, more)),
        }
    }

    /// Sets the charge to `bytes`: lower always works, higher as [`grow`](Self::grow).
    pub fn set(&mut self, bytes: u64) -> Result<(), SnoozeError> {
        if bytes >= self.bytes {
            return self.grow(bytes - self.bytes);
        }
        self.pool.used.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
        self.bytes = bytes;
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.pool.used.fetch_sub(self.bytes, Ordering::AcqRel);
        // Dropped by the handler after what it read and decoded (declared later, dropped
        // first); the trim waits `TRIM_DELAY` for the answer's own buffers too.
        if self.peak >= LARGE_REQUEST {
            trim_heap_soon();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    static RUNS: AtomicU64 = AtomicU64::new(0);
    static PENDING: AtomicBool = AtomicBool::new(false);

    fn count() {
        RUNS.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits until `RUNS` reaches `n`: the run is on a blocking thread, which the paused
    /// clock does not wait for.
    async fn runs_reach(n: u64) {
        let start = std::time::Instant::now();
        while RUNS.load(Ordering::SeqCst) < n {
            assert!(start.elapsed() < Duration::from_secs(20), "run {n} never came");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn trims_asked_for_together_are_one_and_a_later_ask_gets_its_own() {
        let delay = Duration::from_millis(200);
        for _ in 0..100 {
            once_after(&PENDING, delay, count);
        }
        tokio::time::sleep(delay / 2).await;
        once_after(&PENDING, delay, count);
        assert_eq!(RUNS.load(Ordering::SeqCst), 0, "ran before its delay");
        tokio::time::sleep(delay).await;
        runs_reach(1).await;
        tokio::time::sleep(delay * 5).await;
        assert_eq!(RUNS.load(Ordering::SeqCst), 1, "101 asks within the delay ran more than once");
        // After the run, an ask is not lost: it gets a run of its own.
        once_after(&PENDING, delay, count);
        tokio::time::sleep(delay * 2).await;
        runs_reach(2).await;
    }

    #[test]
    fn charges_add_up_refuse_past_the_limit_and_come_back_on_drop() {
        let pool = RequestMemory::new(100);
        let mut a = pool.charge();
        a.grow(60).unwrap();
        let mut b = pool.charge();
        // A declared size is weighed against the room left, and charged nothing.
        assert_eq!(b.fits_now(50).unwrap_err().kind, ErrorKind::Overloaded);
        assert_eq!(b.fits_now(101).unwrap_err().kind, ErrorKind::PayloadTooLarge);
        b.fits_now(40).unwrap();
        assert_eq!(pool.used(), 60);
        let e = b.grow(50).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Overloaded);
        assert!(e.retry_after.is_some() && e.message.contains("60 B"), "{}", e.message);
        assert_eq!(b.bytes(), 0, "a refused charge takes nothing");
        b.grow(40).unwrap();
        assert_eq!(pool.used(), 100);
        a.set(10).unwrap();
        assert_eq!(pool.used(), 50);
        drop(a);
        drop(b);
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn a_request_bigger_than_the_budget_is_413_not_503() {
        let pool = RequestMemory::new(100);
        let e = pool.charge().grow(101).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PayloadTooLarge);
        assert_eq!(pool.used(), 0);
    }
}
