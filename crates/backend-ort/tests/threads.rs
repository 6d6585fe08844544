//! A model of low CPU priority runs on runtime threads of its own, in the idle scheduling
//! class at nice 10; the others on the shared pool. Its own binary: no other test starts runtime threads meanwhile.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backend, cpu, model};
use snooze_core::{Backend, LoadSpec, Tensor, TensorData};

/// Whether no low-priority thread is left, within 2 s: a joined thread's `/proc` entry
/// can outlive the join by a moment.
fn gone() -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !low_threads().is_empty() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// The process's threads named as the low-priority pool's: their nice values, and whether
/// each is in the idle scheduling class (`/proc/self/task/TID/stat`: the name in
/// parentheses, nice the 19th field, the scheduling policy the 41st; `SCHED_IDLE` is 5).
fn low_threads() -> Vec<(i32, bool)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if &stat[open + 1..close] != "snooze-ort-low" {
            continue;
        }
        // After the name: state is field 3, so nice (19) is the 17th from here, and the
        // policy (41) the 39th.
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let nice = fields[16].parse().unwrap();
        found.push((nice, fields[38] == "5"));
    }
    found
}

fn run(m: &dyn snooze_core::LoadedModel) -> TensorData {
    let x = (0..4 * 256).map(|i| (i % 17) as f32 / 17.0).collect();
    m.infer(&[Tensor::new("x", vec![4, 256], TensorData::Fp32(x))], &[]).unwrap().remove(0).data
}

#[test]
fn a_model_of_low_cpu_priority_runs_on_idle_class_threads_of_its_own_with_the_same_answers() {
    let b = backend();
    let spec = LoadSpec { intra_op_threads: 2, ..cpu("mlp-10m", model("mlp-10m")) };
    let shared = b.load(&spec).unwrap();
    assert!(low_threads().is_empty(), "a model of normal priority draws on the shared pool");
    let low = b.load(&LoadSpec { low_cpu_priority: true, ..spec.clone() }).unwrap();
    // Two threads a run: the caller and one of the pool's.
    // Idle class, at 10 below the process (nice 10 for a test run at 0).
    let idle = (snooze_core::memory::low_priority_nice(), true);
    assert_eq!(low_threads(), [idle], "the low-priority session's pool thread, idle class at nice 10");
    assert_eq!(run(low.as_ref()), run(shared.as_ref()), "the same answers on either pool");
    drop(low);
    assert!(gone(), "the pool's threads end with its session");

    // Whisper's two sessions, each with a pool of its own.
    let whisper = b
        .load(&LoadSpec { low_cpu_priority: true, ..cpu("whisper-tiny-en", model("whisper-tiny-en")) })
        .unwrap();
    assert!(low_threads().is_empty(), "intra_op_threads 1: no thread beside the caller");
    drop(whisper);
    let whisper = b
        .load(&LoadSpec {
            intra_op_threads: 3,
            low_cpu_priority: true,
            ..cpu("whisper-tiny-en", model("whisper-tiny-en"))
        })
        .unwrap();
    assert_eq!(low_threads(), [idle; 4], "encoder and decoder: two pool threads each");
    drop(whisper);
}
