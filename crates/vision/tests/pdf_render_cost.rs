//! What rendering a PDF text page costs at a few resolutions: time and the peak
//! resident memory it adds (its own test binary, so no other test's threads blur the
//! figures). The page is the fixture's A4 page of text in the standard fonts.
#![allow(clippy::unwrap_used)]

use std::{path::PathBuf, time::Instant};

use snooze_vision::{Document, InputLimits};

/// `VmHWM` (peak RSS) and `VmRSS` in MiB; writing 5 to clear_refs resets the peak.
fn memory() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let mib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse::<f64>()
            .unwrap()
            / 1024.0
    };
    (mib("VmHWM:"), mib("VmRSS:"))
}

#[test]
fn a_text_page_at_72_150_and_300_dpi() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/ocr_pages/text.pdf");
    let bytes = std::fs::read(path).unwrap();
    let doc = Document::open(bytes, &InputLimits::default()).unwrap();
    // Warm up: font tables and code pages are loaded once per process.
    doc.render_page(0, &InputLimits { pdf_dpi: 72.0, ..InputLimits::default() }).unwrap();
    for dpi in [72.0, 150.0, 300.0] {
        let limits = InputLimits { pdf_dpi: dpi, ..InputLimits::default() };
        snooze_core::memory::trim_heap();
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let (_, before) = memory();
        let started = Instant::now();
        let page = doc.render_page(0, &limits).unwrap();
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        let (peak, _) = memory();
        let (w, h) = (page.image.width(), page.image.height());
        println!(
            "{dpi:.0} DPI: {w} x {h}, {ms:.0} ms, peak +{:.1} MiB over the {:.1} MiB before (the BGR page is {:.1} MiB)",
            peak - before,
            before,
            (w * h * 3) as f64 / f64::from(1 << 20)
        );
        assert!(peak - before < 8.0 * (w * h * 3) as f64 / f64::from(1 << 20) + 32.0, "{dpi} DPI");
    }
}
