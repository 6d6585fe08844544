//! Malformed uploads are refused with a sentence, never a panic: every prefix of
//! small files of each format, random bytes behind each format's magic number, and
//! valid files with bytes flipped, opened and rendered under `catch_unwind` (which
//! would catch a panic the crate's own guards let through).
#![allow(clippy::unwrap_used)]

use std::{io::Cursor, panic::catch_unwind, path::PathBuf};

use image::{DynamicImage, ImageFormat, RgbImage};
use snooze_vision::{Document, InputLimits};

fn limits() -> InputLimits {
    // Low DPI and pixel limits keep thousands of renders quick.
    InputLimits { max_image_pixels: 4_000_000, max_pages: 4, pdf_dpi: 8.0 }
}

/// Opens and renders `bytes`; panics only if the crate (or a dependency under it) did.
fn survive(bytes: &[u8], what: &str) -> bool {
    let owned = bytes.to_vec();
    let result = catch_unwind(move || {
        let limits = limits();
        match Document::open(owned, &limits) {
            Ok(doc) => {
                for page in 0..doc.page_count().min(2) {
                    if let Err(e) = doc.render_page(page, &limits) {
                        assert!(!e.to_string().is_empty());
                    }
                }
                true
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                false
            }
        }
    });
    result.unwrap_or_else(|_| panic!("{what}: panicked"))
}

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let img = RgbImage::from_fn(9, 7, |x, y| image::Rgb([(x * 20) as u8, (y * 30) as u8, 90]));
    let encode = |format| {
        let mut out = Cursor::new(Vec::new());
        DynamicImage::ImageRgb8(img.clone()).write_to(&mut out, format).unwrap();
        out.into_inner()
    };
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/ocr_pages");
    vec![
        ("png", std::fs::read(fixtures.join("small.png")).unwrap()),
        ("jpeg", encode(ImageFormat::Jpeg)),
        ("webp", encode(ImageFormat::WebP)),
        ("bmp", encode(ImageFormat::Bmp)),
        ("tiff", encode(ImageFormat::Tiff)),
        ("pdf", std::fs::read(fixtures.join("text.pdf")).unwrap()),
        ("locked pdf", std::fs::read(fixtures.join("locked.pdf")).unwrap()),
    ]
}

#[test]
fn every_prefix_is_refused_or_read_without_panicking() {
    for (name, bytes) in samples() {
        let whole = survive(&bytes, name);
        assert!(whole || name == "locked pdf", "the whole {name} file opens");
        let opened =
            (0..bytes.len()).filter(|&n| survive(&bytes[..n], &format!("{name} cut at {n}"))).count();
        println!("{name}: {} bytes, {opened} of its prefixes open", bytes.len());
    }
}

#[test]
fn a_pdf_cut_short_is_refused_as_truncated() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/ocr_pages");
    let pdf = std::fs::read(fixtures.join("text.pdf")).unwrap();
    let end = pdf.windows(5).rposition(|w| w == b"%%EOF").unwrap();
    // Cut in its header, its page content, its cross-reference table, its trailer.
    for cut in [300, pdf.len() / 2, end - 40, end + 4] {
        let err = Document::open(pdf[..cut].to_vec(), &limits()).err().expect("refused");
        assert!(err.to_string().contains("truncated"), "cut at {cut}: {err}");
        assert_eq!(err.http_status(), 400);
    }
    assert!(Document::open(pdf[..end + 5].to_vec(), &limits()).is_ok());
    // Padded to a block size after its end (scanners, fax gateways): whole, and read.
    for pad in [0u8, b' '] {
        let padded = [&pdf[..end + 5], b"\n", &vec![pad; 4096][..]].concat();
        assert!(Document::open(padded, &limits()).is_ok(), "padded with {pad:?}");
    }
}

/// xorshift64: reproducible noise without a dependency.
fn noise(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn random_bytes_and_flipped_bytes_never_panic() {
    let mut seed = 0x5eed_0c12_u64;
    let magics: [&[u8]; 7] = [
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff",
        b"RIFF\x10\0\0\0WEBPVP8 ",
        b"II*\0",
        b"MM\0*",
        b"BM",
        b"%PDF-1.7\n",
    ];
    for magic in magics {
        for _ in 0..150 {
            let len = (noise(&mut seed) % 600) as usize;
            let mut bytes = magic.to_vec();
            bytes.extend((0..len).map(|_| noise(&mut seed) as u8));
            survive(&bytes, &format!("random after {magic:?}"));
        }
    }
    for (name, bytes) in samples() {
        for round in 0..200 {
            let mut mutated = bytes.clone();
            for _ in 0..1 + round % 4 {
                let at = (noise(&mut seed) as usize) % mutated.len();
                mutated[at] = noise(&mut seed) as u8;
            }
            survive(&mutated, &format!("{name} flipped, round {round}"));
        }
    }
}
