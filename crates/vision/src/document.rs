//! An upload as a list of pages: an image is one page, a TIFF one per directory, a
//! PDF one per page; each is decoded only when asked for.
//!
//! `open` recognises the format from the first bytes (never from a file name or a
//! declared content type), reads what tells the page count and sizes, and refuses
//! what is over the limits; `render_page` then yields one page's pixels at a time.

use crate::{
    bgr::BgrImage,
    decode::{decode_image, ImageKind},
    error::VisionError,
    limits::{all_pages, InputLimits, PageSelection},
    pdf::PdfDocument,
    tiff_pages::TiffPages,
};

/// What kind of file an upload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentKind {
    Image(ImageKind),
    Pdf,
}

impl DocumentKind {
    /// Recognised from the first bytes: PDF allows its `%PDF-` marker anywhere in the
    /// first 1,024 bytes.
    pub fn sniff(bytes: &[u8]) -> Result<DocumentKind, VisionError> {
        if bytes.is_empty() {
            return Err(VisionError::Empty);
        }
        if let Some(kind) = ImageKind::sniff(bytes) {
            return Ok(DocumentKind::Image(kind));
        }
        let head = &bytes[..bytes.len().min(1024)];
        if head.windows(5).any(|w| w == b"%PDF-") {
            return Ok(DocumentKind::Pdf);
        }
        let start: String = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ");
        Err(VisionError::UnknownFormat { start: format!("the bytes {start}") })
    }
}

enum Pages {
    Single,
    Tiff(TiffPages),
    Pdf(PdfDocument),
}

/// An opened upload.
pub struct Document {
    bytes: Vec<u8>,
    kind: DocumentKind,
    pages: Pages,
}

/// One page's pixels and how they were made.
#[derive(Debug, Clone)]
pub struct PageImage {
    /// 0-based page number in the document.
    pub index: usize,
    pub image: BgrImage,
    /// The DPI a PDF page was rendered at.
    pub dpi: Option<f32>,
    /// A sentence for the response when the page was rendered other than asked.
    pub note: Option<String>,
}

impl Document {
    /// Recognises the upload and reads its structure; a single image's size is
    /// checked here, from its header.
    pub fn open(bytes: Vec<u8>, limits: &InputLimits) -> Result<Document, VisionError> {
        limits.validate()?;
        let kind = DocumentKind::sniff(&bytes)?;
        let (bytes, pages) = match kind {
            DocumentKind::Pdf => {
                let pdf = PdfDocument::open(bytes)?;
                (Vec::new(), Pages::Pdf(pdf))
            }
            DocumentKind::Image(ImageKind::Tiff) => {
                let tiff = TiffPages::scan(&bytes)?;
                (bytes, Pages::Tiff(tiff))
            }
            DocumentKind::Image(image) => {
                check_header(&bytes, image, limits)?;
                (bytes, Pages::Single)
            }
        };
        Ok(Document { bytes, kind, pages })
    }

    pub fn kind(&self) -> DocumentKind {
        self.kind
    }

    pub fn page_count(&self) -> usize {
        match &self.pages {
            Pages::Single => 1,
            Pages::Tiff(t) => t.count(),
            Pages::Pdf(p) => p.page_count(),
        }
    }

    /// The pages to read: the selection (all pages when `None`) under `max_pages`.
    pub fn select(
        &self,
        selection: Option<&PageSelection>,
        limits: &InputLimits,
    ) -> Result<Vec<usize>, VisionError> {
        match selection {
            Some(s) => s.resolve(self.page_count(), limits.max_pages),
            None => all_pages(self.page_count(), limits.max_pages),
        }
    }

    /// Decodes or renders page `index` (0-based).
    pub fn render_page(&self, index: usize, limits: &InputLimits) -> Result<PageImage, VisionError> {
        let count = self.page_count();
        if index >= count {
            return Err(VisionError::PageOutOfRange { page: index + 1, count });
        }
        match (&self.pages, self.kind) {
            (Pages::Single, DocumentKind::Image(kind)) => {
                let image = decode_image(&self.bytes, kind, limits)?;
                Ok(PageImage { index, image, dpi: None, note: None })
            }
            (Pages::Tiff(t), _) => {
                let image = t.decode_page(&self.bytes, index, limits)?;
                Ok(PageImage { index, image, dpi: None, note: None })
            }
            (Pages::Pdf(p), _) => {
                let page = p.render_page(index, limits)?;
                Ok(PageImage { index, note: page.plan.note(), dpi: Some(page.plan.dpi), image: page.image })
            }
            (Pages::Single, DocumentKind::Pdf) => Err(VisionError::NoPages),
        }
    }
}

/// The header's size against the limits, without decoding pixels.
fn check_header(bytes: &[u8], kind: ImageKind, limits: &InputLimits) -> Result<(), VisionError> {
    let format = match kind {
        ImageKind::Png => image::ImageFormat::Png,
        ImageKind::Jpeg => image::ImageFormat::Jpeg,
        ImageKind::WebP => image::ImageFormat::WebP,
        ImageKind::Tiff => image::ImageFormat::Tiff,
        ImageKind::Bmp => image::ImageFormat::Bmp,
    };
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    reader.no_limits();
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| VisionError::CorruptImage { format: kind.name(), reason: e.to_string() })?;
    limits.check_image(kind.name(), w, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_comes_from_the_bytes() {
        assert_eq!(DocumentKind::sniff(b"").unwrap_err(), VisionError::Empty);
        assert_eq!(DocumentKind::sniff(b"\n\n%PDF-1.7\n").unwrap(), DocumentKind::Pdf);
        let err = DocumentKind::sniff(b"GIF89a....").unwrap_err();
        assert!(err.to_string().contains("47 49 46 38"), "{err}");
        assert_eq!(err.http_status(), 400);
    }

    #[test]
    fn a_tiff_is_a_document_of_pages() {
        let bytes = crate::tiff_pages::tests::two_page_tiff(&[(4, 3, [9, 9, 9]), (5, 6, [1, 1, 1])]);
        let limits = InputLimits::default();
        let doc = Document::open(bytes, &limits).unwrap();
        assert_eq!(doc.page_count(), 2);
        assert_eq!(doc.select(Some(&PageSelection::parse("2").unwrap()), &limits).unwrap(), [1]);
        let page = doc.render_page(1, &limits).unwrap();
        assert_eq!((page.index, page.image.width(), page.image.height()), (1, 5, 6));
        let two = InputLimits { max_pages: 1, ..limits.clone() };
        assert_eq!(doc.select(None, &two).unwrap_err().http_status(), 413);
    }

    #[test]
    fn an_oversized_image_is_refused_at_open() {
        let bytes = crate::decode::tests::png_header_only(50_000, 50_000);
        let err = Document::open(bytes, &InputLimits::default()).err().unwrap();
        assert_eq!(err.http_status(), 413, "{err}");
    }
}
