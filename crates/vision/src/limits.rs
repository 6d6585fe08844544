//! What one OCR request may make the server decode, and which pages it asks for.
//!
//! Limits are checked against what a file declares before the pixels exist (the
//! size in an image header, the page count and page box of a PDF), so a refusal
//! costs a header parse. The page selection is applied before rendering: pages not
//! asked for are never decoded.

use crate::error::VisionError;

/// Bounds on one request's input.
#[derive(Debug, Clone, PartialEq)]
pub struct InputLimits {
    /// Largest image or rendered page, in pixels (width x height).
    pub max_image_pixels: u64,
    /// Most pages read from one document (after the selection).
    pub max_pages: usize,
    /// Resolution PDF pages are rendered at, in dots per inch (lowered for a page
    /// that would be over `max_image_pixels`).
    pub pdf_dpi: f32,
}

impl Default for InputLimits {
    /// 40 megapixels (a 7300 x 5500 photo, or an A4 page at 1,000 DPI); 50 pages;
    /// 150 DPI (see `pdf` for why).
    fn default() -> Self {
        InputLimits { max_image_pixels: 40_000_000, max_pages: 50, pdf_dpi: 150.0 }
    }
}

impl InputLimits {
    /// Refuses a declared size that is empty or over the pixel limit.
    pub fn check_image(&self, format: &'static str, width: u32, height: u32) -> Result<(), VisionError> {
        if width == 0 || height == 0 {
            return Err(VisionError::EmptyImage { format, width, height });
        }
        let pixels = u64::from(width) * u64::from(height);
        if pixels > self.max_image_pixels {
            return Err(VisionError::ImageTooLarge {
                format,
                width,
                height,
                pixels,
                limit: self.max_image_pixels,
            });
        }
        Ok(())
    }

    /// Checks the limits themselves (from a request's options).
    pub fn validate(&self) -> Result<(), VisionError> {
        let bad = |name, value: String, reason: &str| {
            Err(VisionError::BadOption { name, value, reason: reason.into() })
        };
        if self.max_image_pixels == 0 {
            return bad("max_image_pixels", "0".into(), "it must be at least 1");
        }
        if self.max_pages == 0 {
            return bad("max_pages", "0".into(), "it must be at least 1");
        }
        if !(self.pdf_dpi.is_finite() && (1.0..=2400.0).contains(&self.pdf_dpi)) {
            return bad("pdf_dpi", self.pdf_dpi.to_string(), "it must be between 1 and 2400");
        }
        Ok(())
    }
}

/// Pages asked for, counted from 1 as people count them: `"1-3,7"`, `"2-"` (to the
/// end), `"-4"` (from the start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageSelection {
    text: String,
    /// Inclusive ranges, 1-based; `None` as an end = the last page.
    ranges: Vec<(usize, Option<usize>)>,
}

