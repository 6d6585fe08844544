//! Every way an OCR request can fail, as a sentence its sender can act on.
//!
//! The server maps errors to a status through [`VisionError::class`]: a document or
//! image over a limit is "too large" (413), anything wrong with what was sent is "bad
//! input" (400), and a model whose output does not have the shape its stage expects
//! is the server's fault (500), never the client's.

/// Which status family an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Over a configured limit (HTTP 413).
    TooLarge,
    /// The upload or the request's options are wrong (HTTP 400).
    BadInput,
    /// A model gave an output its stage cannot read (HTTP 500).
    Internal,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VisionError {
    #[error("the upload is empty: send an image (PNG, JPEG, WebP, TIFF, BMP) or a PDF")]
    Empty,
    #[error(
        "the upload is neither a supported image nor a PDF (it starts with {start}): send PNG, JPEG, WebP, TIFF, BMP or PDF"
    )]
    UnknownFormat { start: String },
    #[error("the {format} image could not be decoded: {reason}")]
    CorruptImage { format: &'static str, reason: String },
    #[error("the {format} image uses a feature this server does not decode: {reason}")]
    UnsupportedImage { format: &'static str, reason: String },
    #[error(
        "the {format} image is {width}x{height} pixels: a page needs a width and a height of at least 1"
    )]
    EmptyImage { format: &'static str, width: u32, height: u32 },
    #[error(
        "the {format} image is {width}x{height} = {pixels} pixels, over the limit of {limit} pixels (max_image_pixels): send it scaled down"
    )]
    ImageTooLarge { format: &'static str, width: u32, height: u32, pixels: u64, limit: u64 },
    #[error("decoding the {format} image would need more memory than the limit allows: {reason}")]
    DecoderLimit { format: &'static str, reason: String },
    #[error(
        "the document has {count} pages and at most {limit} are read per request (max_pages): choose pages with a selection such as \"1-{limit}\""
    )]
    TooManyPages { count: usize, limit: usize },
    #[error(
        "the page selection asks for {selected} of the document's {count} pages and at most {limit} are read per request (max_pages): choose fewer"
    )]
    TooManySelected { selected: usize, count: usize, limit: usize },
    #[error("the page selection {selection:?} is not valid: {reason} (write pages counted from 1, like \"1-3,7\")")]
    BadPageSelection { selection: String, reason: String },
    #[error("the page selection asks for page {page} but the document has {count} page(s)")]
    PageOutOfRange { page: usize, count: usize },
    #[error("the PDF is password-protected: remove the password and send it again")]
    EncryptedPdf,
    #[error("the PDF is encrypted in a way this server cannot open ({reason}): send an unencrypted copy")]
    UnsupportedPdfEncryption { reason: String },
    #[error("the PDF could not be read: {reason}")]
    CorruptPdf { reason: String },
    #[error("the PDF has no pages")]
    NoPages,
    #[error("page {page} of the PDF could not be rendered: {reason}")]
    RenderFailed { page: usize, reason: String },
    #[error("the option {name} = {value} is not valid: {reason}")]
    BadOption { name: &'static str, value: String, reason: String },
    #[error("the {stage} model gave an output this server cannot read: {reason}")]
    ModelOutput { stage: &'static str, reason: String },
}

impl VisionError {
    pub fn class(&self) -> ErrorClass {
        match self {
            VisionError::ImageTooLarge { .. }
            | VisionError::DecoderLimit { .. }
            | VisionError::TooManyPages { .. }
            | VisionError::TooManySelected { .. } => ErrorClass::TooLarge,
            VisionError::ModelOutput { .. } => ErrorClass::Internal,
            _ => ErrorClass::BadInput,
        }
    }

    /// The HTTP status the class maps to.
    pub fn http_status(&self) -> u16 {
        match self.class() {
            ErrorClass::TooLarge => 413,
            ErrorClass::BadInput => 400,
            ErrorClass::Internal => 500,
        }
    }

    pub(crate) fn model_output(stage: &'static str, reason: impl Into<String>) -> VisionError {
        VisionError::ModelOutput { stage, reason: reason.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_413_and_input_errors_400() {
        let big = VisionError::ImageTooLarge {
            format: "PNG",
            width: 50_000,
            height: 50_000,
            pixels: 2_500_000_000,
            limit: 50_000_000,
        };
        assert_eq!((big.class(), big.http_status()), (ErrorClass::TooLarge, 413));
        assert!(big.to_string().contains("50000x50000"), "{big}");
        assert_eq!(VisionError::TooManyPages { count: 9, limit: 3 }.http_status(), 413);
        assert_eq!(VisionError::EncryptedPdf.http_status(), 400);
        assert_eq!(VisionError::Empty.http_status(), 400);
        assert_eq!(VisionError::model_output("detector", "no map").http_status(), 500);
    }
}
