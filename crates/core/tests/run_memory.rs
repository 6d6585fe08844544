//! What a run held at its peak and gave back is measured (its *transient*, which the
//! scheduler reserves while the model has work), only for work that ran alone. The
//! process's peak RSS is process-wide, so this runs in a test binary of its own.

use snooze_core::execution::WorkMeter;

const BLOCK: usize = 64 << 20;

/// Allocates `BLOCK` bytes, touches every page, and frees them (a block this large is
/// its own mapping: freeing it returns it to the system).
fn touch_and_free() {
    let mut block = vec![1u8; BLOCK];
    block.iter_mut().step_by(4096).for_each(|b| *b = 2);
    std::hint::black_box(&block);
}

#[test]
fn a_run_s_transient_is_what_it_held_at_its_peak_and_gave_back() {
    let meter = WorkMeter::new();
    let run = meter.begin();
    touch_and_free();
    let growth = run.measure(0);
    let transient = growth.transient.expect("the work ran alone");
    assert!(transient >= BLOCK as u64 * 3 / 4, "64 MiB held then freed, {transient} bytes seen");
    assert!(growth.kept.expect("alone") < BLOCK as u64 / 4, "nothing kept: {:?}", growth.kept);
    drop(run);

    // Kept memory is not transient.
    let run = meter.begin();
    let mut kept = vec![1u8; BLOCK];
    kept.iter_mut().step_by(4096).for_each(|b| *b = 2);
    let growth = run.measure(0);
    assert!(growth.kept.expect("alone") >= BLOCK as u64 * 3 / 4);
    assert!(growth.transient.expect("alone") < BLOCK as u64 / 4, "{:?}", growth.transient);
    drop(run);
    drop(kept);

    // Overlapping work cannot tell its peak from the other's.
    let a = meter.begin();
    let b = meter.begin();
    touch_and_free();
    assert_eq!(b.measure(0).transient, None);
    drop(b);
    assert_eq!(a.measure(0).transient, None, "another piece of work started meanwhile");
}