impl PageSelection {
    pub fn parse(text: &str) -> Result<PageSelection, VisionError> {
        let bad = |reason: String| VisionError::BadPageSelection { selection: text.to_owned(), reason };
        let number = |s: &str| -> Result<usize, VisionError> {
            let s = s.trim();
            match s.parse::<usize>() {
                Ok(0) => Err(bad("pages are counted from 1, so 0 is not a page".into())),
                Ok(n) => Ok(n),
                Err(_) => Err(bad(format!("{s:?} is not a page number"))),
            }
        };
        let mut ranges = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() {
                return Err(bad("it has an empty item".into()));
            }
            let range = match part.split_once('-') {
                None => {
                    let n = number(part)?;
                    (n, Some(n))
                }
                Some((a, b)) => {
                    let start = if a.trim().is_empty() { 1 } else { number(a)? };
                    let end = if b.trim().is_empty() { None } else { Some(number(b)?) };
                    if end.is_some_and(|e| e < start) {
                        return Err(bad(format!("the range {part:?} ends before it starts")));
                    }
                    (start, end)
                }
            };
            ranges.push(range);
        }
        Ok(PageSelection { text: text.to_owned(), ranges })
    }

    /// The 0-based page indices selected in a document of `count` pages, in document
    /// order, each once; refused when a page is past the end or when more than
    /// `max_pages` are selected. Never allocates more than `max_pages` entries.
    pub fn resolve(&self, count: usize, max_pages: usize) -> Result<Vec<usize>, VisionError> {
        let mut wanted = Vec::new();
        for &(start, end) in &self.ranges {
            let end = end.unwrap_or(count);
            if start > count || end > count {
                return Err(VisionError::PageOutOfRange { page: start.max(end), count });
            }
            wanted.push((start - 1, end));
        }
        wanted.sort_unstable();
        let mut pages = Vec::new();
        let mut next = 0;
        for (start, end) in wanted {
            for page in start.max(next)..end {
                if pages.len() == max_pages {
                    return Err(VisionError::TooManySelected {
                        selected: self.selected_count(count),
                        count,
                        limit: max_pages,
                    });
                }
                pages.push(page);
            }
            next = next.max(end);
        }
        Ok(pages)
    }

    fn selected_count(&self, count: usize) -> usize {
        (0..count).filter(|&p| self.ranges.iter().any(|&(s, e)| p + 1 >= s && p < e.unwrap_or(count))).count()
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// Every page of a `count`-page document, or the limit's refusal.
pub fn all_pages(count: usize, max_pages: usize) -> Result<Vec<usize>, VisionError> {
    if count > max_pages {
        return Err(VisionError::TooManyPages { count, limit: max_pages });
    }
    Ok((0..count).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_resolve_in_document_order_once() {
        let s = PageSelection::parse("7, 1-3,2").unwrap();
        assert_eq!(s.resolve(10, 50).unwrap(), [0, 1, 2, 6]);
        assert_eq!(PageSelection::parse("8-").unwrap().resolve(10, 50).unwrap(), [7, 8, 9]);
        assert_eq!(PageSelection::parse("-2").unwrap().resolve(10, 50).unwrap(), [0, 1]);
    }

    #[test]
    fn bad_selections_say_what_is_wrong() {
        for (text, needle) in [
            ("0", "counted from 1"),
            ("3-1", "ends before it starts"),
            ("a", "not a page number"),
            ("1,,2", "empty item"),
            ("", "empty item"),
        ] {
            let err = PageSelection::parse(text).unwrap_err();
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
            assert_eq!(err.http_status(), 400);
        }
        let err = PageSelection::parse("4").unwrap().resolve(3, 50).unwrap_err();
        assert_eq!(err, VisionError::PageOutOfRange { page: 4, count: 3 });
    }

    #[test]
    fn too_many_pages_is_413_before_anything_renders() {
        let err = PageSelection::parse("1-").unwrap().resolve(500, 50).unwrap_err();
        assert_eq!(err, VisionError::TooManySelected { selected: 500, count: 500, limit: 50 });
        assert_eq!(err.http_status(), 413);
        let err = PageSelection::parse("1,3,5-6").unwrap().resolve(6, 3).unwrap_err();
        assert!(
            err.to_string().starts_with("the page selection asks for 4 of the document's 6 pages"),
            "{err}"
        );
        assert_eq!(all_pages(51, 50).unwrap_err().http_status(), 413);
        assert_eq!(all_pages(3, 50).unwrap(), [0, 1, 2]);
    }

    #[test]
    fn limits_are_checked() {
        let l = InputLimits::default();
        assert!(l.validate().is_ok());
        assert!(InputLimits { pdf_dpi: 0.0, ..l.clone() }.validate().is_err());
        assert!(InputLimits { max_pages: 0, ..l.clone() }.validate().is_err());
        assert!(l.check_image("PNG", 6000, 6000).is_ok());
        assert_eq!(l.check_image("PNG", 7000, 7000).unwrap_err().http_status(), 413);
        assert_eq!(l.check_image("PNG", 0, 7).unwrap_err().http_status(), 400);
    }
}
