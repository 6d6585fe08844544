//! The one pixel format every OCR stage works on: 8-bit BGR, row-major, no padding.
//!
//! BGR because rapidocr reads images with OpenCV's channel order and its three models
//! were trained and exported on it: the detector's, classifier's and recogniser's
//! inputs take blue first. Converting once, at decoding, keeps every later stage a
//! straight copy of what rapidocr does.

/// An 8-bit, three-channel image in blue-green-red order.
#[derive(Clone, PartialEq, Eq)]
pub struct BgrImage {
    width: usize,
    height: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for BgrImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BgrImage({}x{})", self.width, self.height)
    }
}

impl BgrImage {
    /// `None` unless `data` holds exactly `width * height * 3` bytes.
    pub fn from_bgr(width: usize, height: usize, data: Vec<u8>) -> Option<BgrImage> {
        (width.checked_mul(height)?.checked_mul(3)? == data.len()).then_some(BgrImage { width, height, data })
    }

    /// From red-green-blue triplets (what image decoders give).
    pub fn from_rgb(width: usize, height: usize, mut rgb: Vec<u8>) -> Option<BgrImage> {
        for px in rgb.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        BgrImage::from_bgr(width, height, rgb)
    }

    /// A `width` x `height` image filled with one colour (blue, green, red).
    pub fn filled(width: usize, height: usize, bgr: [u8; 3]) -> BgrImage {
        let data = bgr.iter().copied().cycle().take(width * height * 3).collect();
        BgrImage { width, height, data }
    }

    pub fn width(&self) -> usize {
        self.width
    }

    pub fn height(&self) -> usize {
        self.height
    }

    /// The pixels, `[b, g, r]` per pixel, row after row.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    pub fn into_data(self) -> Vec<u8> {
        self.data
    }

    /// One row's bytes.
    pub fn row(&self, y: usize) -> &[u8] {
        &self.data[y * self.width * 3..(y + 1) * self.width * 3]
    }

    pub fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = (y * self.width + x) * 3;
        [self.data[i], self.data[i + 1], self.data[i + 2]]
    }

    /// Red-green-blue bytes (for saving or showing).
    pub fn to_rgb(&self) -> Vec<u8> {
        let mut rgb = self.data.clone();
        for px in rgb.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        rgb
    }

    /// Turned 90 degrees counter-clockwise (numpy's `rot90`): the top row becomes the
    /// left column, read bottom-up.
    pub fn rotate90_ccw(&self) -> BgrImage {
        let (w, h) = (self.width, self.height);
        let mut data = vec![0u8; w * h * 3];
        for out_y in 0..w {
            for out_x in 0..h {
                let (src_x, src_y) = (w - 1 - out_y, out_x);
                let s = (src_y * w + src_x) * 3;
                let d = (out_y * h + out_x) * 3;
                data[d..d + 3].copy_from_slice(&self.data[s..s + 3]);
            }
        }
        BgrImage { width: h, height: w, data }
    }

    /// Turned upside down (`cv2.rotate(img, ROTATE_180)`).
    pub fn rotate180(&self) -> BgrImage {
        let mut data = Vec::with_capacity(self.data.len());
        for px in self.data.chunks_exact(3).rev() {
            data.extend_from_slice(px);
        }
        BgrImage { width: self.width, height: self.height, data }
    }

    /// `top` black rows above and `bottom` below (`cv2.copyMakeBorder`, constant 0).
    pub fn pad_vertical(&self, top: usize, bottom: usize) -> BgrImage {
        let row = self.width * 3;
        let mut data = vec![0u8; row * (self.height + top + bottom)];
        data[row * top..row * (top + self.height)].copy_from_slice(&self.data);
        BgrImage { width: self.width, height: self.height + top + bottom, data }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(w: usize, h: usize) -> BgrImage {
        let data = (0..w * h).flat_map(|i| [i as u8, 0, 100]).collect();
        BgrImage::from_bgr(w, h, data).unwrap()
    }

    #[test]
    fn rotations_move_pixels_like_numpy() {
        let img = numbered(3, 2); // [[0,1,2],[3,4,5]]
        let r = img.rotate90_ccw(); // np.rot90: [[2,5],[1,4],[0,3]]
        assert_eq!((r.width(), r.height()), (2, 3));
        let firsts: Vec<u8> = r.data().chunks(3).map(|p| p[0]).collect();
        assert_eq!(firsts, [2, 5, 1, 4, 0, 3]);
        let u = img.rotate180();
        let firsts: Vec<u8> = u.data().chunks(3).map(|p| p[0]).collect();
        assert_eq!(firsts, [5, 4, 3, 2, 1, 0]);
        assert_eq!(u.rotate180(), img);
    }

    #[test]
    fn sizes_are_checked_and_channels_swapped() {
        assert!(BgrImage::from_bgr(2, 2, vec![0; 11]).is_none());
        assert!(BgrImage::from_bgr(usize::MAX, 2, vec![]).is_none());
        let img = BgrImage::from_rgb(1, 1, vec![1, 2, 3]).unwrap();
        assert_eq!(img.pixel(0, 0), [3, 2, 1]);
        assert_eq!(img.to_rgb(), [1, 2, 3]);
        let padded = img.pad_vertical(2, 1);
        assert_eq!(padded.height(), 4);
        assert_eq!(padded.pixel(0, 2), [3, 2, 1]);
        assert_eq!(padded.pixel(0, 0), [0, 0, 0]);
    }
}
