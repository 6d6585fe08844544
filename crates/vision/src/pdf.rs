//! PDF pages rasterised one at a time with hayro (pure Rust, no system library).
//!
//! Opening a PDF reads its cross-reference table and page tree only, so the page
//! count is known before anything renders; the page selection and `max_pages` are
//! applied to it. Each page's pixel size is computed from its page box and the DPI
//! before rendering: a page that would be over `max_image_pixels` (or over the
//! rasteriser's 65,535-pixel side) is rendered at the highest DPI that fits, and the
//! result says so. A caller renders page after page, so a 500-page document holds
//! one bitmap at a time.
//!
//! Why 150 DPI by default: rapidocr shrinks any image whose long side is over 2,000
//! pixels back to 2,000 before detection, and an A4 page is 1,240 x 1,754 at 150 DPI
//! (2,000 px long is 171 DPI): more resolution is thrown away after costing render
//! time, and less makes 10-point text ~14 px tall, under the recogniser's 48-px input
//! (upscaled crops read worse). Letter is 1,275 x 1,650 at 150 DPI.
//!
//! hayro does not open password-protected files (an empty user password is tried
//! and works); such files, files it cannot parse and files cut short (no `%%EOF` at
//! their end) are refused with a sentence.
//! A panic inside the rasteriser is caught and reported as a failed page.

use std::panic::{catch_unwind, AssertUnwindSafe};

use hayro::{
    hayro_interpret::InterpreterSettings,
    hayro_syntax::{DecryptionError, LoadPdfError, Pdf},
    vello_cpu::color::palette::css::WHITE,
    PixmapSettings, RenderCache, RenderSettings,
};

use crate::{bgr::BgrImage, error::VisionError, limits::InputLimits};

/// The rasteriser's largest side (its canvas sizes are 16-bit).
const MAX_SIDE: f64 = 65_535.0;

/// A PDF opened for rendering.
pub struct PdfDocument {
    pdf: Pdf,
}

/// The size a page will be rendered at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RenderPlan {
    pub width: u32,
    pub height: u32,
    pub dpi: f32,
    /// The DPI asked for, when it had to be lowered to fit the pixel limit.
    pub lowered_from: Option<f32>,
}

/// A rendered page and how it was rendered.
#[derive(Debug, Clone)]
pub struct RenderedPage {
    pub image: BgrImage,
    pub plan: RenderPlan,
}

impl RenderPlan {
    /// A sentence for the response when the DPI was lowered.
    pub fn note(&self) -> Option<String> {
        self.lowered_from.map(|asked| {
            format!(
                "rendered at {:.0} DPI instead of {asked:.0} to stay within the pixel limit ({} x {})",
                self.dpi, self.width, self.height
            )
        })
    }
}

impl PdfDocument {
    /// Reads the document's structure (not its pages' content).
    pub fn open(bytes: Vec<u8>) -> Result<PdfDocument, VisionError> {
        // A PDF ends with `%%EOF`. Without it the file was cut short: hayro would rebuild
        // what it can and a page whose content was lost would read as blank, a wrong
        // answer, not an error. What may follow it: padding of any length (scanners and
        // fax gateways fill to a block size with NULs or spaces) and a few bytes of junk
        // (its last KiB before the padding is searched).
        let end = bytes
            .iter()
            .rposition(|b| !matches!(b, 0 | b' ' | b'\t' | b'\r' | b'\n' | 0x0c))
            .map_or(0, |i| i + 1);
        let tail = &bytes[end.saturating_sub(1024)..end];
        if !tail.windows(5).any(|w| w == b"%%EOF") {
            return Err(VisionError::CorruptPdf {
                reason: "it does not end with %%EOF: the file is truncated".into(),
            });
        }
        let opened = catch_unwind(AssertUnwindSafe(|| Pdf::new(bytes)))
            .map_err(|_| VisionError::CorruptPdf { reason: "its structure could not be parsed".into() })?;
        let pdf = opened.map_err(|e| match e {
            LoadPdfError::Decryption(DecryptionError::PasswordProtected) => VisionError::EncryptedPdf,
            LoadPdfError::Decryption(other) => {
                VisionError::UnsupportedPdfEncryption { reason: format!("{other:?}") }
            }
            LoadPdfError::Invalid => VisionError::CorruptPdf {
                reason: "no valid cross-reference table or page tree was found".into(),
            },
        })?;
        if pdf.pages().is_empty() {
            return Err(VisionError::NoPages);
        }
        Ok(PdfDocument { pdf })
    }

