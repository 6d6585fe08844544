//! Runtime threads at a lower CPU priority, for the sessions of long work.
//!
//! Every session draws on the environment's one intra-op pool, whose threads run at the
//! process's priority. A model of low CPU priority (`LoadSpec::low_cpu_priority`: a
//! transcription's or an OCR page's stages) gets a pool of its own instead, as wide as the
//! shared one and as spinning, whose threads go to the idle scheduling class (at nice 10;
//! see `snooze_core::memory::idle_thread`) before they take work. The scheduler runs such
//! a model's batches on a thread that does the same, so the whole run yields the cores to
//! the short requests of other models whenever they want them, and takes every core while
//! they do not.

use std::thread::JoinHandle;

use ort::{environment::ThreadManager, session::builder::SessionBuilder};
use snooze_core::LoadSpec;

use crate::ThreadPool;

/// Starts a session pool's threads, each going to the idle scheduling class first.
struct LowPriority;

impl ThreadManager for LowPriority {
    type Thread = JoinHandle<()>;

    fn create(&self, work: impl FnOnce() + Send + 'static) -> ort::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("snooze-ort-low".into())
            .spawn(move || {
                snooze_core::memory::idle_thread();
                work();
            })
            .map_err(|e| ort::Error::new(format!("cannot start a runtime thread: {e}")))
    }

    fn join(thread: JoinHandle<()>) -> ort::Result<()> {
        thread.join().map_err(|_| ort::Error::new("a runtime thread panicked"))
    }
}

/// `builder` with the threads `spec` asks for: the environment's shared pool, or, for a
/// model of low CPU priority, a pool of its own of low-priority threads, as wide as the
/// spec says (else as the shared `pool`) and spinning as `pool` does. The error is the
/// runtime's message.
pub(crate) fn with_threads(
    builder: SessionBuilder,
    spec: &LoadSpec,
    pool: ThreadPool,
) -> Result<SessionBuilder, String> {
    if !spec.low_cpu_priority {
        return Ok(builder);
    }
    let message = |e: ort::Error<SessionBuilder>| e.message().to_string();
    let mut builder = builder.with_independent_thread_pool().map_err(message)?;
    builder = builder.with_inter_threads(1).map_err(message)?;
    // 0: the runtime's default, one per core, as the shared pool's.
    let width = if spec.intra_op_threads > 0 { spec.intra_op_threads } else { pool.intra_op_threads };
    if width > 0 {
        builder = builder.with_intra_threads(width).map_err(message)?;
    }
    builder = builder.with_intra_op_spinning(pool.spinning).map_err(message)?;
    builder.with_thread_manager(LowPriority).map_err(message)
}
