//! The process's peak RSS (VmHWM) is readable and resettable. The peak is process-wide
//! and every measured run resets it (`WorkMeter::begin`), so this runs in a test binary
//! of its own: beside the unit tests, one of them reset it between the block's drop and
//! the reading (seen once in CI: the peak read back as the RSS before the block).

use snooze_core::memory::{peak_rss_bytes, process_rss_bytes, reset_peak_rss};

#[test]
fn peak_rss_is_readable_and_resettable() {
    // 64 MiB: above glibc's largest mmap threshold, so the block is its own mapping and
    // its drop gives it back to the kernel at once.
    const BLOCK: u64 = 64 << 20;
    let before = process_rss_bytes();
    let block = std::hint::black_box(vec![1u8; BLOCK as usize]);
    let holding = process_rss_bytes();
    assert!(holding >= before + BLOCK * 9 / 10, "the block is resident: {before} -> {holding}");
    drop(block);
    let dropped = process_rss_bytes();
    assert!(dropped + BLOCK * 9 / 10 <= holding, "the block went back: {holding} -> {dropped}");

    // The kernel's RSS counters are per thread and settle lazily: readings taken
    // moments apart may disagree by a few hundred KiB, far less than the block.
    let peak = peak_rss_bytes().expect("VmHWM");
    assert!(
        peak >= before + BLOCK * 9 / 10,
        "the peak {peak} forgot the block after its drop ({before} before it, {holding} with it)"
    );
    let _ = reset_peak_rss();
    let now = process_rss_bytes();
    let reset = peak_rss_bytes().expect("VmHWM");
    assert!(
        reset + BLOCK / 2 <= peak,
        "after the reset the peak {reset} still remembers the block ({peak} before the reset)"
    );
    assert!(reset + (1 << 20) >= now, "the peak {reset} is below the RSS {now} after the reset");
}