    pub fn page_count(&self) -> usize {
        self.pdf.pages().len()
    }

    /// The page's size in points (1/72 inch), after its rotation.
    pub fn page_size_points(&self, index: usize) -> Option<(f32, f32)> {
        self.pdf.pages().get(index).map(|p| p.render_dimensions())
    }

    /// The pixel size page `index` will have at `limits.pdf_dpi`, lowered to fit.
    pub fn plan(&self, index: usize, limits: &InputLimits) -> Result<RenderPlan, VisionError> {
        let count = self.page_count();
        let (w_pt, h_pt) =
            self.page_size_points(index).ok_or(VisionError::PageOutOfRange { page: index + 1, count })?;
        plan_render(index, f64::from(w_pt), f64::from(h_pt), limits)
    }

    /// Renders page `index` (0-based) on white.
    pub fn render_page(&self, index: usize, limits: &InputLimits) -> Result<RenderedPage, VisionError> {
        let plan = self.plan(index, limits)?;
        let pages = self.pdf.pages();
        let page = &pages[index];
        // The rasteriser truncates `points x scale` in f32: Letter at 150 DPI, 1650 px
        // exactly, came out 1649. A quarter pixel more lands every side on the size planned.
        let (w_pt, h_pt) = page.render_dimensions();
        let settings = PixmapSettings {
            x_scale: (plan.width as f32 + 0.25) / w_pt,
            y_scale: (plan.height as f32 + 0.25) / h_pt,
            bg_color: WHITE,
        };
        let rendered = catch_unwind(AssertUnwindSafe(|| {
            let cache = RenderCache::new();
            hayro::render(
                page,
                &cache,
                &InterpreterSettings::default(),
                &RenderSettings::default(),
                &settings,
            )
        }))
        .map_err(|_| VisionError::RenderFailed { page: index + 1, reason: "the rasteriser failed".into() })?;
        let (width, height) = (usize::from(rendered.width()), usize::from(rendered.height()));
        if width == 0 || height == 0 {
            return Err(VisionError::RenderFailed {
                page: index + 1,
                reason: "it rendered to an empty image".into(),
            });
        }
        // Opaque background: premultiplied RGBA is plain RGBA.
        let rgba = rendered.data_as_u8_slice();
        let mut bgr = Vec::with_capacity(width * height * 3);
        for px in rgba.chunks_exact(4) {
            bgr.extend([px[2], px[1], px[0]]);
        }
        drop(rendered);
        let image = BgrImage::from_bgr(width, height, bgr).ok_or(VisionError::RenderFailed {
            page: index + 1,
            reason: "the rasteriser returned fewer pixels than its size".into(),
        })?;
        let plan = RenderPlan { width: width as u32, height: height as u32, ..plan };
        Ok(RenderedPage { image, plan })
    }
}

