//! The edit list of an MP4's audio track: which of its decoded samples are the
//! recording. An AAC encoder starts with priming samples (1,024 or 2,112) and pads the
//! last frame; the file's edit list (`moov/trak/edts/elst`) says where the recording
//! starts and how long it is. symphonia 0.5 reads the box but does not apply it, so a
//! voice memo decoded ~60-130 ms long and every timestamp came that much late.
//!
//! Only what the upload's bytes hold is read: every size is checked against the box it
//! sits in, and nothing is allocated by a declared count.

/// The recording within the decoded samples, in the track's media time scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Edit {
    /// Samples to drop at the start.
    pub skip: u64,
    /// Samples to keep after them, if the edit says.
    pub keep: Option<u64>,
    /// Units per second of `skip` and `keep` (the sample rate, as encoders write it).
    pub timescale: u32,
}

impl Edit {
    /// `skip` and `keep` in frames of `rate` Hz.
    pub fn in_frames(&self, rate: u32) -> (u64, Option<u64>) {
        let convert = |v: u64| {
            let frames = u128::from(v) * u128::from(rate) / u128::from(self.timescale.max(1));
            u64::try_from(frames).unwrap_or(u64::MAX)
        };
        (convert(self.skip), self.keep.map(convert))
    }
}

/// The first sound track's edit, when it is one plain segment (after any empty edits,
/// which delay the start and are ignored). Anything else — no edit list, several
/// segments, a damaged box — leaves the samples as decoded.
pub(crate) fn audio_edit(file: &[u8]) -> Option<Edit> {
    let moov = boxes(file).find(|(kind, _)| kind == b"moov")?.1;
    let movie_scale = boxes(moov).find(|(kind, _)| kind == b"mvhd").and_then(|(_, b)| timescale(b))?;
    for (_, trak) in boxes(moov).filter(|(kind, _)| kind == b"trak") {
        let Some((_, mdia)) = boxes(trak).find(|(kind, _)| kind == b"mdia") else { continue };
        let sound = boxes(mdia).any(|(kind, b)| &kind == b"hdlr" && b.get(8..12) == Some(b"soun".as_slice()));
        if !sound {
            continue;
        }
        let media_scale = boxes(mdia).find(|(kind, _)| kind == b"mdhd").and_then(|(_, b)| timescale(b))?;
        let edts = boxes(trak).find(|(kind, _)| kind == b"edts")?.1;
        let elst = boxes(edts).find(|(kind, _)| kind == b"elst")?.1;
        return segment(elst, movie_scale, media_scale);
    }
    None
}

/// The one non-empty segment of an `elst` payload.
fn segment(elst: &[u8], movie_scale: u32, media_scale: u32) -> Option<Edit> {
    let version = *elst.first()?;
    let count = u32::from_be_bytes(elst.get(4..8)?.try_into().ok()?);
    let size = if version == 1 { 20 } else { 12 };
    let entries = elst.get(8..)?;
    let available = entries.len() / size;
    let mut found = None;
    for entry in entries.chunks_exact(size).take((count as usize).min(available)) {
        let (duration, media_time) = if version == 1 {
            (be_u64(&entry[0..8]), i64::from_be_bytes(entry[8..16].try_into().ok()?))
        } else {
            (u64::from(be_u32(&entry[0..4])), i64::from(i32::from_be_bytes(entry[4..8].try_into().ok()?)))
        };
        if media_time == -1 {
            continue;
        }
        if found.is_some() || media_time < 0 || movie_scale == 0 || media_scale == 0 {
            return None;
        }
        let keep = (duration > 0).then(|| {
            let media = u128::from(duration) * u128::from(media_scale) / u128::from(movie_scale);
            u64::try_from(media).unwrap_or(u64::MAX)
        });
        found = Some(Edit { skip: media_time as u64, keep, timescale: media_scale });
    }
    found
}

