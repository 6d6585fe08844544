//! How long a run of the 100 MiB MLP takes at 1-16 rows, its weights prepacked or read as
//! panels in place (`weights = "mapped"`, `ai.snooze.PanelMatMul`): a measurement, run by
//! hand (`cargo test --release -p snooze-backend-ort --test panels_speed -- --ignored
//! --nocapture`), whose figures `bench/README.md` quotes.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Instant;

use common::{backend, cache_dir, cpu, model};
use snooze_core::{Backend, LoadSpec, Tensor, TensorData, Weights};

#[test]
#[ignore = "a measurement, not a check"]
fn runs_by_rows_prepacked_and_as_panels() {
    let cache = cache_dir("panels-speed");
    let b = backend().with_cache_dir(cache.path());
    let spec = |weights| LoadSpec { weights, ..cpu("mlp-100m-1", model("mlp-100m-1")) };
    b.prepare(&spec(Weights::Mapped)).unwrap();
    b.prepare(&spec(Weights::Prepacked)).unwrap();
    let prepacked = b.load(&spec(Weights::Prepacked)).unwrap();
    let mapped = b.load(&spec(Weights::Mapped)).unwrap();
    println!("rows  prepacked ms  panels ms  panels / prepacked  (medians of 60 interleaved runs)");
    for rows in [1usize, 2, 3, 4, 6, 8, 16, 64] {
        let x: Vec<f32> = (0..rows * 256).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let input = vec![Tensor::new("x", vec![rows as i64, 256], TensorData::Fp32(x))];
        let mut times = [Vec::new(), Vec::new()];
        for i in 0..65 {
            for (t, m) in times.iter_mut().zip([&prepacked, &mapped]) {
                let start = Instant::now();
                m.infer(&input, &[]).unwrap();
                if i >= 5 {
                    t.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        let [p, m] = times.map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        });
        println!("{rows:>4}  {p:>12.2}  {m:>9.2}  {:>18.2}x", m / p);
    }
}