/// The pixel size of a `w_pt` x `h_pt` page at the limits' DPI, or at the highest DPI
/// under both the pixel limit and the rasteriser's side limit.
pub fn plan_render(
    index: usize,
    w_pt: f64,
    h_pt: f64,
    limits: &InputLimits,
) -> Result<RenderPlan, VisionError> {
    let asked = f64::from(limits.pdf_dpi);
    // Page boxes come as f32: a 460.8-point side is 460.79998, 959.99996 pixels at 150
    // DPI; floored, a pixel short of what the page is. Within a thousandth of a pixel,
    // a side is whole.
    let pixels = |pt: f64, dpi: f64| (pt * dpi / 72.0 + 1e-3).floor();
    let size = |dpi: f64| (pixels(w_pt, dpi), pixels(h_pt, dpi));
    let fits = |(w, h): (f64, f64)| w * h <= limits.max_image_pixels as f64 && w.max(h) <= MAX_SIDE;
    let mut dpi = asked;
    if !fits(size(dpi)) {
        let by_pixels = (limits.max_image_pixels as f64 / (w_pt * h_pt)).sqrt() * 72.0;
        let by_side = MAX_SIDE / w_pt.max(h_pt) * 72.0;
        dpi = by_pixels.min(by_side).min(asked);
        // Flooring keeps the size under the bound; the nudge covers rounding error.
        while !fits(size(dpi)) && dpi > 0.0 {
            dpi *= 0.999;
        }
    }
    let (w, h) = size(dpi);
    if !(w >= 1.0 && h >= 1.0) {
        return Err(VisionError::RenderFailed {
            page: index + 1,
            reason: format!(
                "its page box is {w_pt:.0} x {h_pt:.0} points, too thin to render within the pixel limit"
            ),
        });
    }
    let lowered_from = (dpi < asked).then_some(asked as f32);
    Ok(RenderPlan { width: w as u32, height: h as u32, dpi: dpi as f32, lowered_from })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a4_at_150_dpi_fits_and_a_huge_page_is_lowered() {
        let limits = InputLimits::default();
        let a4 = plan_render(0, 595.0, 842.0, &limits).unwrap();
        assert_eq!((a4.width, a4.height, a4.lowered_from), (1239, 1754, None));
        assert!(a4.note().is_none());
        // A 200 x 200 inch poster at 150 DPI is 900 megapixels.
        let poster = plan_render(0, 14_400.0, 14_400.0, &limits).unwrap();
        assert!(u64::from(poster.width) * u64::from(poster.height) <= limits.max_image_pixels);
        assert!(poster.width > 6000, "{poster:?}");
        assert_eq!(poster.lowered_from, Some(150.0));
        assert!(poster.note().unwrap().contains("instead of 150"), "{:?}", poster.note());
        // A long thin strip hits the 65,535-pixel side first.
        let strip = plan_render(0, 100_000.0, 100.0, &limits).unwrap();
        assert_eq!((strip.width, strip.height), (65_535, 65), "{strip:?}");
        assert!(plan_render(0, 1e12, 1e-6, &limits).is_err());
        // An image saved as a PDF at 100 DPI: a 960 x 330 page, its box in f32.
        let saved = plan_render(0, f64::from(460.8f32), f64::from(158.4f32), &limits).unwrap();
        assert_eq!((saved.width, saved.height), (960, 330));
    }

    #[test]
    fn a_page_renders_at_the_size_its_dpi_gives() {
        // The fixture's A4 page turned into a Letter page (the box has as many digits).
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/ocr_pages/text.pdf");
        let a4 = std::fs::read(path).unwrap();
        let at = a4.windows(7).position(|w| w == b"595 842").unwrap();
        let mut letter = a4.clone();
        letter[at..at + 7].copy_from_slice(b"612 792");
        for (bytes, dpi, size) in [
            (&letter, 150.0, (1275, 1650)),
            (&letter, 200.0, (1700, 2200)),
            (&letter, 72.0, (612, 792)),
            (&a4, 150.0, (1239, 1754)),
        ] {
            let doc = PdfDocument::open(bytes.clone()).unwrap();
            let limits = InputLimits { pdf_dpi: dpi, ..InputLimits::default() };
            let page = doc.render_page(0, &limits).unwrap();
            assert_eq!((page.image.width(), page.image.height()), size, "{dpi} DPI");
        }
    }

    #[test]
    fn garbage_is_a_corrupt_pdf() {
        let err = PdfDocument::open(b"%PDF-1.4\nthis is not a pdf".to_vec()).err().unwrap();
        assert_eq!(err.http_status(), 400);
        assert!(err.to_string().starts_with("the PDF could not be read"), "{err}");
    }
}
