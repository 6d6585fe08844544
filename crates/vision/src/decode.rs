//! Image bytes to BGR pixels, with the size checked before any pixel is allocated.
//!
//! The header is read first (no limits needed: it allocates nothing in proportion
//! to what it declares) and the declared size is refused when over
//! `max_image_pixels`; only then is the image decoded, under the decoder's own memory
//! limit as a backstop. So a 100-byte PNG that declares 50,000 x 50,000 pixels costs
//! a header parse, not 7.5 GB.
//!
//! Colour follows rapidocr 3.10's `LoadImage`: RGBA is composited on white when its
//! visible pixels are dark on average and on black when they are light (so text keeps
//! its contrast), grey+alpha becomes `grey + (255 - alpha)` where visible and
//! `255 - alpha` where not, and grey is replicated. Unlike rapidocr, which reads a
//! palette PNG's indices as grey levels and 16-bit grey as out-of-range values, those
//! are converted to their real colours; and the EXIF orientation is applied, as
//! rapidocr does for a file path (not for bytes).

use std::io::{BufRead, Cursor, Seek};

use image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader};

use crate::{bgr::BgrImage, error::VisionError, limits::InputLimits};

/// The image formats /v1/ocr reads (PDF is handled apart, see `pdf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    Png,
    Jpeg,
    WebP,
    Tiff,
    Bmp,
}

impl ImageKind {
    pub fn name(self) -> &'static str {
        match self {
            ImageKind::Png => "PNG",
            ImageKind::Jpeg => "JPEG",
            ImageKind::WebP => "WebP",
            ImageKind::Tiff => "TIFF",
            ImageKind::Bmp => "BMP",
        }
    }

    fn format(self) -> ImageFormat {
        match self {
            ImageKind::Png => ImageFormat::Png,
            ImageKind::Jpeg => ImageFormat::Jpeg,
            ImageKind::WebP => ImageFormat::WebP,
            ImageKind::Tiff => ImageFormat::Tiff,
            ImageKind::Bmp => ImageFormat::Bmp,
        }
    }

    /// The format its first bytes announce.
    pub fn sniff(bytes: &[u8]) -> Option<ImageKind> {
        let starts = |magic: &[u8]| bytes.starts_with(magic);
        if starts(b"\x89PNG\r\n\x1a\n") {
            Some(ImageKind::Png)
        } else if starts(b"\xff\xd8\xff") {
            Some(ImageKind::Jpeg)
        } else if starts(b"RIFF") && bytes.get(8..12) == Some(b"WEBP") {
            Some(ImageKind::WebP)
        } else if starts(b"II*\0") || starts(b"MM\0*") || starts(b"II+\0") || starts(b"MM\0+") {
            Some(ImageKind::Tiff)
        } else if starts(b"BM") {
            Some(ImageKind::Bmp)
        } else {
            None
        }
    }
}

/// Decodes the image `bytes` hold (the first frame of an animation; for TIFF see
/// `tiff_pages`, which feeds each page through here).
pub fn decode_image(bytes: &[u8], kind: ImageKind, limits: &InputLimits) -> Result<BgrImage, VisionError> {
    // The JPEG decoder pads a scan that ends early with grey and says nothing: a page cut
    // in half would read as half its text.
    if kind == ImageKind::Jpeg && !jpeg_reaches_its_end(bytes) {
        return Err(VisionError::CorruptImage {
            format: kind.name(),
            reason: "the file ends before the image does (no end-of-image marker)".into(),
        });
    }
    decode_from(Cursor::new(bytes), kind, limits)
}

