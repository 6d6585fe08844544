//! Multi-page TIFF: every image file directory (IFD) is a page.
//!
//! The pages are found by walking the chain of directory offsets (a few bytes read
//! per page, nothing allocated per declared entry). A page is decoded by showing the
//! `image` crate's TIFF decoder — which reads only the first directory, with all its
//! colour and compression handling — a view of the file whose header points at that
//! page's directory. So each page goes through the same header check and limits as a
//! single image, and only one page's pixels exist at a time.

use std::io::{self, BufRead, Read, Seek, SeekFrom};

use crate::{
    bgr::BgrImage,
    decode::{decode_from, ImageKind},
    error::VisionError,
    limits::InputLimits,
};

/// Pages counted past this are not walked: the document is too long whatever the limit.
const MAX_WALKED_PAGES: usize = 100_000;

/// Where each page's directory starts, and how the header says so.
#[derive(Debug, Clone)]
pub struct TiffPages {
    directories: Vec<u64>,
    big: bool,
    little_endian: bool,
}

fn corrupt(reason: impl Into<String>) -> VisionError {
    VisionError::CorruptImage { format: "TIFF", reason: reason.into() }
}

impl TiffPages {
    /// Walks the directory chain of the TIFF in `bytes`.
    pub fn scan(bytes: &[u8]) -> Result<TiffPages, VisionError> {
        let little_endian = match bytes.get(..2) {
            Some(b"II") => true,
            Some(b"MM") => false,
            _ => return Err(corrupt("it has no byte-order mark")),
        };
        let read = |at: u64, n: usize| -> Result<u64, VisionError> {
            usize::try_from(at)
                .ok()
                .and_then(|at| uint(bytes, little_endian, at, n))
                .ok_or_else(|| corrupt("a directory offset is past the end of the file"))
        };
        let big = match read(2, 2)? {
            42 => false,
            43 => true,
            other => return Err(corrupt(format!("its version is {other}, not 42 or 43"))),
        };
        let Layout { count_size, entry_size, offset_size, .. } = Layout::of(big);
        let entry_size = entry_size as u64;
        let mut next = read(if big { 8 } else { 4 }, offset_size)?;
        let mut directories = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while next != 0 {
            if !seen.insert(next) {
                return Err(corrupt("its directories form a loop"));
            }
            if directories.len() == MAX_WALKED_PAGES {
                return Err(VisionError::TooManyPages { count: MAX_WALKED_PAGES, limit: MAX_WALKED_PAGES });
            }
            directories.push(next);
            let entries = read(next, count_size)?;
            let link = entries
                .checked_mul(entry_size)
                .and_then(|e| e.checked_add(next + count_size as u64))
                .ok_or_else(|| corrupt("a directory is larger than the file"))?;
            next = read(link, offset_size)?;
        }
        if directories.is_empty() {
            return Err(corrupt("it has no image directory"));
        }
        Ok(TiffPages { directories, big, little_endian })
    }

    pub fn count(&self) -> usize {
        self.directories.len()
    }

    /// Decodes page `index` (0-based) of `bytes`, the file `scan` read.
    pub fn decode_page(
        &self,
        bytes: &[u8],
        index: usize,
        limits: &InputLimits,
    ) -> Result<BgrImage, VisionError> {
        let &directory = self
            .directories
            .get(index)
            .ok_or(VisionError::PageOutOfRange { page: index + 1, count: self.count() })?;
        // The image crate reads such bits as if in the usual order and runs off the
        // end: "the file ends before the image does" sent a user looking for a cut.
        if self.entry_short(bytes, directory, FILL_ORDER) == Some(2) {
            return Err(VisionError::UnsupportedImage {
                format: "TIFF",
                reason: "its bits are in reversed order (FillOrder 2, as some fax software writes them); \
                         save it in the usual order (`tiffcp -f msb2lsb`)"
                    .into(),
            });
        }
        let (patch_at, patch_len) = if self.big { (8, 8) } else { (4, 4) };
        let mut patch = [0u8; 8];
        let value = if self.little_endian { directory.to_le_bytes() } else { directory.to_be_bytes() };
        if self.little_endian {
            patch[..patch_len].copy_from_slice(&value[..patch_len]);
        } else {
            patch[..patch_len].copy_from_slice(&value[8 - patch_len..]);
        }
        let view = PatchedView { data: bytes, pos: 0, patch_at, patch, patch_len };
        decode_from(view, ImageKind::Tiff, limits)
    }

    /// The first value of the directory's entry `tag` when it is a SHORT (type 3); the
    /// entries read are bounded by the file, not by the count the directory declares.
    fn entry_short(&self, bytes: &[u8], directory: u64, tag: u16) -> Option<u16> {
        let Layout { count_size, entry_size, value_at, .. } = Layout::of(self.big);
        let at = usize::try_from(directory).ok()?;
        let u16_at = |i: usize| uint(bytes, self.little_endian, i, 2).and_then(|v| u16::try_from(v).ok());
        let declared =
            usize::try_from(uint(bytes, self.little_endian, at, count_size)?).unwrap_or(usize::MAX);
        let fits = bytes.len().saturating_sub(at + count_size) / entry_size;
        (0..declared.min(fits))
            .map(|i| at + count_size + i * entry_size)
            .find(|&e| u16_at(e) == Some(tag) && u16_at(e + 2) == Some(3))
            .and_then(|e| u16_at(e + value_at))
    }
}

/// Sizes in a directory of a classic TIFF or a BigTIFF: its entry count, each entry,
/// the link to the next directory, and where an entry's value starts.
struct Layout {
    count_size: usize,
    entry_size: usize,
    offset_size: usize,
    value_at: usize,
}