/// `mvhd` / `mdhd`: the time scale after version, flags and the two dates.
fn timescale(full_box: &[u8]) -> Option<u32> {
    let at = if *full_box.first()? == 1 { 20 } else { 12 };
    Some(be_u32(full_box.get(at..at + 4)?))
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// The boxes in `data`, as (type, payload); stops at the first that does not fit.
fn boxes(data: &[u8]) -> impl Iterator<Item = ([u8; 4], &[u8])> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let header = rest.get(..8)?;
        let kind: [u8; 4] = header[4..8].try_into().ok()?;
        let (size, start) = match be_u32(&header[0..4]) {
            0 => (rest.len() as u64, 8),
            1 => (be_u64(rest.get(8..16)?), 16),
            n => (u64::from(n), 8),
        };
        let size = usize::try_from(size).ok().filter(|&s| s >= start && s <= rest.len())?;
        let payload = &rest[start..size];
        rest = &rest[size..];
        Some((kind, payload))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn atom(kind: &[u8; 4], payload: &[u8]) -> Vec<u8> {
        let mut b = ((payload.len() + 8) as u32).to_be_bytes().to_vec();
        b.extend_from_slice(kind);
        b.extend_from_slice(payload);
        b
    }

    fn full(version: u8, rest: &[u8]) -> Vec<u8> {
        let mut b = vec![version, 0, 0, 0];
        b.extend_from_slice(rest);
        b
    }

    /// A movie at 1,000 units a second holding one sound track at 16 kHz, its edit list
    /// `entries` (segment duration, media time).
    fn movie(entries: &[(u32, i32)]) -> Vec<u8> {
        let mvhd = atom(b"mvhd", &full(0, &[[0; 8].as_slice(), &1000u32.to_be_bytes(), &[0; 8]].concat()));
        let mdhd = atom(b"mdhd", &full(0, &[[0; 8].as_slice(), &16000u32.to_be_bytes(), &[0; 8]].concat()));
        let hdlr = atom(b"hdlr", &full(0, &[[0; 4].as_slice(), b"soun", &[0; 12]].concat()));
        let mut list = full(0, &(entries.len() as u32).to_be_bytes());
        for (duration, media_time) in entries {
            list.extend_from_slice(&duration.to_be_bytes());
            list.extend_from_slice(&media_time.to_be_bytes());
            list.extend_from_slice(&[0, 1, 0, 0]);
        }
        let edts = atom(b"edts", &atom(b"elst", &list));
        let trak = atom(b"trak", &[edts, atom(b"mdia", &[mdhd, hdlr].concat())].concat());
        [atom(b"ftyp", b"M4A "), atom(b"mdat", &[0; 100]), atom(b"moov", &[mvhd, trak].concat())].concat()
    }

    #[test]
    fn one_segment_after_the_priming() {
        let edit = audio_edit(&movie(&[(2990, 1024)])).unwrap();
        assert_eq!(edit, Edit { skip: 1024, keep: Some(47_840), timescale: 16_000 });
        assert_eq!(edit.in_frames(8_000), (512, Some(23_920)));
        // An empty edit first (a delayed start) is passed over.
        assert_eq!(audio_edit(&movie(&[(500, -1), (2990, 1024)])).unwrap().skip, 1024);
    }

    #[test]
    fn anything_else_leaves_the_samples_alone() {
        assert_eq!(audio_edit(&movie(&[])), None);
        assert_eq!(audio_edit(&movie(&[(1000, 0), (1000, 32_000)])), None, "two segments");
        assert_eq!(audio_edit(&movie(&[(1000, -5)])), None);
        let file = movie(&[(2990, 1024)]);
        for cut in [10, 40, file.len() - 30, file.len() - 1] {
            assert_eq!(audio_edit(&file[..cut]), None, "cut at {cut}");
        }
        // A count far beyond the bytes reads what is there.
        let mut lying = movie(&[(2990, 1024)]);
        let at = lying.windows(4).position(|w| w == b"elst").unwrap() + 8;
        lying[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(audio_edit(&lying).unwrap().skip, 1024);
    }
}