/// Whether a JPEG's segments lead to its end-of-image marker (`FF D9`): each header
/// segment is skipped by its length (so an EXIF thumbnail's own markers are never seen),
/// each scan's entropy-coded data up to the next marker (where `FF` is followed by `00`
/// or a restart marker). What follows the end (a camera's trailer) does not matter.
fn jpeg_reaches_its_end(bytes: &[u8]) -> bool {
    let mut i = 2;
    loop {
        // Fill bytes may pad before a marker.
        while bytes.get(i) == Some(&0xFF) && bytes.get(i + 1) == Some(&0xFF) {
            i += 1;
        }
        let (Some(0xFF), Some(&marker)) = (bytes.get(i), bytes.get(i + 1)) else { return false };
        match marker {
            0xD9 => return true,
            0x01 | 0xD0..=0xD7 => i += 2,
            _ => {
                let Some(length) = bytes.get(i + 2..i + 4) else { return false };
                i += 2 + usize::from(u16::from_be_bytes([length[0], length[1]]));
                if marker == 0xDA {
                    // The scan's data runs to the next marker that is not a stuffed
                    // zero or a restart.
                    loop {
                        let Some(at) = bytes.get(i..).and_then(|rest| rest.iter().position(|&b| b == 0xFF))
                        else {
                            return false;
                        };
                        i += at;
                        match bytes.get(i + 1) {
                            None => return false,
                            Some(0x00 | 0xD0..=0xD7) => i += 2,
                            Some(_) => break,
                        }
                    }
                }
            }
        }
    }
}

/// Decodes from `reader`; a panic inside a decoder (a bug there, triggered by a
/// malformed file) is caught and reported as a corrupt image.
pub(crate) fn decode_from<R: BufRead + Seek + Clone>(
    reader: R,
    kind: ImageKind,
    limits: &InputLimits,
) -> Result<BgrImage, VisionError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode_unguarded(reader, kind, limits)))
        .unwrap_or_else(|_| {
            Err(VisionError::CorruptImage {
                format: kind.name(),
                reason: "the decoder could not read it".into(),
            })
        })
}

fn decode_unguarded<R: BufRead + Seek + Clone>(
    reader: R,
    kind: ImageKind,
    limits: &InputLimits,
) -> Result<BgrImage, VisionError> {
    let name = kind.name();
    let mut probe = ImageReader::with_format(reader.clone(), kind.format());
    probe.no_limits();
    let (width, height) = probe.into_dimensions().map_err(|e| image_error(name, e))?;
    limits.check_image(name, width, height)?;

    let mut full = ImageReader::with_format(reader, kind.format());
    full.limits(decoder_limits(limits));
    let mut decoder = full.into_decoder().map_err(|e| image_error(name, e))?;
    // A decoder that disagrees with its own header is corrupt, not large.
    if decoder.dimensions() != (width, height) {
        return Err(VisionError::CorruptImage {
            format: name,
            reason: "its size changed while decoding".into(),
        });
    }
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut image = DynamicImage::from_decoder(decoder).map_err(|e| image_error(name, e))?;
    image.apply_orientation(orientation);
    Ok(to_bgr(image))
}

/// The decoder's own budget: the largest image allowed at 16 bits and four channels
/// (the widest output any accepted format decodes to), plus room for its tables.
fn decoder_limits(limits: &InputLimits) -> image::Limits {
    let mut l = image::Limits::default();
    l.max_alloc = Some(limits.max_image_pixels.saturating_mul(8).saturating_add(64 << 20));
    l
}

fn image_error(format: &'static str, e: ImageError) -> VisionError {
    match e {
        ImageError::Limits(l) => VisionError::DecoderLimit { format, reason: l.to_string() },
        ImageError::Unsupported(u) => VisionError::UnsupportedImage { format, reason: u.to_string() },
        ImageError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            VisionError::CorruptImage { format, reason: "the file ends before the image does".into() }
        }
        other => VisionError::CorruptImage { format, reason: other.to_string() },
    }
}

/// rapidocr's colour rules (see the module notes).
pub(crate) fn to_bgr(image: DynamicImage) -> BgrImage {
    let (width, height) = (image.width() as usize, image.height() as usize);
    let color = image.color();
    let data = match (color.has_color(), color.has_alpha()) {
        (true, true) => composite_rgba(image.into_rgba8().into_raw()),
        (false, true) => grey_alpha_to_bgr(&image.into_luma_alpha8().into_raw()),
        (false, false) => image.into_luma8().into_raw().iter().flat_map(|&v| [v, v, v]).collect(),
        (true, false) => {
            let mut rgb = image.into_rgb8().into_raw();
            rgb.chunks_exact_mut(3).for_each(|px| px.swap(0, 2));
            rgb
        }
    };
    BgrImage::from_bgr(width, height, data).unwrap_or_else(|| BgrImage::filled(width, height, [255; 3]))
}