impl Layout {
    fn of(big: bool) -> Layout {
        if big {
            Layout { count_size: 8, entry_size: 20, offset_size: 8, value_at: 12 }
        } else {
            Layout { count_size: 2, entry_size: 12, offset_size: 4, value_at: 8 }
        }
    }
}

/// The `n`-byte unsigned number at `at` in the file's byte order; `None` past its end.
fn uint(bytes: &[u8], little_endian: bool, at: usize, n: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(n)?)?;
    let mut v = 0u64;
    for i in 0..n {
        let byte = if little_endian { b[n - 1 - i] } else { b[i] };
        v = (v << 8) | u64::from(byte);
    }
    Some(v)
}

/// TIFF tag 266: 1 = the most significant bit of a byte first (the usual order), 2 = least.
const FILL_ORDER: u16 = 266;

/// `data` read through a cursor, with `patch` shown in place of the bytes at `patch_at`.
#[derive(Clone)]
struct PatchedView<'a> {
    data: &'a [u8],
    pos: u64,
    patch_at: usize,
    patch: [u8; 8],
    patch_len: usize,
}

impl PatchedView<'_> {
    /// The bytes from the cursor up to the next boundary between file and patch.
    fn chunk(&self) -> &[u8] {
        let len = self.data.len();
        let Ok(pos) = usize::try_from(self.pos) else { return &[] };
        if pos >= len {
            &[]
        } else if pos < self.patch_at {
            &self.data[pos..self.patch_at.min(len)]
        } else if pos < self.patch_at + self.patch_len {
            &self.patch[pos - self.patch_at..self.patch_len.min(len - self.patch_at)]
        } else {
            &self.data[pos..]
        }
    }
}

impl Read for PatchedView<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let chunk = self.chunk();
        let n = chunk.len().min(buf.len());
        buf[..n].copy_from_slice(&chunk[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl BufRead for PatchedView<'_> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        Ok(self.chunk())
    }

    fn consume(&mut self, amt: usize) {
        self.pos += amt as u64;
    }
}

impl Seek for PatchedView<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => (self.data.len() as u64).checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos =
            target.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before the start"))?;
        Ok(self.pos)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A two-page TIFF (8-bit RGB, uncompressed), each page one colour.
    pub(crate) fn two_page_tiff(pages: &[(u32, u32, [u8; 3])]) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut enc = tiff::encoder::TiffEncoder::new(std::io::Cursor::new(&mut out)).unwrap();
            for &(w, h, rgb) in pages {
                let data: Vec<u8> = rgb.iter().copied().cycle().take((w * h * 3) as usize).collect();
                enc.write_image::<tiff::encoder::colortype::RGB8>(w, h, &data).unwrap();
            }
        }
        out
    }

    #[test]
    fn every_directory_is_a_page() {
        let bytes = two_page_tiff(&[(4, 3, [255, 0, 0]), (2, 5, [0, 0, 255])]);
        let pages = TiffPages::scan(&bytes).unwrap();
        assert_eq!(pages.count(), 2);
        let limits = InputLimits::default();
        let first = pages.decode_page(&bytes, 0, &limits).unwrap();
        assert_eq!((first.width(), first.height(), first.pixel(0, 0)), (4, 3, [0, 0, 255]));
        let second = pages.decode_page(&bytes, 1, &limits).unwrap();
        assert_eq!((second.width(), second.height(), second.pixel(1, 4)), (2, 5, [255, 0, 0]));
        assert!(pages.decode_page(&bytes, 2, &limits).is_err());
    }

    #[test]
    fn a_page_over_the_limit_is_refused_alone() {
        let bytes = two_page_tiff(&[(4, 3, [255, 0, 0]), (100, 100, [0, 0, 255])]);
        let pages = TiffPages::scan(&bytes).unwrap();
        let limits = InputLimits { max_image_pixels: 1000, ..InputLimits::default() };
        assert!(pages.decode_page(&bytes, 0, &limits).is_ok());
        assert_eq!(pages.decode_page(&bytes, 1, &limits).unwrap_err().http_status(), 413);
    }

    #[test]
    fn reversed_bits_are_named() {
        let mut bytes = two_page_tiff(&[(1, 1, [1, 2, 3])]);
        let pages = TiffPages::scan(&bytes).unwrap();
        assert!(pages.decode_page(&bytes, 0, &InputLimits::default()).is_ok());
        // Turn the page's first entry into FillOrder = 2 (a SHORT).
        let first = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        let entry = first + 2;
        bytes[entry..entry + 2].copy_from_slice(&FILL_ORDER.to_le_bytes());
        bytes[entry + 2..entry + 4].copy_from_slice(&3u16.to_le_bytes());
        bytes[entry + 8..entry + 10].copy_from_slice(&2u16.to_le_bytes());
        let err = pages.decode_page(&bytes, 0, &InputLimits::default()).unwrap_err();
        assert!(err.to_string().contains("FillOrder 2"), "{err}");
        assert_eq!(err.http_status(), 400, "{err}");
    }

    #[test]
    fn a_directory_loop_is_corrupt() {
        let mut bytes = two_page_tiff(&[(1, 1, [1, 2, 3])]);
        let first = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        let count = u16::from_le_bytes(bytes[first..first + 2].try_into().unwrap()) as usize;
        let link = first + 2 + count * 12;
        bytes[link..link + 4].copy_from_slice(&(first as u32).to_le_bytes());
        let err = TiffPages::scan(&bytes).unwrap_err();
        assert!(err.to_string().contains("loop"), "{err}");
    }
}
