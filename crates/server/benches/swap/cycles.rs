//! Phase 6. of the swap benchmark, in the parent process: `SNOOZE_SWAP_CYCLES` load /
//! one run / drop / `trim_heap` cycles of one model, rotating through the three
//! profiles, for the RSS they leave behind and the time they take.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::anyhow;
use snooze_backend_ort::OrtBackend;
use snooze_core::{Backend, Weights};

use crate::{onnx_file, ort_copy, report::ms, rss_parts_mib, spec, warm_page_cache, Input, MODEL};

pub(crate) struct Cycles {
    pub(crate) n: usize,
    pub(crate) rss_before: f64,
    pub(crate) rss_after: f64,
    pub(crate) took: Duration,
    /// Mean cycle time per profile, ms: prepacked, compact, mapped.
    pub(crate) mean_ms: [f64; 3],
}

pub(crate) fn load_cycles(
    backend: &OrtBackend,
    models: &Path,
    cache: &Path,
    n: usize,
) -> anyhow::Result<Cycles> {
    const ROTATION: [Weights; 3] = [Weights::Prepacked, Weights::Compact, Weights::Mapped];
    let one = Input::rows(1);
    warm_page_cache(&[onnx_file(models, MODEL)?, ort_copy(cache, MODEL)?])?;
    let cycle = |w: Weights| -> anyhow::Result<()> {
        let m = backend.load(&spec(models, MODEL, w)).map_err(|e| anyhow!("{e}"))?;
        m.infer(&[one.tensor()], &[]).map_err(|e| anyhow!("{e}"))?;
        drop(m);
        snooze_core::memory::trim_heap();
        Ok(())
    };
    for w in ROTATION {
        cycle(w)?;
    }
    let (rss_before, _, _) = rss_parts_mib()?;
    let mut total = [Duration::ZERO; 3];
    let mut count = [0usize; 3];
    let t = Instant::now();
    for i in 0..n {
        let k = i % ROTATION.len();
        let c = Instant::now();
        cycle(ROTATION[k])?;
        total[k] += c.elapsed();
        count[k] += 1;
        if (i + 1) % 250 == 0 {
            eprintln!("  cycles: {} of {n}, RSS {:.1} MiB", i + 1, rss_parts_mib()?.0);
        }
    }
    let took = t.elapsed();
    let (rss_after, _, _) = rss_parts_mib()?;
    let mean = |k: usize| if count[k] == 0 { f64::NAN } else { ms(total[k]) / count[k] as f64 };
    Ok(Cycles { n, rss_before, rss_after, took, mean_ms: [mean(0), mean(1), mean(2)] })
}