/// rapidocr's `cvt_four_to_three`: the background that contrasts with the visible
/// pixels' mean luminance, blended in f32 and truncated, as numpy does.
fn composite_rgba(rgba: Vec<u8>) -> Vec<u8> {
    let (mut sum, mut visible) = (0f64, 0u64);
    for px in rgba.chunks_exact(4).filter(|px| px[3] > 0) {
        sum += 0.299 * f64::from(px[0]) + 0.587 * f64::from(px[1]) + 0.114 * f64::from(px[2]);
        visible += 1;
    }
    let light_text = visible > 0 && sum / visible as f64 >= 128.0;
    let background = if light_text { 0f32 } else { 255f32 };
    let mut bgr = Vec::with_capacity(rgba.len() / 4 * 3);
    for px in rgba.chunks_exact(4) {
        let a = f32::from(px[3]) / 255.0;
        let blend = |c: u8| (f32::from(c) * a + background * (1.0 - a)) as u8;
        bgr.extend([blend(px[2]), blend(px[1]), blend(px[0])]);
    }
    bgr
}

/// rapidocr's `cvt_two_to_three`: `grey` where alpha is not 0, plus `255 - alpha`,
/// saturating.
fn grey_alpha_to_bgr(la: &[u8]) -> Vec<u8> {
    la.chunks_exact(2)
        .flat_map(|px| {
            let shown = if px[1] != 0 { px[0] } else { 0 };
            let v = shown.saturating_add(255 - px[1]);
            [v, v, v]
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn encode(img: DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, format).unwrap();
        out.into_inner()
    }

    fn limits() -> InputLimits {
        InputLimits::default()
    }

    #[test]
    fn every_format_decodes_to_the_same_bgr_pixels() {
        let rgb = image::RgbImage::from_fn(7, 5, |x, y| image::Rgb([x as u8 * 30, y as u8 * 40, 200]));
        for (kind, format) in [
            (ImageKind::Png, ImageFormat::Png),
            (ImageKind::Bmp, ImageFormat::Bmp),
            (ImageKind::Tiff, ImageFormat::Tiff),
            (ImageKind::WebP, ImageFormat::WebP),
        ] {
            let bytes = encode(DynamicImage::ImageRgb8(rgb.clone()), format);
            assert_eq!(ImageKind::sniff(&bytes), Some(kind));
            let img = decode_image(&bytes, kind, &limits()).unwrap();
            assert_eq!((img.width(), img.height()), (7, 5), "{kind:?}");
            assert_eq!(img.pixel(6, 4), [200, 160, 180], "{kind:?} is lossless and BGR");
        }
        let jpeg = encode(DynamicImage::ImageRgb8(rgb), ImageFormat::Jpeg);
        assert_eq!(ImageKind::sniff(&jpeg), Some(ImageKind::Jpeg));
        let img = decode_image(&jpeg, ImageKind::Jpeg, &limits()).unwrap();
        assert_eq!((img.width(), img.height()), (7, 5));
    }

    #[test]
    fn alpha_follows_rapidocr() {
        // Dark, half-transparent text: composited on white.
        let dark =
            image::RgbaImage::from_fn(2, 1, |x, _| image::Rgba([0, 0, 0, if x == 0 { 255 } else { 128 }]));
        let img = decode_image(&encode(dark.into(), ImageFormat::Png), ImageKind::Png, &limits()).unwrap();
        assert_eq!(img.pixel(0, 0), [0, 0, 0]);
        assert_eq!(
            img.pixel(1, 0),
            [126, 126, 126],
            "255 * (1 - 128/255) in f32 is 126.99..., truncated (numpy too)"
        );
        // Light text: composited on black.
        let light = image::RgbaImage::from_fn(2, 1, |x, _| {
            image::Rgba([250, 250, 250, if x == 0 { 255 } else { 0 }])
        });
        let img = decode_image(&encode(light.into(), ImageFormat::Png), ImageKind::Png, &limits()).unwrap();
        assert_eq!(img.pixel(1, 0), [0, 0, 0]);
        // Grey + alpha: grey + 255 - alpha.
        let la = image::GrayAlphaImage::from_raw(3, 1, vec![10, 255, 10, 100, 10, 0]).unwrap();
        let img = decode_image(&encode(la.into(), ImageFormat::Png), ImageKind::Png, &limits()).unwrap();
        assert_eq!([img.pixel(0, 0)[0], img.pixel(1, 0)[0], img.pixel(2, 0)[0]], [10, 165, 255]);
        // 16-bit grey becomes 8-bit grey.
        let g16 = image::ImageBuffer::<image::Luma<u16>, _>::from_raw(1, 1, vec![65535u16]).unwrap();
        let img = decode_image(&encode(g16.into(), ImageFormat::Png), ImageKind::Png, &limits()).unwrap();
        assert_eq!(img.pixel(0, 0), [255, 255, 255]);
    }

    /// A PNG whose header declares `width` x `height` and whose data is a few bytes.
    pub(crate) fn png_header_only(width: u32, height: u32) -> Vec<u8> {
        fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
            out.extend((data.len() as u32).to_be_bytes());
            let start = out.len();
            out.extend(kind);
            out.extend(data);
            let crc = crc32(&out[start..]);
            out.extend(crc.to_be_bytes());
        }
        let mut ihdr = Vec::new();
        ihdr.extend(width.to_be_bytes());
        ihdr.extend(height.to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        chunk(&mut out, b"IHDR", &ihdr);
        chunk(&mut out, b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
        chunk(&mut out, b"IEND", &[]);
        out
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }

    #[test]
    fn a_huge_declared_size_is_refused_from_the_header() {
        let bytes = png_header_only(50_000, 50_000);
        assert!(bytes.len() < 100, "{} bytes", bytes.len());
        let err = decode_image(&bytes, ImageKind::Png, &limits()).unwrap_err();
        assert!(matches!(err, VisionError::ImageTooLarge { width: 50_000, height: 50_000, .. }), "{err}");
        assert_eq!(err.http_status(), 413);
        let err = decode_image(&png_header_only(0, 10), ImageKind::Png, &limits()).unwrap_err();
        assert_eq!(err.http_status(), 400, "{err}");
    }

    #[test]
    fn a_truncated_image_is_a_sentence_not_a_panic() {
        let rgb = image::RgbImage::from_fn(16, 16, |x, y| image::Rgb([(x * y) as u8, 0, 0]));
        let png = encode(rgb.into(), ImageFormat::Png);
        let err = decode_image(&png[..png.len() - 20], ImageKind::Png, &limits()).unwrap_err();
        assert_eq!(err.http_status(), 400);
        assert!(err.to_string().starts_with("the PNG image could not be decoded"), "{err}");
    }

    #[test]
    fn a_jpeg_cut_anywhere_is_refused_and_one_with_a_trailer_is_read() {
        let rgb = image::RgbImage::from_fn(64, 48, |x, y| {
            image::Rgb([(x * 4) as u8, (y * 5) as u8, (x ^ y) as u8])
        });
        let jpeg = encode(rgb.into(), ImageFormat::Jpeg);
        assert!(jpeg_reaches_its_end(&jpeg));
        // Every cut, even one that leaves a decodable scan (the decoder pads it silently).
        for cut in 2..jpeg.len() {
            assert!(!jpeg_reaches_its_end(&jpeg[..cut]), "cut at {cut} of {}", jpeg.len());
        }
        let err = decode_image(&jpeg[..jpeg.len() * 3 / 4], ImageKind::Jpeg, &limits()).unwrap_err();
        assert_eq!(err.http_status(), 400);
        assert!(err.to_string().contains("ends before the image does"), "{err}");
        // Data after the end (a camera's trailer, a motion photo's video) is not the image's.
        let mut trailer = jpeg.clone();
        trailer.extend_from_slice(b"\xFF\xD8 trailing bytes, not part of the image");
        assert_eq!(decode_image(&trailer, ImageKind::Jpeg, &limits()).unwrap().width(), 64);
    }
}
