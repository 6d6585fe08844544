//! Threads of the idle scheduling class (see `memory::idle_thread`) for the runs of
//! low-priority models, kept for the next run as tokio's blocking pool keeps its threads.
//!
//! A fresh thread for each run took a fresh place in the allocator (glibc gives threads
//! arenas of their own) each time, and what one run freed was not what the next reused:
//! an OCR test's 24-page PDF peaked 50-100 MiB over its 8-page one, against a bound of 48.
//! Kept threads are as many as low-priority runs ever ran at once (bounded by the models'
//! `max_concurrency`); each lowers its priority once, when it starts.

use std::{
    collections::VecDeque,
    sync::{Condvar, Mutex, OnceLock},
};

type Run = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Pool {
    state: Mutex<State>,
    work: Condvar,
}

#[derive(Default)]
struct State {
    queued: VecDeque<Run>,
    /// Threads started (kept for good).
    threads: usize,
    /// Threads inside a run. The others are waiting, or about to look at the queue once
    /// more: either way they take a queued run without a thread of its own.
    running: usize,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Runs `run` on a kept thread of low CPU priority, starting one when every kept thread is
/// busy. Must be called inside a tokio runtime: if no thread can be started, the run goes
/// to the blocking pool, at the process's priority.
pub(crate) fn spawn(run: impl FnOnce() + Send + 'static) {
    POOL.get_or_init(Pool::default).spawn(Box::new(run));
}

impl Pool {
    fn spawn(&'static self, run: Run) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.queued.push_back(run);
        if state.threads - state.running >= state.queued.len() {
            drop(state);
            self.work.notify_one();
            return;
        }
        state.threads += 1;
        drop(state);
        let started = std::thread::Builder::new().name("snooze-run-low".into()).spawn(move || {
            crate::memory::idle_thread();
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(run) = state.queued.pop_front() {
                    state.running += 1;
                    drop(state);
                    run();
                    state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    state.running -= 1;
                    continue;
                }
                state = self.work.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        });
        if let Err(e) = started {
            tracing::warn!(error = %e, "cannot start a low-priority run thread: this run goes to the blocking pool");
            self.state.lock().unwrap_or_else(|p| p.into_inner()).threads -= 1;
            tokio::task::spawn_blocking(move || {
                let run = self.state.lock().unwrap_or_else(|p| p.into_inner()).queued.pop_front();
                if let Some(run) = run {
                    run();
                }
            });
        }
    }

    /// Waits until no kept thread is inside a run (tests: a run that has sent its result
    /// may not have returned yet).
    #[cfg(test)]
    fn wait_until_quiet(&self) {
        while self.state.lock().unwrap_or_else(|p| p.into_inner()).running > 0 {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc, Barrier};

    use super::*;

    #[tokio::test]
    async fn runs_go_to_kept_threads_of_low_priority_and_a_busy_pool_grows() {
        let pool: &'static Pool = Box::leak(Box::default());
        let (tx, rx) = mpsc::channel();
        // Two at once: the second cannot wait for the first (the barrier needs both).
        let both = Arc::new(Barrier::new(2));
        for _ in 0..2 {
            let (tx, both) = (tx.clone(), both.clone());
            pool.spawn(Box::new(move || {
                both.wait();
                tx.send((std::thread::current().id(), crate::memory::thread_nice())).unwrap();
            }));
        }
        let first: Vec<_> = (0..2).map(|_| rx.recv().unwrap()).collect();
        assert_ne!(first[0].0, first[1].0, "two runs at once, two threads");
        // One after another: a kept thread takes each.
        for _ in 0..3 {
            pool.wait_until_quiet();
            let tx = tx.clone();
            pool.spawn(Box::new(move || {
                tx.send((std::thread::current().id(), crate::memory::thread_nice())).unwrap()
            }));
            let (id, nice) = rx.recv().unwrap();
            assert!(first.iter().any(|(t, _)| *t == id), "a run after the others on a kept thread");
            assert!(nice.is_some_and(|n| n >= 10), "nice {nice:?}");
        }
        assert!(first.iter().all(|(_, n)| n.is_some_and(|n| n >= 10)), "{first:?}");
        pool.wait_until_quiet();
        assert_eq!(pool.state.lock().unwrap().threads, 2, "as many threads as runs ever ran at once");
    }
}
